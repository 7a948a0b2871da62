"""Block arithmetic shared by the Pallas kernels: fitting blocks to dimensions, zero padding, cost estimates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def fit(size: int, block: int, align: int) -> int:
    """The block for a dimension of `size`: the whole (aligned) dimension when it is smaller than `block`,
    else the largest aligned divisor of `size` not above `block` (no padding: padding the vocabulary of an
    output projection would copy the logits), else `block` (and the operands get padded)."""
    if size <= block:
        return round_up(size, align)
    for b in range(block - block % align, max(align, block // 4) - 1, -align):
        if size % b == 0:
            return b
    return block


def fit_power_of_two(size: int, block: int, smallest: int = 16) -> int:
    """`fit` for Triton, whose tensors have power-of-two sizes (and dots at least 16 on a side): the next power
    of two when `size` is below `block`, else the largest power of two that divides `size`, else `block`."""
    if size <= block:
        return max(smallest, pl.next_power_of_2(size))
    b = block
    while b > smallest and size % b:
        b //= 2
    return b if size % b == 0 else block


def pad(a: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    if a.shape == tuple(shape):
        return a
    return jnp.pad(a, [(0, s - d) for d, s in zip(a.shape, shape)])


def crop(a: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Undo pad (without a copy when nothing was padded)."""
    return a if a.shape == tuple(shape) else a[tuple(slice(0, s) for s in shape)]


def cost(flops: int, transcendentals: int, bytes_accessed: int) -> pl.CostEstimate:
    """What XLA's scheduler and cost analysis see of a kernel. Bytes follow XLA's own convention for a dot
    (each operand and result once; the re-reads of tiling are not counted), so that XLA's estimates of the
    standard, deferred and fused steps compare like with like."""
    return pl.CostEstimate(flops=flops, transcendentals=transcendentals, bytes_accessed=bytes_accessed)
