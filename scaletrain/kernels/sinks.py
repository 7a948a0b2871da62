"""Attention sinks (GPT-OSS, model.attention_sinks) for the kernels that return a log-sum-exp: a learned logit s
per query head joins each softmax's denominator and carries no value, so that a query may attend to nothing.

Attention without the sink gives out = sum_j e^(x_j) v_j / Z and lse = log Z. With it the denominator is Z + e^s:
out' = out * Z / (Z + e^s) = out * sigmoid(lse - s), and lse' = logaddexp(lse, s) - the same attention with one
more (valueless) key. Its backward pass is therefore a flash kernel's own, fed out' and lse' (the row term
rowsum(dO * O') and probabilities exp(x - lse') are the sink-softmax's), plus the sink's gradient:
d s = sum over queries of p_sink (0 - rowsum(dO * O')), p_sink = exp(s - lse').

`fold` and `sink_grad` serve the ring (kernels/ring_attention.py) and splash (`splash_attention` here, whose
forward kernel gives lse and whose backward kernels take out' and lse' as inputs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib


def fold(out: jax.Array, lse: jax.Array, sink: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(out', lse') from attention's (out, lse) without the sink: `sink` broadcasts against lse ([..., queries]
    shaped like lse, with size-1 dims where it is shared), out has lse's dims and a trailing head_dim."""
    merged = jnp.logaddexp(lse, sink.astype(jnp.float32))
    return (out.astype(jnp.float32) * jnp.exp(lse - merged)[..., None]).astype(out.dtype), merged


def sink_grad(out: jax.Array, lse: jax.Array, d_out: jax.Array, sink: jax.Array) -> jax.Array:
    """The sink's gradient, in `sink`'s shape, from `fold`'s out' and lse' and the output's cotangent."""
    row = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    grad = -jnp.exp(sink.astype(jnp.float32) - lse) * row
    shared = tuple(i for i, (g, s) in enumerate(zip(grad.shape, sink.shape)) if s == 1 and g != 1)
    return jnp.sum(grad, axis=shared, keepdims=True).astype(sink.dtype)


def splash_backward(kernel, q, k, v, q_seg, k_seg, out, lse, d_out):
    """(dq, dk, dv) of one row's splash attention ([heads, t, h]) from its output and log-sum-exp, through
    splash's backward kernels (`_splash_attention_bwd`, the library's private entry to them, pinned by the jax
    version in pyproject.toml): they take out and lse as inputs, so they serve any row statistics - the ring's
    merged ones, the sink's."""
    opts = {name: kernel.kwargs[name] for name in ("mask_value", "is_mqa", "block_sizes", "mask_function",
                                                    "attn_logits_soft_cap", "interpret")}
    residuals = (q, k, v, kernel_lib.SegmentIds(q_seg, k_seg), None, out, lse, kernel.dq_mask_info,
                 kernel.dkv_mask_info)
    grads = kernel_lib._splash_attention_bwd(save_residuals=False, residual_checkpoint_name=None, res=residuals,
                                             do=d_out, **opts)
    return grads[3:6]


@jax.custom_vjp
def splash_attention(kernel, q_bnth, k_bkth, v_bkth, q_seg_bt, k_seg_bs, sinks_n):
    """Splash attention of every row with a sink per query head: `kernel` a splash kernel built with
    save_residuals (flash_attention.splash_kernel), q, k, v heads-first, sinks [n]."""
    return _forward(kernel, q_bnth, k_bkth, v_bkth, q_seg_bt, k_seg_bs, sinks_n)[0]


def _forward(kernel, q, k, v, q_seg, k_seg, sinks_n):
    out, (lse,) = jax.vmap(lambda *x: kernel(*x[:3], kernel_lib.SegmentIds(*x[3:])))(q, k, v, q_seg, k_seg)
    return fold(out, lse, sinks_n[None, :, None])


def _fwd(kernel, q, k, v, q_seg, k_seg, sinks_n):
    out, lse = _forward(kernel, q, k, v, q_seg, k_seg, sinks_n)
    return out, (kernel, q, k, v, q_seg, k_seg, sinks_n, out, lse)


def _bwd(residuals, d_out):
    kernel, q, k, v, q_seg, k_seg, sinks_n, out, lse = residuals
    dq, dk, dv = jax.vmap(lambda *x: splash_backward(kernel, *x))(q, k, v, q_seg, k_seg, out, lse, d_out)
    d_sinks = sink_grad(out, lse, d_out, sinks_n[None, :, None]).reshape(sinks_n.shape)
    return None, dq, dk, dv, None, None, d_sinks


splash_attention.defvjp(_fwd, _bwd)
