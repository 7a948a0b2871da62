"""model.quantization measured (docs/quantization.md).

  python benchmarks/quantization.py rates      XLA's cost model on one matmul per TPU generation: bf16, int8, fp8
  python benchmarks/quantization.py accuracy [--seed N]
                                               the tiny config 300 steps on the built-in corpus (held-out split),
                                               unquantized, int8 and fp8: final and evaluation losses

`rates` compiles ahead of time through libtpu (no TPU needed); `accuracy` trains on this machine's CPUs (about
20 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGIES = ("v5e:2x2", "v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1")
M, K, N = 32768, 4096, 14336  # 8 sequences of 4096 tokens through Llama-3.1-8B's gate projection


def rates() -> None:
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    print(f"XLA's cost model (jax {jax.__version__}): one [{M}, {K}] @ [{K}, {N}] matmul, bf16 output\n")
    print("| chip | bf16 TFLOP/s | int8 TOP/s | fp8 TFLOP/s |\n|---|---|---|---|")
    kinds = ((jnp.bfloat16, jnp.float32), (jnp.int8, jnp.int32), (jnp.float8_e4m3fn, jnp.float32))
    for name in TOPOLOGIES:
        device = topologies.get_topology_desc(topology_name=name, platform="tpu").devices[0]
        place = SingleDeviceSharding(device)
        row = []
        for dtype, acc in kinds:
            a, b = (jax.ShapeDtypeStruct(s, dtype, sharding=place) for s in ((M, K), (K, N)))
            compiled = jax.jit(lambda a, b, acc=acc: jax.lax.dot(a, b, preferred_element_type=acc)
                               .astype(jnp.bfloat16)).lower(a, b).compile()
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            row.append(2 * M * K * N / cost["optimal_seconds"] / 1e12)
        print(f"| {device.device_kind} | " + " | ".join(f"{r:.0f}" for r in row) + " |", flush=True)


def _prepared(folder: Path) -> Path:
    """The built-in corpus (the Python standard library's sources, bytes) as a prepared dataset with a held-out
    split, made once in `folder`."""
    out = folder / "stdlib"
    if out.exists() and any(out.iterdir()):
        return out
    from scaletrain.data import loader

    docs = folder / "stdlib.jsonl"
    with open(docs, "w") as f:
        for doc in loader.stdlib_documents("replace"):
            f.write(json.dumps({"text": doc}) + "\n")
    subprocess.run([sys.executable, "-m", "scaletrain", "data", "prepare", "--tokenizer", "bytes", "--input",
                    str(docs), "--out", str(out), "--eval-fraction", "0.02"], check=True, cwd=ROOT)
    return out


def accuracy(folder: Path, steps: int, seed: int) -> None:
    data = _prepared(folder)
    print(f"configs/llama_tiny.yaml, {steps} steps, seed {seed}, data.source=prepared (the built-in corpus, 2% held "
          f"out), float32 master weights and compute\n")
    print("| model.quantization | final loss | mean of the last 20 | eval loss | vs none (final, eval) |")
    print("|---|---|---|---|---|")
    base = None
    for mode in ("none", "int8", "fp8"):
        run = folder / f"run_{mode}_seed{seed}"
        subprocess.run([sys.executable, "train.py", "--config", "configs/llama_tiny.yaml", "--set", f"steps={steps}",
                        "--set", f"run_dir={run}", "--set", "data.source=prepared", "--set", f"data.path={data}",
                        "--set", f"train.eval_every_steps={steps}", "--set", "train.eval_batches=8", "--set",
                        f"model.quantization={mode}", "--set", f"checkpoint.every_steps={steps}", "--set",
                        f"seed={seed}"],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        records = [r for r in records if "event" not in r]  # a loss spike warned of is no step
        losses = [r["loss"] for r in records if "loss" in r]
        assert all(map(lambda x: x == x and abs(x) != float("inf"), losses)), f"{mode}: a non-finite loss"
        final, evaluation = losses[-1], [r["eval_loss"] for r in records if "eval_loss" in r][-1]
        base = base or (final, evaluation)
        print(f"| {mode} | {final:.4f} | {statistics.mean(losses[-20:]):.4f} | {evaluation:.4f} | "
              f"{final / base[0] - 1:+.2%}, {evaluation / base[1] - 1:+.2%} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("rates")
    acc = sub.add_parser("accuracy")
    acc.add_argument("--steps", type=int, default=300)
    acc.add_argument("--seed", type=int, default=0, help="the runs' seed (initialisation and sample order)")
    acc.add_argument("--dir", type=Path, help="where the dataset and runs go (default: a new temporary folder)")
    args = parser.parse_args()
    if args.what == "rates":
        rates()
    else:
        accuracy(args.dir or Path(tempfile.mkdtemp(prefix="quantization-")), args.steps, args.seed)


if __name__ == "__main__":
    main()
