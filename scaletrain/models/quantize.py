"""Low-precision matmuls (model.quantization, docs/quantization.md): the operands of a chosen matmul rounded to int8
or fp8 with absmax scales in the forward pass, and the operands of both its backward matmuls too (the incoming
gradient, rounded, against the forward pass's rounded operand), so all three run at the matrix unit's low-precision
rate. Gradients pass straight through the rounding; the parameters and the optimizer state keep their dtypes.

The matmuls are JAX's own (jax.lax.dot / ragged_dot on int8 or float8 operands, accumulating in int32 / float32);
the scaling around them is written here rather than taken from Qwix, because Qwix's (0.1.8) rounds differently on
different meshes: after one step of the tiny model on fsdp 4 x tensor 2 its gradient norm stood 1.8e-4 from the
one-device run's, this module's 3.7e-6; and its grouped matmul scales each weight column across every expert a
device holds and each gradient column across the device's rows, so a device holding other experts or other tokens
rounds otherwise (docs/quantization.md).

Scales: `Quantization.per_tensor` one per operand; otherwise one per row of the left operand and per column of
the right - every index the matmul does not contract (per expert too, for the grouped matmul). A backward matmul
contracts along the dim the forward operand's scales run along, so those scales are moved onto the incoming
gradient before it is rounded (as Qwix and AQT do), and the forward pass's rounded operand is used as it is.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from scaletrain import config
from scaletrain.parallel import sharding

# (forward operands, gradients): fp8 keeps three mantissa bits forward (e4m3) and trades them for range in the
# gradients (e5m2), whose magnitudes spread wider - Transformer Engine's "hybrid" format.
_QTYPES = {"int8": (jnp.int8, jnp.int8), "fp8": (jnp.float8_e4m3fn, jnp.float8_e5m2)}


@dataclasses.dataclass(frozen=True)
class Quantization:
    """How one group's matmuls run: `mode` int8 or fp8, `per_tensor` one scale per operand (else per row and
    column: the rounding adapts to each token's and each output feature's range)."""

    mode: str
    per_tensor: bool = False

    def _how(self, contract_axes=(), out_axes=(), row_axes=()) -> _How:
        forward, grad = _QTYPES[self.mode]
        return _How(forward, grad, self.per_tensor, tuple(contract_axes), tuple(out_axes), tuple(row_axes))

    def dot(self, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
        """x [..., K] @ w [K, N] with quantized operands, in out_dtype (x's by default); a row is x's last dim,
        whatever dims lead it (context parallelism keeps [batch, seq]: flattening would gather the sequence).
        Under jit's automatic
        partitioning XLA takes each scale's maximum across the devices a sharded operand spans; across the batch
        axes a shard_map makes manual (a 1F1B pipeline's stages run per data shard) the maxima over rows are
        taken here."""
        return _dense(x, w.astype(x.dtype), self._how(row_axes=_manual_row_axes())).astype(out_dtype or x.dtype)

    def ragged_dot(self, x: jax.Array, w: jax.Array, group_sizes: jax.Array, contract_axes: tuple[str, ...] = (),
                   out_axes: tuple[str, ...] = (), row_axes: tuple[str, ...] = ()) -> jax.Array:
        """jax.lax.ragged_dot(x [M, K], w [G, K, N], group_sizes) with quantized operands, in x's dtype, on one
        device's share of a sharded matmul (inside shard_map): K split over the mesh axes `contract_axes`, N over
        `out_axes`, and each group's rows spread over `row_axes` too. Every scale is a maximum across the devices
        that share it, so the rounding is the same on every mesh. Scales per row and per expert and column,
        whatever `per_tensor` says."""
        how = dataclasses.replace(self._how(contract_axes, out_axes, row_axes), per_tensor=False)
        return _grouped(x, w.astype(x.dtype), group_sizes, how)


@dataclasses.dataclass(frozen=True)
class _How:
    forward: Any  # the forward operands' dtype
    grad: Any  # the incoming gradient's
    per_tensor: bool
    contract_axes: tuple[str, ...]  # mesh axes (inside shard_map) that split the forward contraction
    out_axes: tuple[str, ...]  # ... the output's columns
    row_axes: tuple[str, ...]  # ... the rows (of a group, in the grouped matmul) beyond those a device holds


def _manual_row_axes() -> tuple[str, ...]:
    """The mesh axes that split a matmul's rows (the batch's) and are manual where it is traced (inside
    shard_map), so that XLA does not take a maximum across them by itself."""
    manual = jax.sharding.get_abstract_mesh().manual_axes
    return tuple(a for a in sharding.active_axes("batch") if a in manual)


def _scale(x: jax.Array, qtype, reduce, axes: tuple[str, ...] = ()) -> jax.Array:
    """The absmax scale of x over its dims `reduce` (all with None; kept, size 1) and across the mesh `axes`."""
    return _from_peak(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=reduce, keepdims=True), qtype, axes)


def _from_peak(peak: jax.Array, qtype, axes: tuple[str, ...]) -> jax.Array:
    if axes:
        peak = jax.lax.pmax(peak, axes)
    largest = jnp.iinfo(qtype).max if jnp.issubdtype(qtype, jnp.integer) else jnp.finfo(qtype).max
    return jnp.where(peak > 0, peak / float(largest), 1.0)


def _cast(x: jax.Array, scale: jax.Array, qtype) -> jax.Array:
    """x / scale rounded to qtype: to the nearest integer, or to the nearest float8."""
    y = x.astype(jnp.float32) / scale
    return (jnp.round(y) if jnp.issubdtype(qtype, jnp.integer) else y).astype(qtype)


def _accumulator(qtype):
    return jnp.int32 if jnp.issubdtype(qtype, jnp.integer) else jnp.float32


def _matmul(a: jax.Array, b: jax.Array, scale: jax.Array, dtype, contract=None) -> jax.Array:
    """a @ b for rounded a and b - a's last dim against b's first, or the dims `contract` ((a's), (b's)) -, times
    `scale` (their scales' product, broadcast to the output), in dtype.

    The matrix unit accumulates in int32 (float32) and writes the product in `dtype`: where the contraction is
    split across devices (FSDP's weight gradient, tensor parallelism's row-parallel output), XLA reduces the
    partial products in the dtype the dot writes - asked for int32, the compiled 8B step reduce-scattered its
    weight gradients in 4-byte pieces, twice the bf16 program's bytes. Scaling after the reduction is exact: every
    device rounds with the same scales."""
    contract = contract or ((a.ndim - 1,), (0,))
    product = jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=dtype)
    return (product.astype(jnp.float32) * scale).astype(dtype)


def _reductions(x, how: _How) -> tuple:
    """The dims of x [..., K] (and of a gradient [..., N]) a row's scale reduces over, and those a column's
    does: everything per tensor."""
    return (None, None) if how.per_tensor else (x.ndim - 1, tuple(range(x.ndim - 1)))


def _dense_forward(x, w, how: _How):
    rows = _reductions(x, how)[0]
    # Over the rows too (per tensor), x's scale spans the devices holding other rows; w is whole on them.
    sx = _scale(x, how.forward, rows, how.row_axes if how.per_tensor else ())  # [..., 1]
    sw = _scale(w, how.forward, None if how.per_tensor else 0)  # [1, N]
    qx, qw = _cast(x, sx, how.forward), _cast(w, sw, how.forward)
    return _matmul(qx, qw, sx * sw, x.dtype), (qx, sx, qw, sw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dense(x, w, how: _How):
    return _dense_forward(x, w, how)[0]


def _dense_backward(how: _How, residuals, g):
    qx, sx, qw, sw = residuals
    dtype, g = g.dtype, g.astype(jnp.float32)
    rows, cols = _reductions(g, how)
    g1 = g * sw  # dx = g @ w^T contracts along w's column scales
    s1 = _scale(g1, how.grad, rows, how.row_axes if how.per_tensor else ())
    g2 = g * sx  # dw = x^T @ g contracts along x's row scales: a maximum over every row
    s2 = _scale(g2, how.grad, cols, how.row_axes)
    lead = tuple(range(g.ndim - 1))
    return (_matmul(_cast(g1, s1, how.grad), qw.T, s1, dtype),
            _matmul(qx, _cast(g2, s2, how.grad), s2.reshape(1, -1), dtype, (lead, lead)))


_dense.defvjp(_dense_forward, _dense_backward)


def _group_of_rows(group_sizes: jax.Array, rows: int) -> jax.Array:
    """Each row's group; G for rows past the groups' sum (padding)."""
    return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right")


def _grouped_forward(x, w, group_sizes, how: _How):
    sx = _scale(x, how.forward, 1, how.contract_axes)  # [M, 1]
    sw = _scale(w, how.forward, 1, how.contract_axes)  # [G, 1, N]
    qx, qw = _cast(x, sx, how.forward), _cast(w, sw, how.forward)
    rows_of = _group_of_rows(group_sizes, x.shape[0])
    sw_rows = sw[:, 0][jnp.minimum(rows_of, w.shape[0] - 1)]  # [M, N]: each row's expert's column scales
    acc = jax.lax.ragged_dot(qx, qw, group_sizes, preferred_element_type=_accumulator(how.forward))
    out = (acc.astype(jnp.float32) * sx * sw_rows).astype(x.dtype)
    return out, (qx, sx, qw, sw_rows, group_sizes, rows_of)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(x, w, group_sizes, how: _How):
    return _grouped_forward(x, w, group_sizes, how)[0]


def _grouped_backward(how: _How, residuals, g):
    qx, sx, qw, sw_rows, group_sizes, rows_of = residuals
    dtype, g = g.dtype, g.astype(jnp.float32)  # x's and (cast to it) w's dtype
    # dx = g @ w^T per expert, along w's column scales: rounded per row.
    g1 = g * sw_rows
    s1 = _scale(g1, how.grad, 1, how.out_axes)
    dx = jax.lax.ragged_dot(_cast(g1, s1, how.grad), qw.swapaxes(1, 2), group_sizes,
                            preferred_element_type=_accumulator(how.grad))
    dx = (dx.astype(jnp.float32) * s1).astype(dtype)
    # dw = x^T g per expert, along x's row scales: rounded per expert and column, over the expert's rows on
    # every device that holds some (row_axes).
    g2 = g * sx
    experts = qw.shape[0]
    peak = jax.ops.segment_max(jnp.abs(g2), rows_of, num_segments=experts)  # padding rows (segment G): dropped
    s2 = _from_peak(jnp.maximum(peak, 0.0), how.grad, how.row_axes)  # [G, N]; an expert without rows: -inf -> 0
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    dw = jax.lax.ragged_dot_general(qx, _cast(g2, s2[jnp.minimum(rows_of, experts - 1)], how.grad), group_sizes, dims,
                                    preferred_element_type=_accumulator(how.grad))
    return dx, (dw.astype(jnp.float32) * s2[:, None, :]).astype(dtype), None


_grouped.defvjp(_grouped_forward, _grouped_backward)


def for_group(cfg, group: str) -> Quantization | None:
    """The Quantization of a model config's matmul group, or None where it runs in the compute dtype."""
    assert group in config.MATMUL_GROUPS, group
    if cfg.quantization == "none" or group not in config.quantized_groups(cfg.quantized_matmuls):
        return None
    return Quantization(cfg.quantization, cfg.quantization_scale == "tensor")
