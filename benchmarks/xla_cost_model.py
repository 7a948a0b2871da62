"""What XLA's TPU cost model assumes a chip attains: the fraction of its peak bf16 matmul rate and of its HBM
bandwidth (scaletrain/facts/hardware.yaml) at which libtpu's `optimal_seconds` times a large matmul and a large
elementwise pass, compiled ahead of time for one chip of each TPU generation (no TPU needed).

The planner's step time (planner/roofline.py) times the step's matmuls and memory-bound passes at these fractions,
so that it predicts what the loop-corrected compile reports; hardware.yaml records them per chip as
`xla_matmul_efficiency` and `xla_hbm_efficiency`, with the date and libtpu this script was run with.

    python benchmarks/xla_cost_model.py [--chips v4,v5e,v5p,v6e]

Matmuls of every size the planner meets on the 8B-70B models ([tokens, d] x [d, f] with tokens >= 8192, d and f
multiples of 1024); smaller ones (4096 x 4096 x 4096 and below) are timed slower still, and are not in the steps
the planner is trusted for (docs/tune.md).
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from scaletrain.facts import hardware  # noqa: E402

TOPOLOGY = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
MATMULS = [(8192, 4096, 14336), (32768, 4096, 4096), (32768, 4096, 1024), (16384, 8192, 28672), (65536, 8192, 8192)]
ELEMENTWISE = [(32768, 4096), (16384, 14336), (65536, 8192)]


def _optimal(fn, device, *shapes) -> tuple[float, float, float]:
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=SingleDeviceSharding(device)) for s in shapes]
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return cost["flops"], cost["bytes accessed"], cost["optimal_seconds"]


def efficiencies(chip_name: str, matmuls=MATMULS, elementwise=ELEMENTWISE) -> tuple[float, float]:
    """(matmul, HBM): the medians over `matmuls` and `elementwise` of peak time / XLA's optimal_seconds."""
    chip = hardware.spec(chip_name)
    device = topologies.get_topology_desc(topology_name=TOPOLOGY[chip_name], platform="tpu").devices[0]
    matmul = []
    for t, d, f in matmuls:
        flops, _, seconds = _optimal(lambda a, b: a @ b, device, (t, d), (d, f))
        matmul.append(flops / chip.bf16_flops / seconds)
    hbm = []
    for shape in elementwise:
        _, moved, seconds = _optimal(lambda x, y: jax.nn.silu(x) * y, device, shape, shape)
        hbm.append(moved / chip.hbm_bandwidth / seconds)
    return statistics.median(matmul), statistics.median(hbm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chips", default=",".join(TOPOLOGY))
    args = parser.parse_args()
    print(f"jax {jax.__version__}; fraction of the chip's peak at which XLA's cost model times a large matmul and a "
          f"large elementwise pass")
    print("| chip | matmul | HBM |\n|---|---|---|")
    for name in args.chips.split(","):
        matmul, hbm = efficiencies(name)
        print(f"| {name} | {matmul:.3f} | {hbm:.3f} |")


if __name__ == "__main__":
    main()
