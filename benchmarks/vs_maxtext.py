"""scaletrain against MaxText on CPU, side by side in one run: the same tiny Llama, interleaved rounds, medians.

    MAXTEXT_SCRIPTS=DIR python benchmarks/vs_maxtext.py [--rounds 3] [--steps 12] [--set K=V]... [--xla-flags F]

The model is MaxText's tiny Llama (4 layers, d_model 256, 4 heads of 64, d_ff 1024, vocab 32000 untied, seq 256,
global batch 8, fp32, 8 simulated CPU devices, fsdp 8, synthetic data): `--model maxtext` of
benchmarks/train_throughput.py on our side. MaxText runs through two scripts that DIR (or --maxtext-scripts)
must hold:

- `run_maxtext_tiny.sh FSDP TP STEPS [key=value ...]`: runs MaxText's own trainer on that model from a
  virtual environment where MaxText is installed (MAXTEXT_DIR, default ~/.cache/maxtext-anchor; MaxText needs
  Python >= 3.12), printing as its last lines a JSON summary with `tokens_per_s_global` (from the median step time);
- `install_maxtext.sh`, run once beforehand to create that environment.

Each round runs both, in alternating order, each in a fresh process (compile excluded on both sides). Reported:
the median over rounds of each side's tokens/s (each a median over its timed steps), their ratio, the ratio's
range over rounds, and our MFU against this CPU's measured float32 matmul peak, measured again before every
round (hardware.py keeps the best measurement ever taken, so a busy moment cannot lower it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENV = "MAXTEXT_SCRIPTS"


def _last_json(text: str) -> dict:
    """The last JSON object printed (possibly over several lines) in `text`."""
    start = text.rfind("\n{")
    start = 0 if start < 0 and text.startswith("{") else start + 1
    return json.loads(text[start:text.rindex("}") + 1])


def run_maxtext(scripts: Path, steps: int) -> dict:
    result = subprocess.run(["bash", str(scripts / "run_maxtext_tiny.sh"), "8", "1", str(steps)],
                            capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"MaxText failed ({result.returncode}): {result.stdout[-2000:]}{result.stderr[-2000:]}")
    summary = _last_json(result.stdout)
    return {"tokens_per_sec": summary["tokens_per_s_global"], "step_s": summary["median_step_s_reported"],
            "compile_s": summary["aot_compile_s"], "loss": summary["loss_last"]}


def run_ours(steps: int, overrides: list[str], xla_flags: str) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"), "--model", "maxtext", "--json",
           "--steps", str(steps), *[a for kv in overrides for a in ("--set", kv)]]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode:
        raise RuntimeError(f"scaletrain failed ({result.returncode}): {result.stderr[-3000:]}")
    r = _last_json(result.stdout)
    return {"tokens_per_sec": r["median_tokens_per_sec"], "step_s": r["median_step_s"], "compile_s": r["compile_s"],
            "loss": r["final_loss"], "step_flops": r["step_flops"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--maxtext-scripts", type=Path, default=os.environ.get(ENV),
                   help=f"folder with run_maxtext_tiny.sh and install_maxtext.sh (default: ${ENV})")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12, help="timed steps per side and round")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="scaletrain overrides")
    p.add_argument("--xla-flags", default="", help="XLA_FLAGS added for scaletrain's process only")
    args = p.parse_args()
    scripts = args.maxtext_scripts
    if scripts is None or not (scripts / "run_maxtext_tiny.sh").is_file():
        where = f"{scripts} has no run_maxtext_tiny.sh" if scripts else f"${ENV} is not set"
        print(f"error: MaxText's scripts not found ({where}): set {ENV}=DIR (or pass --maxtext-scripts DIR), DIR "
              f"holding run_maxtext_tiny.sh and install_maxtext.sh, and run DIR/install_maxtext.sh once",
              file=sys.stderr)
        return 2
    mt_dir = Path(os.environ.get("MAXTEXT_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                  / "maxtext-anchor")
    if not (mt_dir / "venv" / "bin" / "activate").is_file():
        print(f"error: MaxText is not installed in {mt_dir}: run bash {scripts / 'install_maxtext.sh'} once "
              f"(or set MAXTEXT_DIR to where it is)", file=sys.stderr)
        return 2

    from scaletrain import runtime
    runtime.configure(None)
    from scaletrain.planner import hardware

    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {platform.machine()} {platform.processor()} {os.cpu_count()} cores  "
          f"{args.rounds} rounds x {args.steps} steps  scaletrain overrides: {' '.join(args.set) or '-'}  "
          f"XLA flags: {args.xla_flags or '-'}", flush=True)
    print("| round | first | scaletrain tok/s | MaxText tok/s | ratio | peak GFLOP/s (measured now) |")
    print("|---|---|---|---|---|---|")
    ours, theirs = [], []
    for i in range(args.rounds):
        measured = hardware.cpu_peak_measured(recheck=True)
        order = ["scaletrain", "maxtext"] if i % 2 == 0 else ["maxtext", "scaletrain"]
        got = {}
        for side in order:
            got[side] = (run_ours(args.steps, args.set, args.xla_flags) if side == "scaletrain"
                         else run_maxtext(scripts, args.steps))
        ours.append(got["scaletrain"])
        theirs.append(got["maxtext"])
        print(f"| {i + 1} | {order[0]} | {got['scaletrain']['tokens_per_sec']:,.0f} | "
              f"{got['maxtext']['tokens_per_sec']:,.0f} | "
              f"{got['scaletrain']['tokens_per_sec'] / got['maxtext']['tokens_per_sec']:.2f}x | "
              f"{measured.value / 1e9:.0f} ({measured.now / 1e9:.0f}) |", flush=True)
    peak = hardware.cpu_peak_measured()
    ours_tps = statistics.median(r["tokens_per_sec"] for r in ours)
    theirs_tps = statistics.median(r["tokens_per_sec"] for r in theirs)
    ratios = [a["tokens_per_sec"] / b["tokens_per_sec"] for a, b in zip(ours, theirs)]
    step_flops = ours[0]["step_flops"]
    tokens = 8 * 256
    mfu = step_flops / (tokens / ours_tps) / peak.value
    print(f"scaletrain {ours_tps:,.0f} tok/s (median; rounds {min(r['tokens_per_sec'] for r in ours):,.0f}-"
          f"{max(r['tokens_per_sec'] for r in ours):,.0f}), MaxText {theirs_tps:,.0f} tok/s (rounds "
          f"{min(r['tokens_per_sec'] for r in theirs):,.0f}-{max(r['tokens_per_sec'] for r in theirs):,.0f})")
    print(f"ratio {ours_tps / theirs_tps:.2f}x (per round {min(ratios):.2f}-{max(ratios):.2f}x); scaletrain MFU "
          f"{100 * mfu:.1f}% and MaxText {100 * mfu * theirs_tps / ours_tps:.1f}% of the peak "
          f"{peak.value / 1e9:.0f} GFLOP/s ({step_flops / 1e9:.1f} GFLOP per step)")
    print(f"compile s: scaletrain {statistics.median(r['compile_s'] for r in ours):.1f}, MaxText "
          f"{statistics.median(r['compile_s'] or 0 for r in theirs):.1f}; last loss scaletrain "
          f"{ours[-1]['loss']:.3f}, MaxText {theirs[-1]['loss']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
