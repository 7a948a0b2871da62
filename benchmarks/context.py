"""Context parallelism measured on this machine's CPUs (docs/context.md).

  python benchmarks/context.py memory [--seq-len N] [--ring]
                                                      the compiled step's temporary memory per device, one
                                                      sequence on C = 1, 2, 4, 8 devices with mesh.context=C
  python benchmarks/context.py train [--seq-len N] [--steps S]
                                                      the tiny model trained at N tokens a sequence on 8 devices
                                                      with mesh.context=8 (the tiny config, XLA's attention in
                                                      blocks): the run's log - compiled memory, step time, loss

Both run on 8 simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, set here). `memory`
compiles the tiny model of configs/llama_tiny.yaml in float32 with flash attention (splash, interpreted: the
scores never exist whole, so what remains is what the sequence's split should divide) and full remat; with
`--ring`, the ring schedule (model.context_attention=ring), whose tiles are XLA's: 512 queries a tile
(model.attention_block=512; on one device XLA's blocked attention, the same blocks against the whole sequence).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Llama-3.1-8B's proportions where they decide what context parallelism divides: keys and values a quarter of the
# stream's width (one K/V head of 32 to a 128-wide stream; 8 of 128 to 4,096 there), 8 layers of saved inputs.
MODEL = ["model.dtype=float32", "model.attention=flash", "remat.policy=full", "model.num_kv_heads=1",
         "model.num_layers=8", "data.source=synthetic"]


def _config(seq_len: int, context: int, batch: int, *extra: str):
    from scaletrain import config

    return config.load(ROOT / "configs/llama_tiny.yaml", [
        *MODEL, f"data.seq_len={seq_len}", f"train.global_batch={batch}", f"mesh.context={context}",
        "mesh.fsdp=1", "mesh.data=1", *extra])


RING = ["model.attention=xla", "model.attention_block=512", "model.context_attention=ring"]


def memory(seq_len: int, ring: bool) -> None:
    import jax

    from scaletrain.train import trainer

    extra = RING if ring else []
    print(f"configs/llama_tiny.yaml, one sequence of {seq_len} tokens, {', '.join(MODEL[:-1] + extra)}; XLA's "
          f"memory analysis of the compiled step, per device\n")
    print("| mesh.context | temporaries MiB | x context | arguments MiB | compile s |\n|---|---|---|---|---|")
    first = None
    for context in (1, 2, 4, 8):
        setup = trainer.build(_config(seq_len, context, 1, *extra), jax.devices()[:context])
        start = time.perf_counter()
        compiled = setup.step.lower(*setup.abstract_args()).compile()
        seconds = time.perf_counter() - start
        mem = compiled.memory_analysis()
        temp = mem.temp_size_in_bytes / 2**20
        first = first or temp
        print(f"| {context} | {temp:.1f} | {temp * context / first:.2f} | {mem.argument_size_in_bytes / 2**20:.1f} | "
              f"{seconds:.0f} |", flush=True)


def train(seq_len: int, steps: int) -> None:
    import subprocess

    run = Path(tempfile.mkdtemp(prefix="context-")) / "run"
    # The tiny config as it is, but for XLA's attention in blocks of 512 queries: the interpreted splash kernel
    # takes minutes a step on a CPU.
    overrides = ["model.attention_block=512", f"data.seq_len={seq_len}", "train.global_batch=1", "mesh.context=8",
                 "mesh.fsdp=1", f"steps={steps}", f"run_dir={run}", f"checkpoint.every_steps={steps}"]
    print("python train.py --config configs/llama_tiny.yaml " + " ".join(f"--set {o}" for o in overrides), flush=True)
    subprocess.run([sys.executable, "train.py", "--config", "configs/llama_tiny.yaml",
                    *[a for o in overrides for a in ("--set", o)]], check=True, cwd=ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    mem = sub.add_parser("memory")
    mem.add_argument("--seq-len", type=int, default=16384)
    mem.add_argument("--ring", action="store_true")
    tr = sub.add_parser("train")
    tr.add_argument("--seq-len", type=int, default=16384)
    tr.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.what == "memory":
        memory(args.seq_len, args.ring)
    else:
        train(args.seq_len, args.steps)


if __name__ == "__main__":
    main()
