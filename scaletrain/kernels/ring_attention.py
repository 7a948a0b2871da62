"""Ring attention: context parallelism's attention without gathering the sequence (docs/context.md).

Each of the C devices of the context axis holds its own slots of every sequence (the layout's `order`): its
queries, keys and values. Instead of gathering the keys and values whole, the devices pass them around the ring
(device i sends to i + 1) and each meets the blocks one at a time, merging them into its output by the online
softmax (a running maximum and sum per query, as in flash attention): after C - 1 passes every query has seen
every key. The backward pass runs the ring again, the key/value gradients travelling with their block and
arriving home after the C-th pass. A device holds two blocks of keys and values (its own and the one in
flight) and one block of scores, [t / C, t / C] per head: memory falls with C where the all-gather's K/V and
their gradient grow to the whole sequence.

Each pass sends the block the device has just worked on, so the transfer has no data dependence on the block's
compute and the compiler is free to overlap them (on TPU its latency-hiding scheduler does).

The schedule (`ring`) is one; a block's work is pluggable (`Blocks`): XLA's here (einsums and a float32 softmax, the
same as models/attention.py's dot_attention, queries in tiles), or the splash kernel's (kernels/ring_splash.py).

Runs per device, inside jax.shard_map over the context axes (`axes`), on its local shards.
"""

from __future__ import annotations

import copy
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from scaletrain.kernels import sinks as sinks_lib
from scaletrain.parallel import context

_FLOOR = float(jnp.finfo(jnp.float32).min)


def _mask(q_seg_bt, k_seg_bs, q_index_t, k_index_s, window: int = 0, slides=True):
    """[b, t, 1, 1, s]: causal by sequence position, within a document; with `window` > 0, where `slides` (a bool,
    or a traced one: the layer's kind), only the keys at positions > the query's - window."""
    causal = q_index_t[:, None] >= k_index_s[None, :]
    if window:
        causal = causal & ((q_index_t[:, None] - k_index_s[None, :] < window) | ~jnp.asarray(slides))
    return (causal[None] & (q_seg_bt[:, :, None] == k_seg_bs[:, None, :]))[:, :, None, None]


def _scores(q_btkgh, k_bskh, mask):
    logits = jnp.einsum("btkgh,bskh->btkgs", q_btkgh, k_bskh, preferred_element_type=jnp.float32)
    return jnp.where(mask, logits, _FLOOR)


def _tiles(x, block: int):
    """[b, t, ...] -> [t / block, b, block, ...] (a [t] array: [t / block, block])."""
    return context.blocks(x[None], 1, block)[:, 0] if x.ndim == 1 else context.blocks(x, 1, block)


def _untile(x):
    """`_tiles`' inverse for [n, b, block, ...]."""
    return context.unblocks(x, 1)


class Blocks(Protocol):
    """One device's attention against one block of keys and values, as the ring's schedule calls it. `static_steps`:
    whether a pass needs its step as a Python int (its own kernel per pass), so the passes are unrolled."""
    static_steps: bool
    arrays: object  # the arrays the blocks hold (a pytree; () for none), passed into the ring's custom VJP

    def bind(self, arrays) -> Blocks:
        """These blocks holding `arrays` (as traced inside the custom VJP) in place of their own."""

    def start(self, q, q_seg, kv):
        """Before the first pass: (what the passes share, the merged statistics' start, the block to send)."""

    def merge(self, shared, stats, kv, step):
        """The statistics with the block a device holds after `step` passes merged in."""

    def finish(self, shared, stats):
        """(output, log-sum-exp per query) from the statistics of every block."""

    def start_backward(self, q, q_seg, kv, out, lse, d_out):
        """Before the first backward pass: (what the passes share, dq's start, the block to send)."""

    def grads(self, shared, dq, kv, dkv, step):
        """(dq, (dk, dv)) with this block's share added (dk, dv: the block's, float32, travelling with it)."""

    def finish_backward(self, shared, dq):
        """dq in q's layout."""


def ring(blocks: Blocks, q, k, v, q_seg, k_seg, ways: int, axes: tuple[str, ...], unroll: bool = False,
         sinks=None):
    """softmax(q k^T) v over the whole sequence for this device's queries, the keys and values (and their segment
    ids) passed around the ring of `axes` (`ways` devices), each block's work `blocks`'. Differentiable: its own
    backward ring, the key/value gradients sent home after the last pass. `sinks`: a sink logit per query head
    (kernels/sinks.py), shaped to broadcast against the blocks' log-sum-exp; folded in after the last pass."""
    pairs = [(i, (i + 1) % ways) for i in range(ways)]

    def send(xs):
        return jax.lax.ppermute(xs, axes, pairs)

    def passes(body, carry):  # body(carry, step) for the first ways - 1 passes, each followed by its send
        if blocks.static_steps:
            for step in range(ways - 1):
                carry = body(carry, step)
            return carry
        return jax.lax.scan(lambda c, step: (body(c, step), None), carry, jnp.arange(ways - 1), unroll=unroll)[0]

    def forward(arrays, q, k, v, q_seg, k_seg, sinks):
        b = blocks.bind(arrays)
        shared, stats, kv = b.start(q, q_seg, (k, v, k_seg))
        stats, kv = passes(lambda c, step: (b.merge(shared, c[0], c[1], step), send(c[1])), (stats, kv))
        out, lse = b.finish(shared, b.merge(shared, stats, kv, ways - 1))
        return (out, lse) if sinks is None else sinks_lib.fold(out, lse, sinks)

    # The blocks' arrays (splash's block tables) are the VJP's inputs: closed over, they would leak its tracers.
    @jax.custom_vjp
    def attend(arrays, q, k, v, q_seg, k_seg, sinks):
        return forward(arrays, q, k, v, q_seg, k_seg, sinks)[0]

    def attend_fwd(arrays, q, k, v, q_seg, k_seg, sinks):
        out, lse = forward(arrays, q, k, v, q_seg, k_seg, sinks)
        return out, (arrays, q, k, v, q_seg, k_seg, sinks, out, lse)

    def attend_bwd(residuals, d_out):
        # With sinks, out and lse are the sink-softmax's: the blocks' gradients are then its own.
        arrays, q, k, v, q_seg, k_seg, sinks, out, lse = residuals
        blocks_ = blocks.bind(arrays)
        shared, dq, kv = blocks_.start_backward(q, q_seg, (k, v, k_seg), out, lse, d_out)

        def one(carry, step):
            dq, (*kv, dk, dv) = carry
            dq, dkv = blocks_.grads(shared, dq, tuple(kv), (dk, dv), step)
            return dq, send((*kv, *dkv))

        zeros = jnp.zeros(k.shape, jnp.float32)
        dq, (*kv, dk, dv) = passes(one, (dq, (*kv, zeros, zeros)))
        dq, dkv = blocks_.grads(shared, dq, tuple(kv), (dk, dv), ways - 1)
        dk, dv = send(dkv)  # the C-th pass: each block's gradient home
        dq = blocks_.finish_backward(shared, dq).astype(q.dtype)
        d_sinks = None if sinks is None else sinks_lib.sink_grad(out, lse, d_out, sinks)
        return None, dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None, d_sinks

    attend.defvjp(attend_fwd, attend_bwd)
    return attend(blocks.arrays, q, k, v, q_seg, k_seg, sinks)


class XlaBlocks:
    """A block's work in XLA: `block` queries (dividing t; 0: t) per tile, so a pass's scores are [block, t] at a
    time; merged by the running maximum and sum. q [b, t, kv, g, h] (already scaled), k and v [b, t, kv, h].
    `order_ct`: [C, t] the sequence position of each slot of each device's shard (parallel/context.py's order,
    by shard). `window` > 0: a sliding window of that many keys where `slides` (models/window.py's: a bool, or
    a traced one, which travels as the blocks' array)."""
    static_steps = False

    def __init__(self, order_ct: np.ndarray, axes: tuple[str, ...], block: int = 0, unroll: bool = False,
                 window: int = 0, slides=True):
        self.order_ct, self.axes, self.unroll, self.window = order_ct, axes, unroll, window
        t = order_ct.shape[1]
        self.block = block if 0 < block < t else t
        self.arrays = () if isinstance(slides, bool) else (slides,)
        self.slides = slides

    def bind(self, arrays):
        if not arrays:
            return self
        bound = copy.copy(self)
        bound.slides = arrays[0]
        return bound

    def _mask(self, q_seg, k_seg, q_index, k_index):
        return _mask(q_seg, k_seg, q_index, k_index, self.window, self.slides)

    def _tied(self, x, *known):
        """`known` passed through one barrier with `x`. The masks depend only on segment ids and positions, the
        same for every layer and known before the step's values: without it, differentiating the layer scan
        hoists them out of the loops and stores every tile's [block, t] mask of every pass at once."""
        return jax.lax.optimization_barrier((x, *known, jnp.asarray(self.order_ct)))

    def _positions(self, order, step):  # the slots' positions of the block a device holds after `step` passes
        return order[(jax.lax.axis_index(self.axes) - step) % len(self.order_ct)]

    def _scan(self, body, carry, xs):
        return jax.lax.scan(body, carry, xs, unroll=self.unroll)

    def start(self, q, q_seg, kv):
        k, v, k_seg = kv
        q, q_seg, k_seg, order = self._tied(q, q_seg, k_seg)
        queries = tuple(_tiles(x, self.block) for x in (q, q_seg, self._positions(order, 0)))
        n, (b, _, kh, g, h) = q.shape[1] // self.block, q.shape
        stats = (jnp.zeros((n, b, self.block, kh, g, h), jnp.float32),
                 jnp.full((n, b, self.block, kh, g), _FLOOR), jnp.zeros((n, b, self.block, kh, g), jnp.float32))
        return (queries, order), stats, (k, v, k_seg)

    def merge(self, shared, stats, kv, step):  # every tile of queries against one block of keys and values
        queries, order = shared
        k, v, k_seg = kv
        k_index = self._positions(order, step)

        def tile(_, args):
            (q, q_seg, q_index), (out, top, total) = args
            logits = _scores(q, k, self._mask(q_seg, k_seg, q_index, k_index))
            new_top = jnp.maximum(top, logits.max(-1))
            probs = jnp.exp(logits - new_top[..., None]) * (logits > _FLOOR)
            rescale = jnp.exp(top - new_top)
            out = out * rescale[..., None] + jnp.einsum(
                "btkgs,bskh->btkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
            return None, (out, new_top, total * rescale + probs.sum(-1))

        return self._scan(tile, None, (queries, stats))[1]

    def finish(self, shared, stats):
        (q_tiles, *_), _ = shared
        out, top, total = (_untile(x) for x in stats)
        lse = top + jnp.log(total)  # every query sees at least itself: total > 0
        return (out / total[..., None]).astype(q_tiles.dtype), lse

    def start_backward(self, q, q_seg, kv, out, lse, d_out):
        k, v, k_seg = kv
        d_out, q_seg, k_seg, order = self._tied(d_out, q_seg, k_seg)
        # d softmax: dS = P (dP - rowsum(dO * O)).
        row = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1)
        queries = tuple(_tiles(x, self.block) for x in (q, q_seg, self._positions(order, 0), lse, row, d_out))
        return (queries, order), _tiles(jnp.zeros(q.shape, jnp.float32), self.block), (k, v, k_seg)

    def grads(self, shared, dq, kv, dkv, step):  # every tile of queries against one block; its gradients summed
        queries, order = shared
        k, v, k_seg = kv
        k_index = self._positions(order, step)

        def tile(sums, args):
            (q, q_seg, q_index, lse, row, d_out), dq = args
            mask = self._mask(q_seg, k_seg, q_index, k_index)
            probs = jnp.exp(_scores(q, k, mask) - lse[..., None]) * mask
            d_probs = jnp.einsum("btkgh,bskh->btkgs", d_out, v, preferred_element_type=jnp.float32)
            d_logits = probs * (d_probs - row[..., None])
            dk, dv = sums
            dk = dk + jnp.einsum("btkgs,btkgh->bskh", d_logits, q, preferred_element_type=jnp.float32)
            dv = dv + jnp.einsum("btkgs,btkgh->bskh", probs, d_out, preferred_element_type=jnp.float32)
            dq = dq + jnp.einsum("btkgs,bskh->btkgh", d_logits, k, preferred_element_type=jnp.float32)
            return (dk, dv), dq

        dkv, dq = self._scan(tile, dkv, (queries, dq))
        return dq, dkv

    def finish_backward(self, shared, dq):
        return _untile(dq)


def ring_attention(q_btkgh, k_bskh, v_bskh, q_seg_bt, k_seg_bs, order_ct: np.ndarray, axes: tuple[str, ...],
                   block: int = 0, unroll: bool = False, sinks_kg=None, window: int = 0, slides=True):
    """The ring with XLA's blocks (`XlaBlocks`) on this device's shards: q [b, t, kv, g, h] already scaled.
    `unroll`: the loops unrolled (for XLA's cost estimate, which counts a loop's body once). `sinks_kg`: a sink
    logit per query head [kv, g], or None. `window`, `slides`: a sliding window (XlaBlocks')."""
    blocks = XlaBlocks(order_ct, axes, block, unroll, window, slides)
    sinks = None if sinks_kg is None else sinks_kg[None, None]
    return ring(blocks, q_btkgh, k_bskh, v_bskh, q_seg_bt, k_seg_bs, len(order_ct), axes, unroll, sinks)
