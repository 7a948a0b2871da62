"""Context parallelism's sequence layout: which positions of a sequence each `context` shard holds.

Under a causal mask a query attends to the keys before it, so with the sequence cut into contiguous shards the
last shard does C times the attention work of the first. The zig-zag layout (MaxText's and torchtitan's load
balancing) cuts the sequence into 2C chunks and gives shard i chunks i and 2C-1-i: every shard then holds the
same number of (query, key) pairs to compute. The trainer lays each batch out so (Setup.put_batch, on the host,
before the arrays reach the devices); attention reads the same order to build its causal mask and to put the
gathered keys and values back in sequence order. Every other layer works token by token, and the loss is a sum
over tokens, so nothing else sees the layout.
"""

from __future__ import annotations

import numpy as np


def position(shard, slot, seq_len: int, shards: int, layout: str):
    """The sequence position that `slot` of `shard` holds (ints or integer arrays, numpy's or jax's). Written with
    +, * and >= alone so that a Pallas kernel can compute it for its own indices (ring_splash's mask)."""
    local = seq_len // shards
    if shards == 1 or layout == "contiguous":
        return shard * local + slot
    chunk = local // 2  # slots [0, chunk): chunk `shard`; [chunk, local): chunk 2 shards - 1 - shard
    return shard * chunk + slot + (slot >= chunk) * ((2 * shards - 2 - 2 * shard) * chunk)


def order(seq_len: int, shards: int, layout: str) -> np.ndarray | None:
    """The sequence position held at each slot of the laid-out sequence ([seq_len] int32), shard i holding slots
    [i seq_len / shards, (i + 1) seq_len / shards); None where that is the sequence's own order."""
    if shards == 1 or layout == "contiguous":
        return None
    slots = np.arange(seq_len // shards)[None, :]
    return position(np.arange(shards)[:, None], slots, seq_len, shards, layout).reshape(-1).astype(np.int32)


def chunks(shards: int, layout: str) -> int:
    """The pieces `order` cuts a sequence into: the sequence length must be a multiple of it."""
    return 2 * shards if shards > 1 and layout == "zigzag" else shards


def blocks(x, shards: int, block: int):
    """[b, t, ...] -> [n, b, shards x block, ...]: step i of a loop over a split sequence takes the i-th block of
    `block` positions of every one of its `shards` (each device's own positions: a block of the whole sequence
    would lie on one device, which would then work alone, or have the others' share moved to it)."""
    n = x.shape[1] // (shards * block)
    y = x.reshape(x.shape[0], shards, n, block, *x.shape[2:]).swapaxes(1, 2).swapaxes(0, 1)
    return y.reshape(n, x.shape[0], shards * block, *x.shape[2:])


def unblocks(y, shards: int):
    """`blocks`' inverse: [n, b, shards x block, ...] -> [b, t, ...]."""
    n, b, width = y.shape[:3]
    x = y.reshape(n, b, shards, width // shards, *y.shape[3:]).swapaxes(0, 1).swapaxes(1, 2)
    return x.reshape(b, n * width, *y.shape[3:])


def lay_out(batch: dict[str, np.ndarray], seq_order: np.ndarray | None) -> dict[str, np.ndarray]:
    """A batch's [rows, seq_len] arrays in the layout `seq_order` gives."""
    return batch if seq_order is None else {k: np.take(v, seq_order, axis=1) for k, v in batch.items()}
