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
compute and the compiler is free to overlap them (on TPU its latency-hiding scheduler does). The block's work is
XLA's (einsums and a float32 softmax, the same as models/attention.py's dot_attention) rather than the splash
kernel's: splash's backward is reachable only through its own VJP, which takes a block's gradients with that
block's statistics, where the ring needs the whole row's (docs/attention.md).

Runs per device, inside jax.shard_map over the context axes (`axes`), on its local shards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from scaletrain.parallel import context

_FLOOR = float(jnp.finfo(jnp.float32).min)


def _mask(q_seg_bt, k_seg_bs, q_index_t, k_index_s):
    """[b, t, 1, 1, s]: causal by sequence position, within a document."""
    causal = q_index_t[:, None] >= k_index_s[None, :]
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


def ring_attention(q_btkgh, k_bskh, v_bskh, q_seg_bt, k_seg_bs, order_ct: np.ndarray, axes: tuple[str, ...],
                   block: int = 0, unroll: bool = False):
    """softmax(q k^T) v over the whole sequence, for this device's queries (q already scaled), the keys and values
    passed around the ring of `axes`. `order_ct`: [C, t] the sequence position of each slot of each device's
    shard (parallel/context.py's order, by shard). `block` (dividing t; 0: t): queries per tile of a pass, so a
    pass's scores are [block, t] at a time. `unroll`: the loops unrolled (for XLA's cost estimate, which
    counts a loop's body once). Differentiable (its own backward ring)."""
    ways, t = order_ct.shape
    block = block if 0 < block < t else t
    ring = [(i, (i + 1) % ways) for i in range(ways)]

    def tied(x, *known):
        """`known` passed through one barrier with `x`. The masks depend only on segment ids and positions, the
        same for every layer and known before the step's values: without it, differentiating the layer scan
        hoists them out of the loops and stores every tile's [block, t] mask of every pass at once."""
        return jax.lax.optimization_barrier((x, *known, jnp.asarray(order_ct)))

    def positions(order, step):  # the slots' positions of the block a device holds after `step` passes
        return order[(jax.lax.axis_index(axes) - step) % ways]

    def send(*xs):
        return jax.lax.ppermute(xs, axes, ring)

    def forward(q, k, v, q_seg, k_seg):
        b, _, kh, g, h = q.shape
        q, q_seg, k_seg, order = tied(q, q_seg, k_seg)
        queries = tuple(_tiles(x, block) for x in (q, q_seg, positions(order, 0)))

        def merge(stats, kv, step):  # every tile of queries against one block of keys and values
            k, v, k_seg = kv
            k_index = positions(order, step)

            def tile(args):
                (q, q_seg, q_index), (out, top, total) = args
                logits = _scores(q, k, _mask(q_seg, k_seg, q_index, k_index))
                new_top = jnp.maximum(top, logits.max(-1))
                probs = jnp.exp(logits - new_top[..., None]) * (logits > _FLOOR)
                rescale = jnp.exp(top - new_top)
                out = out * rescale[..., None] + jnp.einsum(
                    "btkgs,bskh->btkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
                return out, new_top, total * rescale + probs.sum(-1)

            return jax.lax.scan(lambda _, args: (None, tile(args)), None, (queries, stats), unroll=unroll)[1]

        n = t // block
        stats = (jnp.zeros((n, b, block, kh, g, h), jnp.float32), jnp.full((n, b, block, kh, g), _FLOOR),
                 jnp.zeros((n, b, block, kh, g), jnp.float32))

        def one(carry, step):
            stats, kv = carry
            return (merge(stats, kv, step), send(*kv)), None

        (stats, kv), _ = jax.lax.scan(one, (stats, (k, v, k_seg)), jnp.arange(ways - 1), unroll=unroll)
        out, top, total = (_untile(x) for x in merge(stats, kv, ways - 1))
        lse = top + jnp.log(total)  # every query sees at least itself: total > 0
        return (out / total[..., None]).astype(q.dtype), lse

    @jax.custom_vjp
    def attend(q, k, v, q_seg, k_seg):
        return forward(q, k, v, q_seg, k_seg)[0]

    def attend_fwd(q, k, v, q_seg, k_seg):
        out, lse = forward(q, k, v, q_seg, k_seg)
        return out, (q, k, v, q_seg, k_seg, out, lse)

    def attend_bwd(residuals, d_out):
        q, k, v, q_seg, k_seg, out, lse = residuals
        d_out, q_seg, k_seg, order = tied(d_out, q_seg, k_seg)
        # d softmax: dS = P (dP - rowsum(dO * O)).
        row = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1)
        queries = tuple(_tiles(x, block) for x in (q, q_seg, positions(order, 0), lse, row, d_out))

        def grads(dq, kv, step):  # every tile of queries against one block; the block's gradients summed
            k, v, k_seg, dk, dv = kv
            k_index = positions(order, step)

            def tile(sums, args):
                (q, q_seg, q_index, lse, row, d_out), dq = args
                mask = _mask(q_seg, k_seg, q_index, k_index)
                probs = jnp.exp(_scores(q, k, mask) - lse[..., None]) * mask
                d_probs = jnp.einsum("btkgh,bskh->btkgs", d_out, v, preferred_element_type=jnp.float32)
                d_logits = probs * (d_probs - row[..., None])
                dk, dv = sums
                dk = dk + jnp.einsum("btkgs,btkgh->bskh", d_logits, q, preferred_element_type=jnp.float32)
                dv = dv + jnp.einsum("btkgs,btkgh->bskh", probs, d_out, preferred_element_type=jnp.float32)
                dq = dq + jnp.einsum("btkgs,bskh->btkgh", d_logits, k, preferred_element_type=jnp.float32)
                return (dk, dv), dq

            (dk, dv), dq = jax.lax.scan(tile, (dk, dv), (queries, dq), unroll=unroll)
            return dq, (k, v, k_seg, dk, dv)

        def one(carry, step):
            dq, kv = grads(*carry, step)
            return (dq, send(*kv)), None

        zeros = jnp.zeros(k.shape, jnp.float32)
        dq = _tiles(jnp.zeros(q.shape, jnp.float32), block)
        (dq, kv), _ = jax.lax.scan(one, (dq, (k, v, k_seg, zeros, zeros)), jnp.arange(ways - 1),
                                      unroll=unroll)
        dq, (*_, dk, dv) = grads(dq, kv, ways - 1)
        dk, dv = send(dk, dv)  # the C-th pass: each block's gradient home
        return _untile(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None

    attend.defvjp(attend_fwd, attend_bwd)
    return attend(q_btkgh, k_bskh, v_bskh, q_seg_bt, k_seg_bs)
