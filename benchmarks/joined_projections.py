"""Joined or separate projections, as XLA's TPU cost model sees one layer: the Llama-3.1-8B MLP (gate/up joined
as one matmul against [embed, mlp, 2], or two matmuls) and its Q/K/V (one matmul against [embed, kv_heads,
q_per_kv + 2, head_dim], or three, with RoPE and the splash kernel after them), forward and backward on one v5p
chip, 8192 tokens - compiled ahead of time through libtpu (no TPU needed). Prints XLA's FLOPs, bytes and
optimal_seconds and the bytes of the copies and transposes in each compiled program: the figures
docs/parallelism.md quotes for running the projections separately outside tensor parallelism
(models/mlp.py, models/attention.py).

    python benchmarks/joined_projections.py
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from scaletrain.kernels import flash_attention  # noqa: E402
from scaletrain.models import rope  # noqa: E402

T, D, F, N, K, H = 8192, 4096, 14336, 32, 8, 128  # Llama-3.1-8B: tokens, d_model, d_ff, heads, kv heads, head_dim
G = N // K
BF16 = jnp.bfloat16


def mlp_joined(x, wg, wu, wd):
    y = (x @ jnp.stack([wg, wu], -1).astype(BF16).reshape(D, -1)).reshape(T, F, 2)
    return (jax.nn.silu(y[..., 0]) * y[..., 1]) @ wd.astype(BF16)


def mlp_separate(x, wg, wu, wd):
    return (jax.nn.silu(x @ wg.astype(BF16)) * (x @ wu.astype(BF16))) @ wd.astype(BF16)


def attention(kernel):
    inv_freq = rope.inverse_frequencies(H, 500000.0)

    def after(q, k, v, wo):
        sin, cos = rope.sin_cos(jnp.arange(T)[None], inv_freq)
        q = rope.apply(q, sin, cos) * jnp.asarray(H ** -0.5, BF16)
        out = flash_attention.flash_attention(q, rope.apply(k, sin, cos), v, jnp.ones((1, T), jnp.int32), kernel)
        return out.reshape(T, N * H) @ wo.astype(BF16).reshape(N * H, D)

    def joined(x, wq, wk, wv, wo):
        w = jnp.concatenate([wq.reshape(D, K, G, H), wk[:, :, None], wv[:, :, None]], axis=2).astype(BF16)
        y = (x @ w.reshape(D, -1)).reshape(1, T, K, G + 2, H)
        return after(y[:, :, :, :G].reshape(1, T, N, H), y[:, :, :, G], y[:, :, :, G + 1], wo)

    def separate(x, wq, wk, wv, wo):
        q, k, v = ((x @ w.astype(BF16).reshape(D, -1)).reshape(1, T, *w.shape[1:]) for w in (wq, wk, wv))
        return after(q, k, v, wo)

    return joined, separate


def copy_bytes(hlo: str) -> int:
    """Bytes written by the compiled program's copy and transpose instructions."""
    total = 0
    for m in re.finditer(r"= (\w+)\[([\d,]*)\]\S* (?:copy|transpose)\(", hlo):
        elements = 1
        for n in filter(None, m.group(2).split(",")):
            elements *= int(n)
        total += elements * int(re.sub(r"\D", "", m.group(1)) or 8) // 8  # bf16 -> 2, f32 -> 4, pred -> 1
    return total


def main() -> None:
    device = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices[0]
    place = SingleDeviceSharding(device)

    def shapes(*dims):
        return [jax.ShapeDtypeStruct((T, D), BF16, sharding=place)] + [
            jax.ShapeDtypeStruct(d, jnp.float32, sharding=place) for d in dims]

    joined_qkv, separate_qkv = attention(flash_attention.kernel_for(device))
    mlp = shapes((D, F), (D, F), (F, D))
    qkv = shapes((D, N, H), (D, K, H), (D, K, H), (N, H, D))
    print("| block | projections | XLA TFLOP | XLA GB | XLA ms | copies GB |\n|---|---|---|---|---|---|")
    for block, name, fn, args in (("MLP", "joined", mlp_joined, mlp), ("MLP", "separate", mlp_separate, mlp),
                                  ("Q/K/V + attention", "joined", joined_qkv, qkv),
                                  ("Q/K/V + attention", "separate", separate_qkv, qkv)):
        loss = lambda *a, fn=fn: jnp.sum(fn(*a).astype(jnp.float32) ** 2)  # noqa: E731
        compiled = jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))).lower(*args).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        print(f"| {block} | {name} | {cost['flops'] / 1e12:.3f} | {cost['bytes accessed'] / 1e9:.2f} | "
              f"{cost['optimal_seconds'] * 1e3:.2f} | {copy_bytes(compiled.as_text()) / 1e9:.2f} |")


if __name__ == "__main__":
    main()
