"""HBM per device and XLA's time estimate for each remat policy and state offload, by ahead-of-time compiles
for a TPU topology.

    python benchmarks/remat_memory.py [--config configs/llama3_8b.yaml] [--topology v5p:4x4x2]
        [--policy P]... [--offload none|optim|params]... [--set K=V]...

Each policy's real train step is compiled through libtpu on this machine (no TPU needed), or, with
`--topology cpu`, for this machine's own devices. Memory comes from
`memory_analysis()`; `optimal_seconds` is XLA's estimate, which counts a while loop's body once (so a scanned
layer stack is undercounted: compare policies with it, not with measured step times). Results go in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaletrain import config, remat, runtime  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OFFLOAD = {"none": [], "optim": ["optim.offload=true"], "params": ["params.offload=true"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "llama3_8b.yaml"))
    p.add_argument("--topology", default="v5p:4x4x2", help="a TPU topology, or 'cpu' for this machine's devices")
    p.add_argument("--policy", action="append", default=None, help="default: every policy but custom")
    p.add_argument("--offload", action="append", choices=tuple(OFFLOAD), default=None,
                   help="state in host memory: none (default), optim (Adam moments), params (and parameters)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    runtime.configure(None)
    import jax
    from jax.experimental import topologies

    from scaletrain.facts import fit
    from scaletrain.train import trainer

    devices = jax.devices() if args.topology == "cpu" else \
        topologies.get_topology_desc(topology_name=args.topology, platform="tpu").devices
    print(f"# {time.strftime('%Y-%m-%d')}  {args.config} on {args.topology} ({len(devices)} chips)  "
          f"{' '.join(args.set)}")
    print("| policy | offload | HBM per device GiB | of which temporaries GiB | host GiB | XLA optimal_seconds | "
          "compile s |")
    print("|---|---|---|---|---|---|---|")
    for policy in args.policy or [p for p in remat.POLICIES if p != "custom"]:
        for offload in args.offload or ["none"]:
            cfg = config.load(args.config, [f"remat.policy={policy}", *OFFLOAD[offload], *args.set])
            setup = trainer.build(cfg, devices)
            t0 = time.perf_counter()
            try:
                compiled = setup.step.lower(*setup.abstract_args()).compile()
            except Exception as e:  # noqa: BLE001 - an out-of-memory compile is a result too
                print(f"| {policy} | {offload} | does not compile: {str(e).splitlines()[0][:120]} |||||", flush=True)
                continue
            seconds = time.perf_counter() - t0
            m = fit.compiled(compiled.memory_analysis())
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            print(f"| {policy} | {offload} | {m['device_total'] / fit.GIB:.2f} | "
                  f"{m['device_temporaries'] / fit.GIB:.2f} | {m['host_total'] / fit.GIB:.2f} | "
                  f"{cost.get('optimal_seconds', float('nan')):.3f} | {seconds:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
