"""Fused RMSNorm + matmul (FlashNorm, deferred form): z = ((x * g) @ W) * r, r = rsqrt(mean(x^2) + eps).

The same function as RMSNorm(x; g) @ W (docs/flashnorm.md). The row scale r is computed inside the matmul
kernel, from the x blocks the matmul reads anyway, and applied in its epilogue: the normalised activations
never exist in memory, and the backward pass needs only x, g and W (plus r, M floats, recomputed).

`norm_matmul(x, g, w, eps)` takes x [M, K], g [K], w [K, N]; it is differentiable in all three (jax.custom_vjp)
through Pallas kernels for the forward, dx/dg and dW: Mosaic ones on TPU (norm_matmul_tpu.py), Triton ones on
GPU (norm_matmul_gpu.py); the block sizes say which. A few rows (decode) take a decode-shaped forward kernel.
`reference` is the plain jnp twin every kernel is tested against. Elsewhere the kernels run in Pallas'
interpreter, so the same code is tested on a CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from scaletrain.kernels import norm_matmul_gpu as gpu
from scaletrain.kernels import norm_matmul_tpu as tpu
from scaletrain.kernels.norm_matmul_gpu import GpuBlocks
from scaletrain.kernels.norm_matmul_tpu import Blocks

F32 = jnp.float32


def reference(x: jax.Array, g: jax.Array, w: jax.Array, eps: float, out_dtype=None) -> jax.Array:
    """RMSNorm then matmul, as the model's standard form computes them (norm in float32, matmul in x.dtype
    with float32 accumulation)."""
    xf = x.astype(F32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * g.astype(F32)
    return jnp.dot(normed.astype(x.dtype), w.astype(x.dtype), preferred_element_type=F32).astype(out_dtype or x.dtype)


def blocks_for(device: jax.Device | None = None) -> Blocks | GpuBlocks:
    """The kernels and block sizes for a device (the first local one by default): Mosaic with the TPU
    generation's blocks, Triton on a GPU, and the TPU kernels interpreted anywhere else."""
    device = device or jax.devices()[0]
    if device.platform == "tpu":
        return tpu.blocks_for(device.device_kind)
    if device.platform == "gpu":
        return GpuBlocks()
    return tpu.INTERPRETED


def _backend(blocks: Blocks | GpuBlocks):
    return gpu if isinstance(blocks, GpuBlocks) else tpu


def _forward(x, g, w, eps, blocks, out_dtype):
    """The decode-shaped kernel for a few rows (decode: one per sequence), the tiled one otherwise."""
    backend = _backend(blocks)
    if x.shape[0] <= blocks.decode_rows:
        return backend.decode_forward(x, g, w, eps, blocks, out_dtype)
    return backend.forward(x, g, w, eps, blocks, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _norm_matmul(x, g, w, eps, blocks, out_dtype):
    return _forward(x, g, w, eps, blocks, out_dtype)


def _norm_matmul_fwd(x, g, w, eps, blocks, out_dtype):
    # Residuals: x, g and W only - no normalised copy of x, no r (recomputed: one read of x).
    return _forward(x, g, w, eps, blocks, out_dtype), (x, g, w)


def _norm_matmul_bwd(eps, blocks, out_dtype, residuals, dz):
    x, g, w = residuals
    xf = x.astype(F32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=1) + eps)
    return _backend(blocks).backward(x, g, r, w, dz.astype(x.dtype), blocks)


_norm_matmul.defvjp(_norm_matmul_fwd, _norm_matmul_bwd)


def norm_matmul(x: jax.Array, g: jax.Array, w: jax.Array, eps: float, out_dtype=None,
                blocks: Blocks | GpuBlocks | None = None) -> jax.Array:
    """((x * g) @ W) * rsqrt(mean(x^2) + eps) for x [M, K], g [K], w [K, N], in out_dtype (x.dtype by
    default): `reference`'s function, fused. W is cast to x.dtype (the compute dtype), as the model's matmuls
    do. `blocks` defaults to blocks_for() the first local device."""
    if x.ndim != 2 or w.ndim != 2 or g.shape != (x.shape[1],) or w.shape[0] != x.shape[1]:
        raise ValueError(f"norm_matmul: x [M, K], g [K], w [K, N]; got {x.shape}, {g.shape}, {w.shape}")
    return _norm_matmul(x, g, w.astype(x.dtype), eps, blocks or blocks_for(), jnp.dtype(out_dtype or x.dtype))
