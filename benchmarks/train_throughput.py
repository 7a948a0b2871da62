"""Training throughput: tokens/s, step time and MFU of the real train step, with the roofline prediction.

    python benchmarks/train_throughput.py [--model tiny|mixtral_tiny|maxtext|all] [--steps N] [--cpu-devices 8]
                                          [--set K=V]... [--json] [--plain-loss]

`tiny` is configs/llama_tiny.yaml on the built-in corpus, `mixtral_tiny` configs/mixtral_tiny.yaml (8 experts
over mesh.expert=4); `maxtext` is MaxText's tiny Llama (4 layers, d_model
256, 4 heads of 64, d_ff 1024, vocab 32000, seq 256, global batch 8, fp32, fsdp=8, synthetic data), the
model of the project's CPU throughput target (benchmarks/vs_maxtext.py runs it beside MaxText). Step time is
the mean of the timed steps dispatched back to back; `median_step_s` is the median of the same steps timed
one by one (each waited for). `--json` prints one JSON object per model instead of a line; `--plain-loss`
turns off the CPU's fused output projection + loss (loss.FUSED_LOSS), to measure what it gains. Results belong in
docs/benchmarks.md with the command and machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaletrain import config, runtime  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "tiny": (ROOT / "configs" / "llama_tiny.yaml", []),
    "mixtral_tiny": (ROOT / "configs" / "mixtral_tiny.yaml", []),
    "maxtext": (None, [
        "model.num_layers=4", "model.d_model=256", "model.num_heads=4", "model.num_kv_heads=4", "model.head_dim=64",
        "model.d_ff=1024", "model.vocab_size=32000", "data.seq_len=256", "train.global_batch=8",
        "model.dtype=float32", "model.param_dtype=float32", "data.source=synthetic", "mesh.fsdp=8",
        "sharding.preset=fsdp", "optim.warmup_steps=10",
    ]),
}


def measure(name: str, steps: int, warmup: int, overrides: list[str], inventory: bool = False) -> dict:
    """Compile and time the real train step; with `inventory`, also its collectives by kind (planner/hlo.py)."""
    import jax

    from scaletrain.data import loader as data
    from scaletrain.facts import flops, hardware
    from scaletrain.parallel import mesh
    from scaletrain.planner import hlo
    from scaletrain.train import trainer

    path, preset = MODELS[name]
    cfg = config.load(path, preset + [f"steps={2 * steps + warmup}"] + overrides)
    setup = trainer.build(cfg)
    iterator = data.make_iterator(cfg, setup.batch_sharding)
    state = setup.init(jax.random.PRNGKey(0))
    t0 = time.perf_counter()
    step = setup.step.lower(*setup.abstract_args()).compile()
    compile_s, no_ceiling = time.perf_counter() - t0, setup.loss_ceiling()
    collectives = hlo.summary(hlo.inventory(step.as_text(), setup.mesh)) if inventory else None
    for _ in range(warmup):
        state, _ = step(state, setup.put_batch(next(iterator)), no_ceiling)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for _ in range(steps):  # dispatched back to back, as the trainer does
        state, metrics = step(state, setup.put_batch(next(iterator)), no_ceiling)
    jax.block_until_ready(metrics)
    step_s = (time.perf_counter() - t0) / steps
    times = []
    for _ in range(steps):  # the same steps one by one: a median that a disturbed step does not move
        t0 = time.perf_counter()
        state, metrics = step(state, setup.put_batch(next(iterator)), no_ceiling)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)

    tokens = cfg.train.global_batch * cfg.data.seq_len
    step_flops = flops.flops_per_token(setup.model_cfg, cfg.data.seq_len) * tokens
    peak = hardware.peak_flops(jax.devices(), cfg.hardware.peak_flops_per_device)
    return {
        "model": name, "params": flops.param_count(setup.model_cfg).total, "devices": jax.device_count(),
        "mesh": mesh.describe(setup.mesh.shape),
        "tokens_per_step": tokens, "step_flops": step_flops, "compile_s": compile_s, "step_time_s": step_s,
        "tokens_per_sec": tokens / step_s, "median_step_s": statistics.median(times),
        "median_tokens_per_sec": tokens / statistics.median(times), "mfu": step_flops / step_s / peak if peak else None,
        "peak_flops": peak, "roofline_step_s": step_flops / peak if peak else None,
        "median_mfu": step_flops / statistics.median(times) / peak if peak else None,
        "final_loss": float(metrics["loss"]), "collectives": collectives,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=[*MODELS, "all"], default="all")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    p.add_argument("--cpu-devices", type=int, default=8)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true", help="one JSON object per model")
    p.add_argument("--plain-loss", action="store_true", help="logits, then the loss (no fused path)")
    args = p.parse_args()
    if args.plain_loss:
        from scaletrain.train import loss

        loss.FUSED_LOSS = False
    runtime.configure(args.cpu_devices)
    import jax

    print(f"# {time.strftime('%Y-%m-%d')}  {platform.machine()} {platform.processor()}  "
          f"jax {jax.__version__}  {jax.device_count()} x {jax.devices()[0].device_kind}")
    for name in MODELS if args.model == "all" else [args.model]:
        r = measure(name, args.steps, args.warmup, args.set)
        if args.json:
            print(json.dumps(r), flush=True)
            continue
        mfu = "n/a (unknown peak)" if r["mfu"] is None else (
            f"{100 * r['mfu']:.1f}%  (roofline {r['roofline_step_s'] * 1e3:.1f} ms at peak "
            f"{r['peak_flops'] / 1e9:.0f} GFLOP/s)")
        print(f"{name:8s} {r['params'] / 1e6:6.2f}M params  mesh {r['mesh']}  {r['tokens_per_step']} tok/step  "
              f"step {r['step_time_s'] * 1e3:8.1f} ms  {r['tokens_per_sec']:9,.0f} tok/s  MFU {mfu}  "
              f"compile {r['compile_s']:.1f} s  (median step {r['median_step_s'] * 1e3:.1f} ms)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
