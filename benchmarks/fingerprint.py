"""What a checkpoint's fingerprints cost (scaletrain/store/integrity.py), next to a train step.

    python benchmarks/fingerprint.py cpu [--steps N] [--cpu-devices 8]   # measured: configs/llama_tiny.yaml here
    python benchmarks/fingerprint.py tpu [--topology v5p:4x4x2] [--config configs/llama3_8b.yaml]

`cpu` times the real train step and the fingerprint of the whole training state (parameters, Adam's moments)
on this machine's simulated devices. `tpu` compiles the fingerprint ahead of time for a TPU topology and prints
XLA's estimate; the function has no loops (unless the state is offloaded), so the estimate needs no loop
correction. The fingerprint runs once per save, not per step. Results belong in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaletrain import config, runtime  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _median_s(fn, repeats: int) -> float:
    import jax

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu(args) -> None:
    import jax

    from scaletrain.data import loader as data
    from scaletrain.store import integrity
    from scaletrain.train import trainer

    cfg = config.load(args.config or ROOT / "configs" / "llama_tiny.yaml", args.set)
    setup = trainer.build(cfg)
    iterator = data.make_iterator(cfg, setup.batch_sharding)
    state = setup.init(jax.random.PRNGKey(0))
    step = setup.step.lower(*setup.abstract_args()).compile()
    fingerprint = integrity.make(setup.abstract_state)
    jax.block_until_ready(fingerprint(state))  # compiled
    holder, no_ceiling = [state], setup.loss_ceiling()

    def train_step():
        holder[0], metrics = step(holder[0], setup.put_batch(next(iterator)), no_ceiling)
        return metrics

    for _ in range(3):
        train_step()
    step_s = _median_s(train_step, args.steps)
    fingerprint_s = _median_s(lambda: fingerprint(holder[0]), args.steps)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(holder[0]))
    every = cfg.checkpoint.every_steps
    print(f"{cfg.model.num_layers} layers, d_model {cfg.model.d_model}: state {state_bytes / 2**20:.1f} MiB on "
          f"{jax.device_count()} {jax.devices()[0].platform} devices")
    print(f"train step (median of {args.steps}): {step_s * 1e3:.1f} ms")
    print(f"fingerprint of the state (median of {args.steps}): {fingerprint_s * 1e3:.2f} ms = "
          f"{fingerprint_s / step_s:.2%} of a step; once per save (checkpoint.every_steps={every}): "
          f"{fingerprint_s / step_s / every:.3%} of training time")


def tpu(args) -> None:
    import jax

    from scaletrain.planner import aot
    from scaletrain.store import integrity
    from scaletrain.train import trainer

    cfg = config.load(args.config or ROOT / "configs" / "llama3_8b.yaml", args.set)
    setup = trainer.build(cfg, aot.topology_devices(args.topology))
    t0 = time.perf_counter()
    compiled = integrity.make(setup.abstract_state).lower(setup.abstract_state).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    state_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                      for x in jax.tree.leaves(setup.abstract_state))  # per chip
    print(f"{args.topology}, {cfg.model.num_layers} layers, d_model {cfg.model.d_model}: compiled in "
          f"{time.perf_counter() - t0:.1f} s")
    print(f"fingerprint: XLA estimate {cost['optimal_seconds'] * 1e3:.2f} ms per save, "
          f"{cost['bytes accessed'] / 2**30:.2f} GiB read per chip (state {state_bytes / 2**30:.2f} GiB)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("where", choices=["cpu", "tpu"])
    p.add_argument("--config", default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=10, help="timed repeats")
    p.add_argument("--cpu-devices", type=int, default=8)
    p.add_argument("--topology", default="v5p:4x4x2")
    args = p.parse_args()
    runtime.configure(args.cpu_devices if args.where == "cpu" else None)
    (cpu if args.where == "cpu" else tpu)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
