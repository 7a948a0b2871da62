"""What run health costs a step on this machine's CPUs (docs/health.md).

  python benchmarks/health_overhead.py [--steps N]

Trains configs/llama_tiny.yaml (8 simulated CPU devices) for N steps and takes its median step time from
metrics.jsonl; then times, in a loop of 20,000 steps' worth, exactly the calls the training loop makes each step
for goodput (the ledger's step record, the check whether the devices waited for a batch), for the hang watchdog
(four phase changes, a step time), for the loss-spike rule (a step's ceiling from a full window of 100, its
judgement) and for naming stragglers (a batch time, its mean, the check over 256 processes' times), and one write
of goodput.json (made every 2 s). Prints each cost and their share of the step. The watchdog's own thread wakes
every 0.5 s to compare two numbers: not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CALLS = 20_000


def step_time(steps: int, run_dir: Path) -> float:
    from scaletrain.__main__ import main

    code = main(["train", "--config", str(ROOT / "configs" / "llama_tiny.yaml"), "--cpu-devices", "8",
                 "--set", f"run_dir={run_dir}", "--set", f"steps={steps}", "--set", f"checkpoint.every_steps={steps}"])
    assert code == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "event" not in r]  # a loss spike warned of is no step
    return statistics.median(r["step_time_s"] for r in records[steps // 2:])  # past the first, slower steps


def per_step_costs(run_dir: Path) -> dict[str, float]:
    import jax
    import jax.numpy as jnp

    from scaletrain.train.goodput import Ledger
    from scaletrain.train.spike import SpikeRule
    from scaletrain.train.stragglers import BatchTimes, Stragglers
    from scaletrain.train.watchdog import Watchdog

    ledger, dog = Ledger(str(run_dir), 0, time.perf_counter()), Watchdog(str(run_dir), 0, 20.0, 600.0, False)
    metrics = {name: jnp.ones(()) for name in ("loss", "grad_norm", "learning_rate", "update_skipped")}
    ledger.loop_started()
    try:
        t0 = time.perf_counter()
        for step in range(CALLS):
            ledger.stepped(step)
            all(x.is_ready() for x in jax.tree.leaves(metrics))
        goodput = (time.perf_counter() - t0) / CALLS
        t0 = time.perf_counter()
        for step in range(CALLS):
            for phase in ("step", "data", "step", "step"):
                dog.enter(phase, step)
            dog.step_time(0.03)
        watchdog = (time.perf_counter() - t0) / CALLS
        rule = SpikeRule("warn", 2.0, 100)
        for step in range(1, 102):
            rule.judge(step, 3.0, applied=True)
        t0 = time.perf_counter()
        for step in range(103, 103 + CALLS):
            rule.dispatched(step)
            rule.judge(step - 1, 3.0, applied=True)
        spike = (time.perf_counter() - t0) / CALLS
        times, stragglers, pod = BatchTimes(), Stragglers(0.25), tuple(0.01 * (p % 7) for p in range(256))
        t0 = time.perf_counter()
        for step in range(CALLS):
            times.add(0.01)
            times.mean()
            stragglers.check(step, pod, 1.0)
        straggler = (time.perf_counter() - t0) / CALLS
        t0 = time.perf_counter()
        for _ in range(200):
            ledger.write()
        write = (time.perf_counter() - t0) / 200
    finally:
        dog.close()
    return {"goodput per step": goodput, "watchdog per step": watchdog, "spike rule per step": spike,
            "stragglers per step": straggler, "goodput.json write": write}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        step = step_time(args.steps, Path(tmp) / "run")
        (Path(tmp) / "costs").mkdir()
        costs = per_step_costs(Path(tmp) / "costs")
    # The write happens once per WRITE_EVERY_S of stepping: its share of a step is its time over those seconds.
    from scaletrain.train.goodput import WRITE_EVERY_S

    per_step = sum(seconds for name, seconds in costs.items() if name.endswith("per step"))
    share = per_step / step + costs["goodput.json write"] / WRITE_EVERY_S
    print(f"tiny CPU step (median of the last {args.steps - args.steps // 2}): {step * 1e3:.1f} ms")
    for name, seconds in costs.items():
        print(f"  {name}: {seconds * 1e6:.1f} us")
    print(f"health's share of a step: {share:.3%}")


if __name__ == "__main__":
    main()
