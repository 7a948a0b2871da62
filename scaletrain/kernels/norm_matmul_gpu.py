"""FlashNorm's kernels for GPUs, through Pallas' Triton backend (norm_matmul.py holds the op and the math).

Triton runs a grid's programs independently - no axis runs in order, no scratch survives from one program to
the next - so every reduction loops inside one program, and every tensor a program touches has power-of-two
sides. Each kernel holds an output tile of `m x n` in registers and steps through its contraction `k` at a time:
- forward, grid (M/m, N/n): the loop over K accumulates (x g).W and sum(x^2); the epilogue scales rows by r.
- dx, K-tiled, grid (M/m, K/n): the loop over N accumulates t = dz.W^T for one tile of x's columns. The
  RMSNorm backward needs sum_k(x g t) over whole rows, which no single program sees, so each writes r g t and its
  tile's share of that sum; XLA's elementwise epilogue adds the shares and subtracts r^3/K x sum (one pass over
  x). The tile's share of dg is written too, and summed over row blocks the same way.
- dW, grid (K/m, N/n): the loop over M accumulates (x g)^T.(r dz).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from scaletrain.kernels.tiling import cost, crop, fit_power_of_two, pad, round_up

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class GpuBlocks:
    """Each program's output tile (m x n), its contraction step (k), Triton's warps per program and software
    pipeline stages; `compiled=False` runs the kernels in Pallas' interpreter (any backend). The defaults are
    the common Triton choice for bf16 matmuls on H100/H200: a 128 x 128 f32 tile is 64 KiB of registers over
    8 warps, and three stages of 64-deep operand blocks fit in shared memory."""
    m: int = 128
    n: int = 128
    k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    compiled: bool = True
    # Decode (at most `decode_rows` rows: one token per sequence) reads W once and does little arithmetic on
    # it: narrow column tiles give the GPU's ~130 SMs enough programs (N/64: 48 for Llama-3.2-1B's Q/K/V), and
    # a deeper contraction step with fewer warps keeps each program's loads large.
    decode_rows: int = 64
    decode_n: int = 64
    decode_k: int = 128
    decode_warps: int = 4


def _call(kernel, blocks: GpuBlocks, grid, in_specs, out_specs, out_shape, estimate):
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        cost_estimate=estimate, interpret=not blocks.compiled)


def _dot_t(a, b, contract_a: int, contract_b: int):
    return jax.lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())), preferred_element_type=F32)


# --- forward ---------------------------------------------------------------------------------------------

def _forward_kernel(x_ref, g_ref, w_ref, out_ref, *, eps: float, k_true: int, step: int):
    def body(kk, carry):
        acc, ss = carry
        cols = pl.ds(kk * step, step)
        x = x_ref[:, cols].astype(F32)
        xg = (x * g_ref[cols].astype(F32)).astype(w_ref.dtype)
        return acc + jnp.dot(xg, w_ref[cols, :], preferred_element_type=F32), ss + jnp.sum(x * x, axis=1)

    bm, bn = out_ref.shape
    acc, ss = jax.lax.fori_loop(0, x_ref.shape[1] // step, body, (jnp.zeros((bm, bn), F32), jnp.zeros((bm,), F32)))
    r = jax.lax.rsqrt(ss / k_true + eps)
    out_ref[...] = (acc * r[:, None]).astype(out_ref.dtype)


def forward(x, g, w, eps: float, blocks: GpuBlocks, out_dtype):
    (m, k), n = x.shape, w.shape[1]
    bm, bn, bk = fit_power_of_two(m, blocks.m), fit_power_of_two(n, blocks.n), fit_power_of_two(k, blocks.k)
    mp, np_, kp = round_up(m, bm), round_up(n, bn), round_up(k, bk)
    out = _call(
        functools.partial(_forward_kernel, eps=eps, k_true=k, step=bk), blocks,
        grid=(mp // bm, np_ // bn),
        in_specs=[pl.BlockSpec((bm, kp), lambda i, j: (i, 0)), pl.BlockSpec((kp,), lambda i, j: (0,)),
                  pl.BlockSpec((kp, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        estimate=cost(2 * m * n * k + 3 * m * k * (np_ // bn), m, (m * k + k * n + m * n) * x.dtype.itemsize),
    )(pad(x, (mp, kp)), pad(g, (kp,)), pad(w, (kp, np_)))
    return crop(out, (m, n))


def decode_forward(x, g, w, eps: float, blocks: GpuBlocks, out_dtype):
    """The forward for x with at most blocks.decode_rows rows: the same kernel (the K loop is inside it
    already, and programs share nothing), with tiles for few rows (the row tile is the next power of two)."""
    small = dataclasses.replace(blocks, n=blocks.decode_n, k=blocks.decode_k, num_warps=blocks.decode_warps)
    return forward(x, g, w, eps, small, out_dtype)


# --- backward --------------------------------------------------------------------------------------------

def _dx_kernel(x_ref, g_ref, r_ref, w_ref, dz_ref, a_ref, s_ref, dg_ref, *, step: int):
    def body(j, t):
        cols = pl.ds(j * step, step)
        return t + _dot_t(dz_ref[:, cols], w_ref[:, cols], 1, 1)

    t = jax.lax.fori_loop(0, dz_ref.shape[1] // step, body, jnp.zeros(a_ref.shape, F32))
    x, g, r = x_ref[...].astype(F32), g_ref[...].astype(F32), r_ref[...][:, None]
    gt = g * t
    a_ref[...] = r * gt
    s_ref[...] = jnp.sum(x * gt, axis=1)
    dg_ref[...] = jnp.sum(x * r * t, axis=0)


def _dw_kernel(x_ref, g_ref, r_ref, dz_ref, dw_ref, *, step: int):
    g = g_ref[...].astype(F32)

    def body(i, acc):
        rows = pl.ds(i * step, step)
        xg = (x_ref[rows, :].astype(F32) * g).astype(dz_ref.dtype)
        rdz = (dz_ref[rows, :].astype(F32) * r_ref[rows][:, None]).astype(dz_ref.dtype)
        return acc + _dot_t(xg, rdz, 0, 0)

    acc = jax.lax.fori_loop(0, x_ref.shape[0] // step, body, jnp.zeros(dw_ref.shape, F32))
    dw_ref[...] = acc.astype(dw_ref.dtype)


def backward(x, g, r, w, dz, blocks: GpuBlocks):
    """dx, dg, dW given the row scales r [M] (computed once by the caller)."""
    (m, k), n = x.shape, w.shape[1]
    # dx: tiles of [rows, columns of x], stepping through N.
    bm, bk, bn = fit_power_of_two(m, blocks.m), fit_power_of_two(k, blocks.n), fit_power_of_two(n, blocks.k)
    mp, kp, np_ = round_up(m, bm), round_up(k, bk), round_up(n, bn)
    a, s, dg = _call(
        functools.partial(_dx_kernel, step=bn), blocks,
        grid=(mp // bm, kp // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, kk: (i, kk)), pl.BlockSpec((bk,), lambda i, kk: (kk,)),
                  pl.BlockSpec((bm,), lambda i, kk: (i,)), pl.BlockSpec((bk, np_), lambda i, kk: (kk, 0)),
                  pl.BlockSpec((bm, np_), lambda i, kk: (i, 0))],
        out_specs=[pl.BlockSpec((bm, bk), lambda i, kk: (i, kk)),
                   pl.BlockSpec((None, bm), lambda i, kk: (kk, i)),
                   pl.BlockSpec((None, bk), lambda i, kk: (i, kk))],
        out_shape=[jax.ShapeDtypeStruct((mp, kp), F32), jax.ShapeDtypeStruct((kp // bk, mp), F32),
                   jax.ShapeDtypeStruct((mp // bm, kp), F32)],
        estimate=cost(2 * m * n * k + 8 * m * k, 0, (2 * m * k + k * n + m * n) * x.dtype.itemsize + 4 * m * k),
    )(pad(x, (mp, kp)), pad(g, (kp,)), pad(r, (mp,)), pad(w, (kp, np_)), pad(dz, (mp, np_)))
    row_sum = crop(jnp.sum(s, axis=0), (m,))[:, None]
    r2 = r[:, None]
    dx = (crop(a, (m, k)) - (r2 * r2 * r2 / k) * x.astype(F32) * row_sum).astype(x.dtype)

    # dW: tiles of [columns of x, columns of dz], stepping through M.
    bk, bn, bm = fit_power_of_two(k, blocks.m), fit_power_of_two(n, blocks.n), fit_power_of_two(m, blocks.k)
    mp, kp, np_ = round_up(m, bm), round_up(k, bk), round_up(n, bn)
    dw = _call(
        functools.partial(_dw_kernel, step=bm), blocks,
        grid=(kp // bk, np_ // bn),
        in_specs=[pl.BlockSpec((mp, bk), lambda kk, j: (0, kk)), pl.BlockSpec((bk,), lambda kk, j: (kk,)),
                  pl.BlockSpec((mp,), lambda kk, j: (0,)), pl.BlockSpec((mp, bn), lambda kk, j: (0, j))],
        out_specs=pl.BlockSpec((bk, bn), lambda kk, j: (kk, j)),
        out_shape=jax.ShapeDtypeStruct((kp, np_), w.dtype),
        estimate=cost(2 * m * n * k + 3 * m * (k + n), 0, (m * k + m * n + k * n) * x.dtype.itemsize),
    )(pad(x, (mp, kp)), pad(g, (kp,)), pad(r, (mp,)), pad(dz, (mp, np_)))
    return dx, crop(jnp.sum(dg, axis=0), (k,)).astype(g.dtype), crop(dw, (k, n))
