"""scaletrain against MaxText on CPU, side by side in one run: the same tiny Llama, interleaved rounds, medians.

    MAXTEXT_SCRIPTS=DIR python benchmarks/vs_maxtext.py [--rounds 3] [--steps 12] [--ours NAME=ARGS]...

The model is MaxText's tiny Llama (4 layers, d_model 256, 4 heads of 64, d_ff 1024, vocab 32000 untied, seq 256,
global batch 8, fp32, 8 simulated CPU devices, fsdp 8, synthetic data): `--model maxtext` of
benchmarks/train_throughput.py on our side. MaxText runs through two scripts that DIR (or --maxtext-scripts)
must hold:

- `run_maxtext_tiny.sh FSDP TP STEPS [key=value ...]`: runs MaxText's own trainer on that model from a
  virtual environment where MaxText is installed (MAXTEXT_DIR, default ~/.cache/maxtext-anchor; MaxText needs
  Python >= 3.12), printing as its last lines a JSON summary with `tokens_per_s_global` (from the median step time);
- `install_maxtext.sh`, run once beforehand to create that environment.

`--ours NAME=ARGS` (repeatable) adds a scaletrain variant: ARGS are train_throughput.py arguments (`--set
model.logits_block=64`, `--plain-loss`), and words starting `--xla_` are XLA flags for that process only; the
first variant is the one compared (default: one variant, `scaletrain`, with no arguments). Each round runs
MaxText and every variant in turn, the order reversed every other round, each in a fresh process (compile
excluded on both sides). Reported: the median over rounds of each one's tokens/s (each a median over its timed
steps), the ratio to MaxText, its range over rounds, and MFU against this CPU's float32 matmul peak, measured
again before every round (hardware.py keeps the best measurement ever taken, so a busy moment cannot lower it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
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


def run_ours(steps: int, spec: str) -> dict:
    words = shlex.split(spec)
    flags = [w for w in words if w.startswith("--xla_")]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"), "--model", "maxtext", "--json",
           "--steps", str(steps), *[w for w in words if not w.startswith("--xla_")]]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if flags:
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *flags]).strip()
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
    p.add_argument("--steps", type=int, default=12, help="timed steps per run")
    p.add_argument("--ours", action="append", default=[], metavar="NAME=ARGS", help="a scaletrain variant")
    args = p.parse_args()
    variants = dict(v.partition("=")[::2] for v in args.ours) or {"scaletrain": ""}
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
    from scaletrain.facts import hardware

    described = "; ".join(f"{k} [{v or '-'}]" for k, v in variants.items())
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {platform.machine()} {platform.processor()} {os.cpu_count()} cores  "
          f"{args.rounds} rounds x {args.steps} steps  variants: {described}", flush=True)
    names = [*variants, "maxtext"]
    print(f"| round | peak GFLOP/s (measured now) | {' | '.join(f'{n} tok/s' for n in names)} |")
    print(f"|---|---|{'---|' * len(names)}")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for i in range(args.rounds):
        measured = hardware.cpu_peak_measured(recheck=True)
        for name in names if i % 2 == 0 else names[::-1]:
            runs[name].append(run_maxtext(scripts, args.steps) if name == "maxtext"
                              else run_ours(args.steps, variants[name]))
            print(f"  round {i + 1} {name}: {runs[name][-1]['tokens_per_sec']:,.0f} tok/s", file=sys.stderr, flush=True)
        cells = " | ".join(f"{runs[n][-1]['tokens_per_sec']:,.0f}" for n in names)
        print(f"| {i + 1} | {measured.value / 1e9:.0f} ({measured.now / 1e9:.0f}) | {cells} |", flush=True)
    peak = hardware.cpu_peak_measured()
    step_flops = next(r["step_flops"] for n in variants for r in runs[n])
    tps = {n: statistics.median(r["tokens_per_sec"] for r in runs[n]) for n in names}
    print(f"peak {peak.describe()}; {step_flops / 1e9:.1f} GFLOP per {8 * 256}-token step")
    for n in names:
        ratios = [a["tokens_per_sec"] / b["tokens_per_sec"] for a, b in zip(runs[n], runs["maxtext"])]
        mfu = step_flops * tps[n] / (8 * 256) / peak.value
        print(f"{n:12s} {tps[n]:7,.0f} tok/s (rounds {min(r['tokens_per_sec'] for r in runs[n]):,.0f}-"
              f"{max(r['tokens_per_sec'] for r in runs[n]):,.0f})  {tps[n] / tps['maxtext']:.2f}x MaxText (rounds "
              f"{min(ratios):.2f}-{max(ratios):.2f}x)  MFU {100 * mfu:.1f}%  compile "
              f"{statistics.median(r['compile_s'] or 0 for r in runs[n]):.1f} s  last loss {runs[n][-1]['loss']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
