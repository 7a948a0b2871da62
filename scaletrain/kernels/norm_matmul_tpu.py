"""FlashNorm's kernels for TPUs, compiled by Mosaic (norm_matmul.py holds the op and the math).

Grids and the one rule that matters (the race FlashNorm's authors describe has a TPU twin): a grid axis along
which state is carried - an accumulator in scratch, an output block revisited - must be "arbitrary" (run in
order on one core); only axes whose steps are independent may be "parallel" (split across a megacore's two
TensorCores). Here:
- forward, K-tiled, grid (M/bm, N/bn, K/bk): the K axis accumulates x.W and sum(x^2) -> arbitrary; rows and
  columns are independent (each (i, j) recomputes its rows' sum of squares, K/bn of the matmul's work) ->
  parallel.
- dx, grid (M/bm, N/bn): the N axis accumulates dz.W^T for full rows, which the RMSNorm backward needs whole
  -> arbitrary. Rows of K = d_model fit VMEM at every Llama width (the row block shrinks with K).
- dW, grid (N/bn, K/bk, M/bm): the M axis accumulates x^T.dz -> arbitrary.
- decode (few rows: one token per sequence), grid (N/bn,): all of x stays in VMEM, each step reads one whole-K
  panel of W and loops over K inside the kernel, accumulating x.W and sum(x^2) in registers; nothing crosses
  from one step to the next -> parallel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from scaletrain.kernels.tiling import cost, crop, fit, pad, round_up

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Block sizes (rows, output columns, contraction), the VMEM budget the compiler may use, and whether the
    kernels are compiled by Mosaic (on or for a TPU) or run in interpret mode (anywhere else)."""
    m: int = 256
    n: int = 256
    k: int = 2048
    vmem_limit_bytes: int = 32 * 2**20
    compiled: bool = True
    # The decode kernel serves x with at most `decode_rows` rows, reading W in panels of `decode_n` columns
    # (fewer where a double-buffered whole-K panel would take more than half the VMEM budget).
    decode_rows: int = 64
    decode_n: int = 512


# Per TPU generation. VMEM per TensorCore: v4 16 MiB, v5e/v6e 128 MiB, v5p 64 MiB (reference/scaling.md).
# The MXU is 128 wide on v4/v5e/v5p and 256 on v6e, so blocks are multiples of 256 throughout. K is tiled at
# 2048 on v4 (a (256, 2048) bf16 block and its double buffer fit with room) and taken whole up to 8192 on
# the others, so the forward reads x once per output column block.
# Decode reads W once per token and does almost no arithmetic on it: the larger panels halve the grid steps
# (each costs ~0.35 us of overhead) where VMEM allows.
GENERATIONS = {
    "v4": Blocks(m=256, n=256, k=2048, vmem_limit_bytes=14 * 2**20, decode_n=256),
    "v5e": Blocks(m=512, n=512, k=8192, vmem_limit_bytes=96 * 2**20, decode_n=1024),
    "v5p": Blocks(m=512, n=512, k=4096, vmem_limit_bytes=48 * 2**20, decode_n=1024),
    "v6e": Blocks(m=512, n=1024, k=8192, vmem_limit_bytes=96 * 2**20, decode_n=1024),
}


# device_kind as libtpu spells it -> generation.
_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
          "TPU v6 lite": "v6e", "TPU v6e": "v6e"}


def blocks_for(device_kind: str) -> Blocks:
    """The block sizes for a TPU, by its device_kind."""
    return GENERATIONS.get(_KINDS.get(device_kind, ""), Blocks())


# Off TPU the model's kernels run in the interpreter, whose cost is per grid step (milliseconds each on a CPU):
# the default blocks. (The kernel tests choose small blocks, so that every grid axis takes several steps.)
INTERPRETED = Blocks(compiled=False)


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


def forward(x, g, w, eps: float, blocks: Blocks, out_dtype, semantics=("parallel", "parallel", "arbitrary")):
    (m, k), n = x.shape, w.shape[1]
    bm, bn, bk = fit(m, blocks.m, 8), fit(n, blocks.n, 128), fit(k, blocks.k, 128)
    mp, np_, kp = round_up(m, bm), round_up(n, bn), round_up(k, bk)
    # Zero padding changes nothing: zero columns of x add nothing to x.W or to sum(x^2) (whose mean divides
    # by the true K), zero rows and columns of the output are cut off.
    x_p, g_p, w_p = pad(x, (mp, kp)), pad(g.reshape(1, k), (1, kp)), pad(w, (kp, np_))
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
        cost_estimate=cost(2 * m * n * k + 3 * m * k * (np_ // bn), m, (m * k + k * n + m * n) * x.dtype.itemsize),
        interpret=_interpret(blocks),
    )(x_p, g_p, w_p)
    return crop(out, (m, n))


# --- decode: a few rows ----------------------------------------------------------------------------------

# The K loop's step inside the decode kernel: a (rows, 512) slice of x against a (512, bn) slice of the panel.
DECODE_STEP = 512


def _decode_kernel(x_ref, g_ref, w_ref, out_ref, *, eps: float, k_true: int, step: int):
    def body(kk, carry):
        acc, ss = carry
        cols = pl.ds(pl.multiple_of(kk * step, step), step)
        x = x_ref[:, cols].astype(F32)
        xg = (x * g_ref[:, cols].astype(F32)).astype(w_ref.dtype)
        acc = acc + jnp.dot(xg, w_ref[cols, :], preferred_element_type=F32)
        return acc, ss + jnp.sum(x * x, axis=1, keepdims=True)

    m, bn = out_ref.shape
    acc, ss = jax.lax.fori_loop(0, x_ref.shape[1] // step, body, (jnp.zeros((m, bn), F32), jnp.zeros((m, 1), F32)))
    out_ref[...] = (acc * jax.lax.rsqrt(ss / k_true + eps)).astype(out_ref.dtype)


def decode_forward(x, g, w, eps: float, blocks: Blocks, out_dtype):
    """The forward for x [M, K] with M <= blocks.decode_rows. Every grid step recomputes its rows' sum of
    squares (M x K, against its M x K x bn of matmul) rather than carrying r from the first step: a carried r
    would make the column axis "arbitrary", and a megacore chip would then read all of W on one TensorCore."""
    (m, k), n = x.shape, w.shape[1]
    step = fit(k, DECODE_STEP, 128)
    kp = round_up(k, step)
    panel = max(128, min(blocks.decode_n, blocks.vmem_limit_bytes // 2 // (2 * kp * w.dtype.itemsize) // 128 * 128))
    bn = fit(n, panel, 128)
    np_ = round_up(n, bn)
    out = pl.pallas_call(
        functools.partial(_decode_kernel, eps=eps, k_true=k, step=step),
        grid=(np_ // bn,),
        # x's rows are few: its block is the whole array (any row count is a legal block then).
        in_specs=[pl.BlockSpec((m, kp), lambda j: (0, 0)), pl.BlockSpec((1, kp), lambda j: (0, 0)),
                  pl.BlockSpec((kp, bn), lambda j: (0, j))],
        out_specs=pl.BlockSpec((m, bn), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((m, np_), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                             vmem_limit_bytes=blocks.vmem_limit_bytes),
        cost_estimate=cost(2 * m * n * k + 3 * m * k * (np_ // bn), m * (np_ // bn),
                           (m * k + k * n + m * n) * x.dtype.itemsize),
        interpret=_interpret(blocks),
    )(pad(x, (m, kp)), pad(g.reshape(1, k), (1, kp)), pad(w, (kp, np_)))
    return crop(out, (m, n))


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


def backward(x, g, r, w, dz, blocks: Blocks, dx_semantics=("parallel", "arbitrary"),
             dw_semantics=("parallel", "parallel", "arbitrary")):
    """dx, dg, dW given the row scales r [M] (computed once by the caller)."""
    (m, k), n = x.shape, w.shape[1]
    r = r.reshape(m, 1)
    params = dict(interpret=_interpret(blocks))
    # dx and dg: full rows (the RMSNorm backward reduces over all of K), so the row block shrinks with K.
    bn = fit(n, blocks.n, 128)
    bm = fit(m, _full_row_block(round_up(k, 128), bn, blocks), 8)
    mp, np_, kp = round_up(m, bm), round_up(n, bn), round_up(k, 128)
    x_p, g_p, r_p = pad(x, (mp, kp)), pad(g.reshape(1, k), (1, kp)), pad(r, (mp, 1))
    w_p, dz_p = pad(w, (kp, np_)), pad(dz, (mp, np_))
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
        cost_estimate=cost(2 * m * n * k + 8 * m * k, 0, (2 * m * k + k * n + m * n) * x.dtype.itemsize),
        **params,
    )(x_p, g_p, r_p, w_p, dz_p)

    bm, bk = fit(m, blocks.m, 8), fit(k, blocks.k, 128)
    mp, kp = round_up(m, bm), round_up(k, bk)
    x_p, g_p, r_p, dz_p = pad(x, (mp, kp)), pad(g.reshape(1, k), (1, kp)), pad(r, (mp, 1)), pad(dz, (mp, np_))
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
        cost_estimate=cost(2 * m * n * k + 3 * m * (k + n), 0, (m * k + m * n + k * n) * x.dtype.itemsize),
        **params,
    )(x_p, g_p, r_p, dz_p)
    return crop(dx, (m, k)), crop(jnp.sum(dg, axis=(0, 1)), (k,)).astype(g.dtype), crop(dw, (k, n))


def _full_row_block(kp: int, bn: int, blocks: Blocks) -> int:
    """Rows per block when a block holds whole rows of K: x and dx (double-buffered, 2 bytes) and the f32
    accumulator take 12 bytes per element of a row, W's double-buffered column block the rest of half the
    VMEM budget (the other half is the compiler's)."""
    budget = blocks.vmem_limit_bytes // 2 - 2 * 2 * kp * bn
    return max(8, min(blocks.m, budget // (12 * kp) // 8 * 8))


def vmem_bytes(m: int, n: int, k: int, blocks: Blocks, itemsize: int = 2) -> int:
    """The forward's VMEM need: double-buffered x, g, W and output blocks, plus the f32 scratch."""
    bm, bn, bk = fit(m, blocks.m, 8), fit(n, blocks.n, 128), fit(k, blocks.k, 128)
    return 2 * (bm * bk + bk + bk * bn + bm * bn) * itemsize + (bm * bn + bm) * 4
