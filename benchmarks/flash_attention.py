"""Attention alone, forward + backward: the flash kernel against the XLA paths, on this machine's first device.

    python benchmarks/flash_attention.py [--seq 8192] [--batch 1] [--heads 32] [--kv-heads 8] [--head-dim 128]
        [--dtype bfloat16] [--repeats 10] [--json OUT]

Times jit(grad) of sum(attention(q, k, v) * w) for `flash` (kernels/flash_attention.py: splash on TPU, Triton
on GPU, splash interpreted elsewhere), the model's blocked XLA attention (512-query blocks) and, where it fits,
the dense XLA attention; on a GPU also cuDNN's causal attention (no documents: a speed reference only). Before
timing, checks flash against the jnp twin in float32 at a quarter of the length. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from scaletrain.kernels import flash_attention as fa  # noqa: E402
from scaletrain.models.attention import blocked_attention  # noqa: E402


def operands(b, t, n, kv, h, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = (jax.random.normal(ks[0], (b, t, n, h)) * h ** -0.5).astype(dtype)
    k, v = (jax.random.normal(key, (b, t, kv, h)).astype(dtype) for key in ks[1:3])
    # Documents of ~2,000 tokens: segment boundaries mid-block, as packing makes them.
    segments = jnp.cumsum(jax.random.uniform(ks[3], (b, t)) < 5e-4, axis=1).astype(jnp.int32)
    weights = jax.random.normal(ks[4], (b, t, n, h)).astype(dtype)
    return q, k, v, segments, weights


def grad_fn(attend, weights):
    def loss(q, k, v, segments):
        return (attend(q, k, v, segments).astype(jnp.float32) * weights).sum()
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def blocked(q, k, v, segments, block=512):
    b, t, n, h = q.shape
    kv = k.shape[2]
    block = min(block, t)
    return blocked_attention(q.reshape(b, t, kv, n // kv, h), k, v, segments, block).reshape(q.shape)


def cudnn(q, k, v, segments):
    return jax.nn.dot_product_attention(q, k, v, scale=1.0, is_causal=True, implementation="cudnn")


def check(flash, b, t, n, kv, h) -> dict:
    """Flash against the twin, float32: relative error (in norm) of the loss and the three gradients."""
    q, k, v, segments, w = operands(b, t, n, kv, h, jnp.float32, seed=1)
    got = grad_fn(flash, w)(q, k, v, segments)
    want = grad_fn(fa.reference, w)(q, k, v, segments)
    errors = {}
    for name, a, c in zip(("loss", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(want)):
        errors[name] = float(jnp.linalg.norm((a - c).ravel()) / jnp.linalg.norm(c.ravel()))
    return errors


def time_it(fn, args, repeats) -> dict:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "best_s": min(times), "compile_and_first_s": first}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dense-limit", type=float, default=8.0, help="GiB of float32 scores above which dense is skipped")
    p.add_argument("--blocks", help="the flash kernel's blocks instead of its defaults: Q,K (splash) or Q,K,BACKWARD "
                                    "(Triton)")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    b, t, n, kv, h = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    device = jax.devices()[0]
    kernel = fa.kernel_for(device)
    if args.blocks:
        kernel = dataclasses.replace(kernel, **dict(zip([f.name for f in dataclasses.fields(kernel)],
                                                        map(int, args.blocks.split(",")))))
    flash = functools.partial(fa.flash_attention, kernel=kernel)
    result = {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
              "kernel": repr(kernel), "shape": {"batch": b, "seq": t, "heads": n, "kv_heads": kv,
                                                             "head_dim": h, "dtype": args.dtype},
              "check_float32": check(flash, min(b, 2), max(t // 4, 256), n, kv, h)}
    print("check", json.dumps(result["check_float32"]), file=sys.stderr, flush=True)
    q, k, v, segments, w = operands(b, t, n, kv, h, jnp.dtype(args.dtype))
    # Causal attention's FLOPs, forward (2 matmuls) + backward (5, with the recomputed scores), half the scores.
    causal_flops = 7 * 2 * b * n * t * t * h / 2
    impls = {"flash": flash, "xla_blocked_512": blocked}
    if 4 * b * n * t * t / 2**30 <= args.dense_limit:
        impls["xla_dense"] = fa.reference
    if device.platform == "gpu":
        impls["cudnn_causal_no_documents"] = cudnn
    result["timings"] = {}
    for name, attend in impls.items():
        try:
            timing = time_it(grad_fn(attend, w), (q, k, v, segments), args.repeats)
            timing["causal_tflops_per_s"] = causal_flops / timing["median_s"] / 1e12
        except Exception as e:  # noqa: BLE001 - a reference that does not run here is reported, not fatal
            timing = {"error": str(e).splitlines()[0][:300]}
        result["timings"][name] = timing
        print(name, json.dumps(timing), file=sys.stderr, flush=True)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
