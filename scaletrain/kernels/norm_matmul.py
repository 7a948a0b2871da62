"""Fused RMSNorm + matmul (FlashNorm, deferred form): z = ((x * g) @ W) * r, r = rsqrt(mean(x^2) + eps).

The same function as RMSNorm(x; g) @ W (docs/flashnorm.md). The row scale r is computed inside the matmul
kernel, from the x blocks the matmul reads anyway, and applied in its epilogue: the normalised activations
never exist in memory, and the backward pass needs only x, g and W (plus r, M floats, recomputed).

`norm_matmul(x, g, w, eps)` takes x [M, K], g [K], w [K, N]; it is differentiable in all three (jax.custom_vjp,
Pallas TPU kernels for the forward, dx/dg and dW). `reference` is the plain jnp twin every kernel is tested
against. On a CPU backend the kernels run in Pallas' TPU interpret mode, so the same code is tested here.

Grids and the one rule that matters (the race FlashNorm's authors describe has a TPU twin): a grid axis along
which state is carried - an accumulator in scratch, an output block revisited - must be "arbitrary" (run in
order on one core); only axes whose steps are independent may be "parallel" (split across a megacore's two
TensorCores). Here:
- forward, grid (M/bm, N/bn, K/bk): the K axis accumulates x.W and sum(x^2) -> arbitrary; rows and columns
  are independent (each (i, j) recomputes its rows' sum of squares, K/bn of the matmul's work) -> parallel.
- dx, grid (M/bm, N/bn): the N axis accumulates dz.W^T for full rows, which the RMSNorm backward needs whole
  -> arbitrary.
- dW, grid (N/bn, K/bk, M/bm): the M axis accumulates x^T.dz -> arbitrary.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32 = jnp.float32


def reference(x: jax.Array, g: jax.Array, w: jax.Array, eps: float, out_dtype=None) -> jax.Array:
    """RMSNorm then matmul, as the model's standard form computes them (norm in float32, matmul in x.dtype
    with float32 accumulation)."""
    xf = x.astype(F32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * g.astype(F32)
    return jnp.dot(normed.astype(x.dtype), w.astype(x.dtype), preferred_element_type=F32).astype(out_dtype or x.dtype)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Block sizes (rows, output columns, contraction), the VMEM budget the compiler may use, and whether the
    kernels are compiled by Mosaic (on or for a TPU) or run in interpret mode (anywhere else)."""
    m: int = 256
    n: int = 256
    k: int = 2048
    vmem_limit_bytes: int = 32 * 2**20
    compiled: bool = True


# Per TPU generation. VMEM per TensorCore: v4 16 MiB, v5e/v6e 128 MiB, v5p 64 MiB (reference/scaling.md).
# The MXU is 128 wide on v4/v5e/v5p and 256 on v6e, so blocks are multiples of 256 throughout. K is tiled at
# 2048 on v4 (a (256, 2048) bf16 block and its double buffer fit with room) and taken whole up to 8192 on
# the others, so the forward reads x once per output column block.
GENERATIONS = {
    "v4": Blocks(m=256, n=256, k=2048, vmem_limit_bytes=14 * 2**20),
    "v5e": Blocks(m=512, n=512, k=8192, vmem_limit_bytes=96 * 2**20),
    "v5p": Blocks(m=512, n=512, k=4096, vmem_limit_bytes=48 * 2**20),
    "v6e": Blocks(m=512, n=1024, k=8192, vmem_limit_bytes=96 * 2**20),
}


# device_kind as libtpu spells it -> generation.
_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
          "TPU v6 lite": "v6e", "TPU v6e": "v6e"}


def blocks_for(device: jax.Device | None = None) -> Blocks:
    """The block sizes for a device (the first local one by default); off TPU, small ones for interpret mode."""
    device = device or jax.devices()[0]
    if device.platform != "tpu":
        return Blocks(m=16, n=128, k=128, compiled=False)
    return GENERATIONS.get(_KINDS.get(device.device_kind, ""), Blocks())


def _fit(size: int, block: int, align: int) -> int:
    """The block for a dimension of `size`: the whole (aligned) dimension when it is smaller than `block`,
    else the largest aligned divisor of `size` not above `block` (no padding: padding the vocabulary of an
    output projection would copy the logits), else `block` (and the operands get padded)."""
    if size <= block:
        return _round_up(size, align)
    for b in range(block - block % align, max(align, block // 4) - 1, -align):
        if size % b == 0:
            return b
    return block


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad(a: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    if a.shape == tuple(shape):
        return a
    return jnp.pad(a, [(0, s - d) for d, s in zip(a.shape, shape)])


def _crop(a: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Undo _pad (without a copy when nothing was padded)."""
    return a if a.shape == tuple(shape) else a[tuple(slice(0, s) for s in shape)]


def _interpret(blocks: "Blocks"):
    """Off TPU the kernels run through Pallas' interpreter, which lowers them to plain XLA (it runs inside
    jax.shard_map on many CPU devices; the TPU interpret mode's simulated devices wait on each other there).
    `interpret_mode` swaps in the TPU interpret mode, with its race detection, for single-device checks."""
    if not blocks.compiled:
        return _INTERPRET[-1] if _INTERPRET else True
    return False


_INTERPRET: list = []


class interpret_mode:
    """`with interpret_mode(pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)):` runs the
    kernels traced inside under those interpret-mode parameters."""

    def __init__(self, params):
        self.params = params

    def __enter__(self):
        _INTERPRET.append(self.params)

    def __exit__(self, *exc):
        _INTERPRET.pop()


def _cost(flops: int, transcendentals: int, bytes_accessed: int) -> pl.CostEstimate:
    """What XLA's scheduler and cost analysis see of a kernel. Bytes follow XLA's own convention for a dot
    (each operand and result once; the re-reads of tiling are not counted), so that XLA's estimates of the
    standard, deferred and fused steps compare like with like."""
    return pl.CostEstimate(flops=flops, transcendentals=transcendentals, bytes_accessed=bytes_accessed)


# --- forward ---------------------------------------------------------------------------------------------

def _forward_kernel(x_ref, g_ref, w_ref, out_ref, acc_ref, ss_ref, *, eps: float, k_true: int):
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        ss_ref[...] = jnp.zeros_like(ss_ref)

    x = x_ref[...].astype(F32)
    ss_ref[...] += jnp.sum(x * x, axis=1, keepdims=True)
    xg = (x * g_ref[...].astype(F32)).astype(w_ref.dtype)
    acc_ref[...] += jnp.dot(xg, w_ref[...], preferred_element_type=F32)

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        r = jax.lax.rsqrt(ss_ref[...] / k_true + eps)
        out_ref[...] = (acc_ref[...] * r).astype(out_ref.dtype)


def _forward(x, g, w, eps: float, blocks: Blocks, out_dtype, semantics=("parallel", "parallel", "arbitrary")):
    (m, k), n = x.shape, w.shape[1]
    bm, bn, bk = _fit(m, blocks.m, 8), _fit(n, blocks.n, 128), _fit(k, blocks.k, 128)
    mp, np_, kp = _round_up(m, bm), _round_up(n, bn), _round_up(k, bk)
    # Zero padding changes nothing: zero columns of x add nothing to x.W or to sum(x^2) (whose mean divides
    # by the true K), zero rows and columns of the output are cut off.
    x_p, g_p, w_p = _pad(x, (mp, kp)), _pad(g.reshape(1, k), (1, kp)), _pad(w, (kp, np_))
    out = pl.pallas_call(
        functools.partial(_forward_kernel, eps=eps, k_true=k),
        grid=(mp // bm, np_ // bn, kp // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                  pl.BlockSpec((1, bk), lambda i, j, kk: (0, kk)),
                  pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        scratch_shapes=[pltpu.VMEM((bm, bn), F32), pltpu.VMEM((bm, 1), F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics,
                                             vmem_limit_bytes=blocks.vmem_limit_bytes),
        cost_estimate=_cost(2 * m * n * k + 3 * m * k * (np_ // bn), m, (m * k + k * n + m * n) * x.dtype.itemsize),
        interpret=_interpret(blocks),
    )(x_p, g_p, w_p)
    return _crop(out, (m, n))


# --- backward --------------------------------------------------------------------------------------------

def _dx_kernel(x_ref, g_ref, r_ref, w_ref, dz_ref, dx_ref, dg_ref, t_ref, *, k_true: int):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        t_ref[...] = jnp.zeros_like(t_ref)

    # t = dz W^T, the gradient reaching the normalised-and-scaled input (x r) * g.
    t_ref[...] += jax.lax.dot_general(dz_ref[...], w_ref[...], (((1,), (1,)), ((), ())),
                                      preferred_element_type=F32)

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        x, g, r, t = x_ref[...].astype(F32), g_ref[...].astype(F32), r_ref[...], t_ref[...]
        gt = g * t
        # RMSNorm's backward: dx = r (g t) - r^3 / K * x * sum(x g t), per row.
        dx = r * gt - (r * r * r / k_true) * x * jnp.sum(x * gt, axis=1, keepdims=True)
        dx_ref[...] = dx.astype(dx_ref.dtype)
        dg_ref[...] = jnp.sum(x * r * t, axis=0, keepdims=True)


def _dw_kernel(x_ref, g_ref, r_ref, dz_ref, dw_ref, acc_ref):
    i = pl.program_id(2)

    @pl.when(i == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    xg = (x_ref[...].astype(F32) * g_ref[...].astype(F32)).astype(dz_ref.dtype)
    rdz = (dz_ref[...].astype(F32) * r_ref[...]).astype(dz_ref.dtype)
    acc_ref[...] += jax.lax.dot_general(xg, rdz, (((0,), (0,)), ((), ())), preferred_element_type=F32)

    @pl.when(i == pl.num_programs(2) - 1)
    def _():
        dw_ref[...] = acc_ref[...].astype(dw_ref.dtype)


def _backward(x, g, w, dz, eps: float, blocks: Blocks, dx_semantics=("parallel", "arbitrary"),
              dw_semantics=("parallel", "parallel", "arbitrary")):
    (m, k), n = x.shape, w.shape[1]
    xf = x.astype(F32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=1, keepdims=True) + eps)
    params = dict(interpret=_interpret(blocks))
    # dx and dg: full rows (the RMSNorm backward reduces over all of K), so the row block shrinks with K.
    bn = _fit(n, blocks.n, 128)
    bm = _fit(m, _full_row_block(_round_up(k, 128), bn, blocks), 8)
    mp, np_, kp = _round_up(m, bm), _round_up(n, bn), _round_up(k, 128)
    x_p, g_p, r_p = _pad(x, (mp, kp)), _pad(g.reshape(1, k), (1, kp)), _pad(r, (mp, 1))
    w_p, dz_p = _pad(w, (kp, np_)), _pad(dz, (mp, np_))
    dx, dg = pl.pallas_call(
        functools.partial(_dx_kernel, k_true=k),
        grid=(mp // bm, np_ // bn),
        in_specs=[pl.BlockSpec((bm, kp), lambda i, j: (i, 0)), pl.BlockSpec((1, kp), lambda i, j: (0, 0)),
                  pl.BlockSpec((bm, 1), lambda i, j: (i, 0)), pl.BlockSpec((kp, bn), lambda i, j: (0, j)),
                  pl.BlockSpec((bm, bn), lambda i, j: (i, j))],
        out_specs=[pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
                   pl.BlockSpec((None, 1, kp), lambda i, j: (i, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((mp, kp), x.dtype), jax.ShapeDtypeStruct((mp // bm, 1, kp), F32)],
        scratch_shapes=[pltpu.VMEM((bm, kp), F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=dx_semantics,
                                             vmem_limit_bytes=blocks.vmem_limit_bytes),
        cost_estimate=_cost(2 * m * n * k + 8 * m * k, 0, (2 * m * k + k * n + m * n) * x.dtype.itemsize),
        **params,
    )(x_p, g_p, r_p, w_p, dz_p)

    bm, bk = _fit(m, blocks.m, 8), _fit(k, blocks.k, 128)
    mp, kp = _round_up(m, bm), _round_up(k, bk)
    x_p, g_p, r_p, dz_p = _pad(x, (mp, kp)), _pad(g.reshape(1, k), (1, kp)), _pad(r, (mp, 1)), _pad(dz, (mp, np_))
    dw = pl.pallas_call(
        _dw_kernel,
        grid=(np_ // bn, kp // bk, mp // bm),
        in_specs=[pl.BlockSpec((bm, bk), lambda j, kk, i: (i, kk)), pl.BlockSpec((1, bk), lambda j, kk, i: (0, kk)),
                  pl.BlockSpec((bm, 1), lambda j, kk, i: (i, 0)), pl.BlockSpec((bm, bn), lambda j, kk, i: (i, j))],
        out_specs=pl.BlockSpec((bk, bn), lambda j, kk, i: (kk, j)),
        out_shape=jax.ShapeDtypeStruct((kp, np_), w.dtype),
        scratch_shapes=[pltpu.VMEM((bk, bn), F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=dw_semantics,
                                             vmem_limit_bytes=blocks.vmem_limit_bytes),
        cost_estimate=_cost(2 * m * n * k + 3 * m * (k + n), 0, (m * k + m * n + k * n) * x.dtype.itemsize),
        **params,
    )(x_p, g_p, r_p, dz_p)
    return _crop(dx, (m, k)), _crop(jnp.sum(dg, axis=(0, 1)), (k,)).astype(g.dtype), _crop(dw, (k, n))


def _full_row_block(kp: int, bn: int, blocks: Blocks) -> int:
    """Rows per block when a block holds whole rows of K: x and dx (double-buffered, 2 bytes) and the f32
    accumulator take 12 bytes per element of a row, W's double-buffered column block the rest of half the
    VMEM budget (the other half is the compiler's)."""
    budget = blocks.vmem_limit_bytes // 2 - 2 * 2 * kp * bn
    return max(8, min(blocks.m, budget // (12 * kp) // 8 * 8))


# --- the differentiable op -------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _norm_matmul(x, g, w, eps, blocks, out_dtype):
    return _forward(x, g, w, eps, blocks, out_dtype)


def _norm_matmul_fwd(x, g, w, eps, blocks, out_dtype):
    # Residuals: x, g and W only - no normalised copy of x, no r (recomputed: one read of x).
    return _forward(x, g, w, eps, blocks, out_dtype), (x, g, w)


def _norm_matmul_bwd(eps, blocks, out_dtype, residuals, dz):
    x, g, w = residuals
    return _backward(x, g, w, dz.astype(x.dtype), eps, blocks)


_norm_matmul.defvjp(_norm_matmul_fwd, _norm_matmul_bwd)


def norm_matmul(x: jax.Array, g: jax.Array, w: jax.Array, eps: float, out_dtype=None,
                blocks: Blocks | None = None) -> jax.Array:
    """((x * g) @ W) * rsqrt(mean(x^2) + eps) for x [M, K], g [K], w [K, N], in out_dtype (x.dtype by
    default): `reference`'s function, fused. W is cast to x.dtype (the compute dtype), as the model's matmuls
    do. `blocks` defaults to blocks_for() the first local device."""
    if x.ndim != 2 or w.ndim != 2 or g.shape != (x.shape[1],) or w.shape[0] != x.shape[1]:
        raise ValueError(f"norm_matmul: x [M, K], g [K], w [K, N]; got {x.shape}, {g.shape}, {w.shape}")
    return _norm_matmul(x, g, w.astype(x.dtype), eps, blocks or blocks_for(), jnp.dtype(out_dtype or x.dtype))


def vmem_bytes(m: int, n: int, k: int, blocks: Blocks, itemsize: int = 2) -> int:
    """The forward's VMEM need: double-buffered x, g, W and output blocks, plus the f32 scratch."""
    bm, bn, bk = _fit(m, blocks.m, 8), _fit(n, blocks.n, 128), _fit(k, blocks.k, 128)
    return 2 * (bm * bk + bk + bk * bn + bm * bn) * itemsize + (bm * bn + bm) * 4

