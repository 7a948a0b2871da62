"""The loop correction against the program it stands for: XLA's counts of the train step with every model loop
unrolled, at several depths, beside the counts the correction derives from two small compiles.

    python benchmarks/loop_correction.py [--config configs/llama_tiny.yaml] [--topology v5p:2x2x2]
                                         [--layers 1,2,3,4,6,8] [--set K=V]... [--json]

For each depth L: XLA's flops and bytes accessed of the unrolled step (aot.unrolled_cost), and what the
correction from layers (a, b) predicts for it, c(a) + (L - a)(c(b) - c(a)) / (b - a), for (1, 2) (the
correction before issue 30) and (2, 3) (planner/aot.py's now), with the error of each. Results belong in
docs/benchmarks.md with the command, the commit and the date.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaletrain import config  # noqa: E402
from scaletrain.planner import aot  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("flops", "bytes accessed")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "llama_tiny.yaml"))
    p.add_argument("--topology", default="v5p:2x2x2")
    p.add_argument("--layers", default="1,2,3,4,6,8")
    p.add_argument("--set", action="append", default=[], metavar="K=V")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    depths = sorted({int(x) for x in args.layers.split(",")} | {1, 2, 3})
    devices = aot.topology_devices(args.topology)
    costs = {}
    for layers in depths:
        cfg = config.load(args.config, args.set + [f"model.num_layers={layers}"])
        costs[layers] = aot.unrolled_cost(cfg, devices)
        print(f"compiled {layers} layers unrolled", file=sys.stderr, flush=True)

    def predicted(a: int, b: int, layers: int, key: str) -> float:
        return costs[a][key] + (layers - a) * (costs[b][key] - costs[a][key]) / (b - a)

    rows = []
    for layers in depths:
        row = {"layers": layers}
        for key in KEYS:
            row[key] = costs[layers][key]
            for a, b in ((1, 2), (2, 3)):
                row[f"{key} error from ({a},{b})"] = predicted(a, b, layers, key) / costs[layers][key] - 1
        rows.append(row)
    if args.json:
        print(json.dumps({"topology": args.topology, "config": args.config, "set": args.set, "rows": rows}))
        return
    print(f"{args.topology}, {Path(args.config).name} {' '.join(args.set)}")
    print("layers | GFLOP | error (1,2) | error (2,3) | MB accessed | error (1,2) | error (2,3)")
    for r in rows:
        print(f"{r['layers']} | {r['flops'] / 1e9:.4g} | {r['flops error from (1,2)']:+.2%} | "
              f"{r['flops error from (2,3)']:+.2%} | {r['bytes accessed'] / 1e6:.4g} | "
              f"{r['bytes accessed error from (1,2)']:+.2%} | {r['bytes accessed error from (2,3)']:+.2%}")


if __name__ == "__main__":
    main()
