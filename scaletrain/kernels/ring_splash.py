"""The ring schedule (kernels/ring_attention.py) with each block's work in the splash kernel (docs/context.md).

A pass meets one device's keys and values with the library's splash kernel, forward and backward:
- forward: splash with `save_residuals` gives the block's output and log-sum-exp per query; the blocks merge by
  their log-sum-exps (out = sum_b exp(lse_b - lse) out_b, lse = logsumexp_b lse_b).
- backward: splash's own VJP would take a block's gradients with that block's statistics, where the ring needs
  the whole row's. Its backward kernels (dq, and dk/dv) take the log-sum-exp and rowsum(dO * O) as inputs, so
  each pass calls them (`_splash_attention_bwd`, the library's private entry to them) with the merged output and
  log-sum-exp: exactly the block's share of the whole row's gradient. That private call (kernels/sinks.py's
  splash_backward) is the one place this leans on splash's internals; its signature is pinned by the jax version in
  pyproject.toml and checked by tests/test_context.py against whole-sequence attention.

The mask of a pass: device i's queries against the block of device src = (i - step) mod C, causal by sequence
position and within a document (segment ids). Splash computes a mask in the kernel from each query's entry of
`q_sequence` and each key's index within the block, and a kernel's queries are split over the C devices like the
activations (`q_seq_shards`, as in flash_attention.split_splash), so one kernel per pass serves every device: its
`q_sequence` packs each query's position with the source device of the block it meets, and the key's position is
the layout's arithmetic (context.position). The kernel skips the key blocks the mask hides wholly - with the
zig-zag layout half of every pass after the first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

from scaletrain.kernels import flash_attention, sinks
from scaletrain.kernels.ring_attention import ring
from scaletrain.parallel import context

# A block's rows that met no key come out of splash with a log-sum-exp of -inf (every key block skipped) or about
# the kernel's mask value (every key masked): below this, the row did not see the block.
_UNSEEN = 0.5 * kernel_lib.DEFAULT_MASK_VALUE


class _PassMask(mask_lib._ComputableMask):
    """Pass `step`'s mask over [C x t queries, t keys]: query slot q of device i (row i t + q) sees key slot k of
    the block from device (i - step) mod C where its position is at least the key's. `q_sequence` packs (source
    device << bits) | query position, which the mask function unpacks in the kernel."""

    def __init__(self, seq_len: int, shards: int, layout: str, step: int):
        t = seq_len // shards
        bits = max(1, (seq_len - 1).bit_length())
        if (shards - 1) << bits >= 2 ** 31:
            raise ValueError(f"a sequence of {seq_len} over {shards} ring devices does not pack into int32")

        def visible(packed, k):
            source, q_position = packed >> bits, packed & ((1 << bits) - 1)
            return q_position >= context.position(source, k, seq_len, shards, layout)

        super().__init__((seq_len, t), visible)
        device = np.arange(shards)[:, None]
        q_position = context.position(device, np.arange(t)[None, :], seq_len, shards, layout)
        self.q_sequence = ((((device - step) % shards) << bits) | q_position).reshape(-1).astype(np.int32)
        self._key, self._marked = (seq_len, shards, layout, step), t - 1

    def __getitem__(self, idx) -> np.ndarray:
        """The mask's numpy view (for splash's block tables; the kernel computes its own), with query slot t - 1 of
        device 0 reported blind to key slot 0. Splash fails to build a query-split kernel whose mask has no
        partially masked block (jax 0.12's mask_info concatenates an empty list), as a pass of whole-chunk blocks
        has; that query, the sequence's last, sees every key, so the block holding the pair becomes partial: the
        kernel computes its (true) mask there instead of skipping the masking, with the same result."""
        block = super().__getitem__(idx)
        rows, cols = (range(*s.indices(n)) for s, n in zip(idx, self.shape))
        if self._marked in rows and 0 in cols:
            block = block.copy()
            block[rows.index(self._marked), 0] = False
        return block

    def __eq__(self, other):
        return isinstance(other, _PassMask) and self._key == other._key

    def __hash__(self):
        return hash((_PassMask, self._key))


def pass_kernels(heads: int, seq_len: int, shards: int, layout: str, kernel: flash_attention.Splash) -> list:
    """Splash for each of the ring's C passes, for `heads` query heads of a sequence of `seq_len` laid out by
    `layout` over `shards` devices; each a pytree that shard_map splits along the queries
    (`.manual_sharding_spec`)."""
    t = seq_len // shards
    return [flash_attention.splash_kernel(_PassMask(seq_len, shards, layout, step), heads, t, t, kernel, shards,
                                          save_residuals=True, residuals_name=None) for step in range(shards)]


class SplashBlocks:
    """ring_attention.Blocks through splash: q [b, n, t, h] (already scaled), k and v [b, kv, t, h], segment ids
    [b, t]; `kernels`: this device's share of `pass_kernels`."""
    static_steps = True

    def __init__(self, kernels: list):
        self.kernels = self.arrays = kernels

    def bind(self, arrays):
        return SplashBlocks(arrays)

    def _forward(self, step, q, k, v, q_seg, k_seg):
        kernel = self.kernels[step]
        return jax.vmap(lambda *x: kernel(*x[:3], kernel_lib.SegmentIds(*x[3:])))(q, k, v, q_seg, k_seg)

    def start(self, q, q_seg, kv):
        return (q, q_seg), None, kv

    def merge(self, shared, stats, kv, step):
        (q, q_seg), (k, v, k_seg) = shared, kv
        out_b, (lse_b,) = self._forward(step, q, k, v, q_seg, k_seg)
        seen = lse_b > _UNSEEN
        lse_b = jnp.where(seen, lse_b, -jnp.inf)
        out_b = jnp.where(seen[..., None], out_b.astype(jnp.float32), 0.0)  # unseen rows: 0 / 0
        if stats is None:  # the first pass, the device's own block: every query sees at least itself
            return out_b, lse_b
        out, lse = stats
        merged = jnp.logaddexp(lse, lse_b)
        return out * jnp.exp(lse - merged)[..., None] + out_b * jnp.exp(lse_b - merged)[..., None], merged

    def finish(self, shared, stats):
        out, lse = stats
        return out.astype(shared[0].dtype), lse

    def start_backward(self, q, q_seg, kv, out, lse, d_out):
        return (q, q_seg, out, lse, d_out), jnp.zeros(q.shape, jnp.float32), kv

    def grads(self, shared, dq, kv, dkv, step):
        kernel = self.kernels[step]
        assert kernel.dkv_mask_info.partial_mask_blocks is None  # a computed mask: nothing to collapse
        (q, q_seg, out, lse, d_out), (k, v, k_seg) = shared, kv
        dq_b, dk_b, dv_b = jax.vmap(lambda *x: sinks.splash_backward(kernel, *x))(q, k, v, q_seg, k_seg, out, lse,
                                                                                   d_out)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        return dq + f32(dq_b), (dkv[0] + f32(dk_b), dkv[1] + f32(dv_b))

    def finish_backward(self, shared, dq):
        return dq


def ring_splash_attention(kernels: list, q_btnh, k_btkh, v_btkh, segments_bt, axes: tuple[str, ...],
                          sinks_n=None):
    """One device's share of ring attention through splash (inside shard_map over the sequence's mesh `axes`):
    its queries [b, t, n, h] (already scaled), keys and values [b, t, kv, h] and segment ids [b, t]; `sinks_n` a
    sink logit per query head, or None."""
    heads_first = flash_attention.heads_first
    segments_bt = segments_bt.astype(jnp.int32)
    out = ring(SplashBlocks(kernels), heads_first(q_btnh), heads_first(k_btkh), heads_first(v_btkh), segments_bt,
               segments_bt, len(kernels), axes, sinks=None if sinks_n is None else sinks_n[None, :, None])
    return heads_first(out)
