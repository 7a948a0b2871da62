"""What XLA's TPU cost model assumes a chip attains: the fraction of its peak bf16 matmul rate and of its HBM
bandwidth (scaletrain/facts/hardware.yaml) at which libtpu's `optimal_seconds` times a large matmul and a large
elementwise pass, compiled ahead of time for one chip of each TPU generation (no TPU needed); and the bytes it
counts for the two operations a dropless mixture of experts moves its routed rows with (models/mixtral/moe.py),
as passes over those rows: a gather (`table[indices]`, each permutation of the rows) and a ragged all-to-all
(expert parallelism's dispatch and return, over 4 chips).

The planner's step time (planner/roofline.py) times the step's matmuls and memory-bound passes at these fractions,
so that it predicts what the loop-corrected compile reports; hardware.yaml records them per chip as
`xla_matmul_efficiency` and `xla_hbm_efficiency`, with the date and libtpu this script was run with.

    python benchmarks/xla_cost_model.py [--chips v4,v5e,v5p,v6e]

A gather counts far more than the rows it reads and writes: v5p and v6e 2 passes over the table and 12 over the
rows gathered, v4 and v5e 9 over the rows (libtpu 0.0.50.1), whatever the rows' width or dtype; a ragged
all-to-all 3 over the rows it sends and 5 over the buffer it fills (its zero-filled output and the layout copies
on either side) when the rows' width is a multiple of 1024 - more for others, whose rows it pads (GPT-OSS's
2880: 5.3 and 7.3). The step estimate counts them (planner/estimate.py, `transport_bytes`).

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
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding  # noqa: E402

from scaletrain.facts import hardware  # noqa: E402

TOPOLOGY = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
MATMULS = [(8192, 4096, 14336), (32768, 4096, 4096), (32768, 4096, 1024), (16384, 8192, 28672), (65536, 8192, 8192)]
ELEMENTWISE = [(32768, 4096), (16384, 14336), (65536, 8192)]
# The routed rows of the passes below: a device's rows at 16384 tokens and k 4, 2048 wide (a multiple of 1024).
ROWS, WIDTH = 65536, 2048


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


def _bytes(fn, args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]


def gather_passes(chip_name: str) -> tuple[float, float]:
    """(table, rows): XLA's bytes for gathering ROWS rows as passes over the table and over the rows gathered,
    from two gathers of the same rows out of tables of 1 and 4 times their number."""
    sharding = SingleDeviceSharding(topologies.get_topology_desc(topology_name=TOPOLOGY[chip_name],
                                                                 platform="tpu").devices[0])
    rows_bytes = ROWS * WIDTH * 2

    def passes(table_rows: int) -> float:
        args = [jax.ShapeDtypeStruct((table_rows, WIDTH), jnp.bfloat16, sharding=sharding),
                jax.ShapeDtypeStruct((ROWS,), jnp.int32, sharding=sharding)]
        return _bytes(lambda table, indices: table[indices], args) / rows_bytes

    same, four = passes(ROWS), passes(4 * ROWS)
    return (four - same) / 3, same - (four - same) / 3


def exchange_passes(chip_name: str, shards: int = 4) -> tuple[float, float]:
    """(sent, received): XLA's bytes for a ragged all-to-all over `shards` chips as passes over the rows a chip
    sends and over the buffer it receives them into, from three exchanges of different sizes."""
    devices = topologies.get_topology_desc(topology_name=TOPOLOGY[chip_name], platform="tpu").devices[:shards]
    mesh = Mesh(devices, ("e",))

    def rows(sent: int, buffer: int) -> float:
        def exchange(x, sizes):  # the sizes' values are irrelevant to the cost: only their shapes
            me = jax.lax.axis_index("e")
            sizes = sizes.reshape(shards, shards)
            offsets = jnp.cumsum(sizes, axis=1) - sizes
            return jax.lax.ragged_all_to_all(x, jnp.zeros((buffer, WIDTH), x.dtype), offsets[me], sizes[me],
                                             (jnp.cumsum(sizes, axis=0) - sizes)[me], sizes[:, me], axis_name="e")

        spec = NamedSharding(mesh, PartitionSpec("e"))
        args = [jax.ShapeDtypeStruct((shards * sent, WIDTH), jnp.bfloat16, sharding=spec),
                jax.ShapeDtypeStruct((shards ** 3,), jnp.int32, sharding=spec)]
        step = jax.shard_map(exchange, mesh=mesh, in_specs=(spec.spec, spec.spec), out_specs=spec.spec)
        return _bytes(step, args) / (WIDTH * 2)

    both = rows(ROWS, 4 * ROWS)
    received = (both - rows(ROWS, 2 * ROWS)) / (2 * ROWS)
    return (both - received * 4 * ROWS) / ROWS, received


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chips", default=",".join(TOPOLOGY))
    args = parser.parse_args()
    print(f"jax {jax.__version__}; fraction of the chip's peak at which XLA's cost model times a large matmul and a "
          f"large elementwise pass; passes it counts for a gather (over its table, its rows) and a ragged "
          f"all-to-all (over the rows sent, the buffer received)")
    print("| chip | matmul | HBM | gather | ragged all-to-all |\n|---|---|---|---|---|")
    for name in args.chips.split(","):
        matmul, hbm = efficiencies(name)
        gather, exchange = gather_passes(name), exchange_passes(name)
        print(f"| {name} | {matmul:.3f} | {hbm:.3f} | {gather[0]:.2f}, {gather[1]:.2f} | "
              f"{exchange[0]:.2f}, {exchange[1]:.2f} |")


if __name__ == "__main__":
    main()
