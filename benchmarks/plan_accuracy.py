"""The planner against the compiler, for every TPU config the project ships on the slice its header documents:
the plan's HBM per chip and step estimate (`python -m scaletrain plan`) beside what XLA compiles for that
topology (`python -m scaletrain compile`, loop-corrected, the flash kernels' time added), and their errors
against the targets docs/tune.md states (10% of the compiled HBM, 15% of the compiled step).

    python benchmarks/plan_accuracy.py [--only llama3_8b,...] [--out runs/plan_accuracy]

Each compile's result is kept as OUT/<config>-<hash of the config's text and the trainer's code>.json, so a
rerun after a planner change compiles nothing; a changed config or trainer compiles again. Prints a markdown
table (docs/benchmarks.md records it). Compiles take minutes each on a CPU (libtpu: no TPU needed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

ROOT = Path(__file__).resolve().parents[1]
# Each TPU config and the slice its header names; Mixtral with its recipe's scoped-VMEM limit, without which libtpu
# refuses the grouped matmuls' kernels (docs/moe.md).
CONFIGS = {
    "llama3_1b": ("v5p:2x2x2", {}),
    "llama3_8b": ("v5p:4x4x2", {}),
    "llama3_8b_128k": ("v5p:4x4x2", {}),
    "llama3_70b": ("v5p:4x4x4", {}),
    "mixtral_8x7b": ("v5p:4x4x4", {"LIBTPU_INIT_ARGS": "--xla_tpu_scoped_vmem_limit_kib=81920"}),
}
TARGETS = {"memory": 0.10, "step": 0.15}


def _key(name: str) -> str:
    """The config's text and the code that builds the step: what the compile depends on (not the planner)."""
    digest = hashlib.sha256((ROOT / "configs" / f"{name}.yaml").read_bytes())
    for folder in ("models", "kernels", "parallel", "train"):
        for path in sorted((ROOT / "scaletrain" / folder).rglob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def compiled(name: str, topology: str, env: dict[str, str], out: Path) -> dict:
    """`compile --json`'s result, in a process of its own (libtpu reads its options once per process)."""
    path = out / f"{name}-{_key(name)}.json"
    if not path.exists():
        print(f"compiling {name} for {topology} ...", flush=True)
        done = subprocess.run([sys.executable, "-m", "scaletrain", "compile", "--config", f"configs/{name}.yaml",
                               "--topology", topology, "--json"], cwd=ROOT, env={**os.environ, **env},
                              capture_output=True, text=True)
        if done.returncode not in (0, 3):  # 3: compiled, does not fit - a result
            sys.exit(f"error: compiling {name} failed:\n{done.stderr[-2000:]}")
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(done.stdout)
    return json.loads(path.read_text())


def _error(predicted: float, actual: float | None) -> str:
    return "-" if not actual else f"{predicted / actual - 1:+.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(CONFIGS))
    parser.add_argument("--out", default=str(ROOT / "runs" / "plan_accuracy"))
    args = parser.parse_args()
    from scaletrain import config
    from scaletrain.planner import roofline, sweep

    rows = ["| config | slice | planned GiB | compiled GiB | error | roofline bound s | planned step s | "
            "compiled step s | error |", "|---|---|---|---|---|---|---|---|---|"]
    for name in args.only.split(","):
        topology, env = CONFIGS[name]
        plan = roofline.plan(config.load(ROOT / "configs" / f"{name}.yaml"), topology)
        comp = compiled(name, topology, env, Path(args.out))
        gib = plan["memory_per_device_bytes"]["total"] / 2**30
        actual_gib = comp["hbm_per_device_bytes"] / 2**30
        step = sweep.xla_time(comp) if comp.get("fits") else None
        rows.append(f"| {name} | {topology} | {gib:.2f} | {actual_gib:.2f}{'' if comp['fits'] else ' (does not fit)'}"
                    f" | {_error(gib, actual_gib)} | {plan['step_time_s']:.3f} | {plan['step_estimate_s']:.3f} | "
                    f"{'-' if step is None else f'{step:.3f}'} | {_error(plan['step_estimate_s'], step)} |")
        print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
