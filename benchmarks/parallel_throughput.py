"""Throughput of every mesh of the equivalence matrix on 8 CPU devices, with the collectives each compiles to.

    python benchmarks/parallel_throughput.py [--model maxtext|tiny] [--steps N] [--warmup N] [--set K=V]...

Meshes: data x fsdp x tensor = 8 with degrees 1, 2, 4, 8, under ZeRO-3 (`fsdp`) and ZeRO-1; a mesh the model
cannot take (heads not divisible by tensor) is listed with its error. Collective bytes are the full-array
bytes per step from the compiled HLO (planner/hlo.py), by effective kind. Results go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.train_throughput import MODELS, measure  # noqa: E402
from scaletrain import runtime  # noqa: E402
from scaletrain.errors import UserError  # noqa: E402

MESHES = [(preset, d, f, t) for preset in ("fsdp", "zero1")
          for d, f, t in itertools.product((1, 2, 4, 8), repeat=3) if d * f * t == 8]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(MODELS), default="maxtext")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mesh")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    runtime.configure(8)
    import jax

    print(f"# {time.strftime('%Y-%m-%d')}  {platform.machine()} {platform.processor()}  "
          f"jax {jax.__version__}  {jax.device_count()} x {jax.devices()[0].device_kind}  model {args.model}")
    print("| preset | data | fsdp | tensor | step ms | tokens/s | MFU | all-gather MB | reduce-scatter MB | "
          "all-reduce MB | other MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for preset, d, f, t in MESHES:
        overrides = [f"sharding.preset={preset}", f"mesh.data={d}", f"mesh.fsdp={f}", f"mesh.tensor={t}", *args.set]
        row = f"| {preset} | {d} | {f} | {t} |"
        try:
            r = measure(args.model, args.steps, args.warmup, overrides, inventory=True)
        except UserError as e:
            print(f"{row} not valid: {e} |||||||", flush=True)
            continue
        mb = {k: v["bytes"] / 1e6 for k, v in r["collectives"].items()}
        other = sum(v for k, v in mb.items() if k not in ("all-gather", "reduce-scatter", "all-reduce"))
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        print(f"{row} {r['step_time_s'] * 1e3:.0f} | {r['tokens_per_sec']:,.0f} | {mfu} | "
              f"{mb.get('all-gather', 0):.1f} | {mb.get('reduce-scatter', 0):.1f} | {mb.get('all-reduce', 0):.1f} | "
              f"{other:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
