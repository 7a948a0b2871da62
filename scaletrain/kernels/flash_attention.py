"""Flash attention: causal attention within each packed document, grouped-query heads, through the library's
Pallas kernels (docs/attention.md).

`flash_attention(q, k, v, segment_ids, kernel)` computes what `reference` computes - softmax(q k^T) v with the
causal and same-document mask, q already scaled - without the [t, s] score matrix ever leaving the chip's
on-core memory, and skipping the key blocks the mask hides entirely (about half of them: causal FLOPs):
- TPU: JAX's splash attention (Mosaic). Query heads share their key/value head in the kernel's index maps, so
  K/V are never repeated; the causal mask is static (its block structure is known at trace time, so fully
  masked blocks are never visited), documents are segment ids. Off TPU the same kernel runs in Pallas'
  interpret mode, which is how the CPU tests check it.
- GPU: JAX's Pallas Triton kernel (jax.experimental.pallas.ops.gpu.attention), which takes segment ids and the
  causal flag. It indexes K/V by query head, so grouped K/V heads are repeated for it (cuDNN's fused attention
  would not need that, but takes packed documents only as ragged offsets with a static maximum count).

Sequences whose length the blocks do not divide are padded with a segment id no document has (the pads attend
to themselves only, and are cut off again).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from scaletrain.facts import hardware
from scaletrain.kernels import sinks as sinks_lib
from scaletrain.kernels.tiling import round_up
from scaletrain.parallel.checks import FLASH_BLOCK

# Splash's kernels take blocks in multiples of the TPU's 128 lanes.
_LANES = FLASH_BLOCK
_PAD_SEGMENT = -1


@dataclasses.dataclass(frozen=True)
class Splash:
    """Splash attention (TPU) with its largest query and key/value blocks; `interpret` off TPU."""
    block_q: int = 512
    block_kv: int = 512
    interpret: bool = False


@dataclasses.dataclass(frozen=True)
class Triton:
    """Pallas' Triton attention (GPU): its forward query and key blocks, and the backward kernels'. 64 for all
    three was the fastest measured on an H200 (docs/attention.md); the library's 128-query forward blocks
    overflow the shared memory at head_dim 128 in float32."""
    block_q: int = 64
    block_k: int = 64
    block_backward: int = 64
    interpret: bool = False


# Per TPU generation. A (512 x 1024) float32 score block is 2 MiB of VMEM, with q, k, v, the output and their
# double buffers under 6 MiB at head_dim 128: it fits every generation's VMEM (v4 16 MiB, v5p 64 MiB, v5e/v6e
# 128 MiB). 512 x 512 is what MaxText runs on every generation; v6e's 256-wide MXU takes longer key blocks.
# These have not been profiled on a TPU yet (docs/attention.md says how).
GENERATIONS = {"v4": Splash(512, 512), "v5e": Splash(512, 512), "v5p": Splash(512, 512), "v6e": Splash(512, 1024)}

# Off TPU and GPU: the TPU kernel interpreted, with the smallest blocks (several per axis at test sizes).
INTERPRETED = Splash(block_q=_LANES, block_kv=_LANES, interpret=True)


def splash_for(chip: str | None) -> Splash:
    """Splash's blocks for a TPU generation by its hardware.yaml name (the defaults for one not in the table)."""
    return GENERATIONS.get(chip or "", Splash())


def kernel_for(device: jax.Device) -> Splash | Triton:
    """The kernel and block sizes for a device: splash on a TPU, Triton on a GPU, splash interpreted elsewhere."""
    if device.platform == "tpu":
        return splash_for(hardware.chip(device.device_kind))
    if device.platform == "gpu":
        return Triton()
    return INTERPRETED


def reference(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, segment_ids_bt: jax.Array) -> jax.Array:
    """The plain twin: every score materialised, float32 softmax. q is already scaled."""
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    q_btkgh = q_btnh.reshape(b, t, kv, n // kv, h)
    logits = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=jnp.float32)
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    same_doc = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
    logits = jnp.where((causal & same_doc)[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(q_btnh.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v_bskh).reshape(q_btnh.shape)


def _block(size: int, largest: int) -> int:
    """The largest multiple of 128 lanes that divides `size` (itself a multiple of 128) and is at most `largest`."""
    return max(b for b in range(_LANES, min(largest, size) + 1, _LANES) if size % b == 0)


def splash_blocks(seq_len: int, kernel: Splash) -> tuple[int, int, int]:
    """(padded length, query block, key/value block) that splash runs a sequence of `seq_len` with."""
    t = round_up(seq_len, _LANES)
    return t, _block(t, kernel.block_q), _block(t, kernel.block_kv)


def splash_kernel(mask, heads: int, q_len: int, kv_len: int, kernel: Splash, shards: int = 1,
                  save_residuals: bool = False, residuals_name: str | None = "attention_out",
                  soft_cap: float = 0.0):
    """Splash with one splash `mask` ([shards x q_len, kv_len]) for each of `heads` query heads, its queries split
    into `shards` slices of `q_len`, with the largest blocks `kernel` allows that divide them. Built per trace (the
    scan traces a layer once): the mask's block structure is numpy work at trace time. Its residuals (output and
    log-sum-exp) are named `residuals_name`, so remat policies can save or offload them. `soft_cap` > 0: scores
    capped to cap * tanh(score / cap) (Gemma 2's attention logit soft-capping)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    bq, bkv = _block(q_len, kernel.block_q), _block(kv_len, kernel.block_kv)
    blocks = sa.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                           block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
    return sa.make_splash_mha(sa.MultiHeadMask([mask] * heads), block_sizes=blocks, head_shards=1,
                              q_seq_shards=shards, save_residuals=save_residuals,
                              residual_checkpoint_name=residuals_name, interpret=kernel.interpret,
                              attn_logits_soft_cap=soft_cap or None)


def _make_splash(heads: int, seq_len: int, q_len: int, kernel: Splash, q_order: np.ndarray | None = None,
                 shards: int = 1, window: int = 0, soft_cap: float = 0.0, sinks: bool = False):
    """Causal splash for `heads` query heads against `seq_len` keys in sequence order, its queries split into
    `shards` slices of `q_len`; `q_order`: the sequence position of each query (context.order), in order by
    default. `window` > 0: each query sees the keys at positions > its own - window only (splash's local mask,
    whose key blocks outside the band are skipped like the causal mask's). With `sinks`, it returns the
    log-sum-exp beside the output (kernels/sinks.py folds the sinks in)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    shape = (seq_len, seq_len)
    mask = sa.LocalMask(shape, (window - 1, 0), 0) if window else sa.CausalMask(shape)
    if q_order is not None:
        mask.q_sequence = q_order  # the kernel compares each query's position, not its slot, with the key's
    return splash_kernel(mask, heads, q_len, seq_len, kernel, shards, save_residuals=sinks,
                         residuals_name=None if sinks else "attention_out", soft_cap=soft_cap)


def heads_first(x_bthd: jax.Array) -> jax.Array:
    """[b, t, heads, d] <-> [b, heads, t, d]: splash takes [heads, seq, head_dim] per row."""
    return x_bthd.transpose(0, 2, 1, 3)


def _run_splash(splash, q_btnh, k_bskh, v_bskh, q_segments_bt, k_segments_bs, sinks_n=None) -> jax.Array:
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    if sinks_n is not None:
        return heads_first(sinks_lib.splash_attention(splash, heads_first(q_btnh), heads_first(k_bskh),
                                                      heads_first(v_bskh), q_segments_bt, k_segments_bs, sinks_n))
    out_bnth = jax.vmap(lambda q, k, v, q_seg, k_seg: splash(q, k, v, sa.SegmentIds(q_seg, k_seg)))(
        heads_first(q_btnh), heads_first(k_bskh), heads_first(v_bskh), q_segments_bt, k_segments_bs)
    return heads_first(out_bnth)


def _splash(q_btnh, k_bskh, v_bskh, segment_ids_bt, kernel: Splash, window: int, soft_cap: float,
            sinks_n=None) -> jax.Array:
    t, n = q_btnh.shape[1:3]  # t: already padded to whole blocks
    splash = _make_splash(n, t, t, kernel, window=window, soft_cap=soft_cap, sinks=sinks_n is not None)
    return _run_splash(splash, q_btnh, k_bskh, v_bskh, segment_ids_bt, segment_ids_bt, sinks_n)


def split_splash(heads: int, q_order: np.ndarray, shards: int, kernel: Splash, window: int = 0,
                 soft_cap: float = 0.0, sinks: bool = False):
    """Context parallelism's splash: queries laid out in `q_order` (context.order) and split over `shards`
    devices, each against the whole sequence's keys and values. The kernel is a pytree whose block tables are
    split along the queries like them: shard_map hands each device its own (`.manual_sharding_spec`), so one
    traced kernel serves every shard, skipping the key blocks its queries' positions hide. Run it with
    `split_attention` (with `sinks`, its sinks given there). `window`, `soft_cap`: _make_splash's."""
    t = len(q_order)
    return _make_splash(heads, t, t // shards, kernel, q_order, shards, window, soft_cap, sinks)


def split_attention(splash, axes: tuple[str, ...], in_order: np.ndarray, q_btnh: jax.Array, k_btkh: jax.Array,
                    v_btkh: jax.Array, segments_bt: jax.Array, sinks_n: jax.Array | None = None) -> jax.Array:
    """One device's share of `split_splash`'s attention (inside shard_map over the sequence's mesh `axes`): its
    queries [b, t / shards, n, h] and segment ids against every key and value, all-gathered here from their shards
    [b, t / shards, kv, h] and put in sequence order (`in_order`: the laid-out slot of each position). Gathered
    inside the kernel's shard_map, their gradient stays on each device until the gather's transpose scatters it:
    a reduce-scatter (gathered outside, libtpu all-reduced the whole gradient, twice the bytes)."""
    k_bskh, v_bskh, k_segments_bs = (jnp.take(jax.lax.all_gather(x, axes, axis=1, tiled=True), in_order, axis=1)
                                     for x in (k_btkh, v_btkh, segments_bt))
    return _run_splash(splash, q_btnh, k_bskh, v_bskh, segments_bt.astype(jnp.int32), k_segments_bs.astype(jnp.int32),
                       sinks_n)


def _triton(q_btnh, k_bskh, v_bskh, segment_ids_bt, kernel: Triton, window: int, soft_cap: float,
            sinks_n=None) -> jax.Array:
    from jax.experimental.pallas.ops.gpu import attention

    # Its mask is causal and by segment only, its scores uncapped, and it returns no log-sum-exp to fold sinks
    # into (models/attention.py refuses all three first).
    assert not window and not soft_cap and sinks_n is None, "the Triton kernel takes no window, soft cap or sinks"

    n, kv = q_btnh.shape[2], k_bskh.shape[2]
    back = kernel.block_backward
    blocks = attention.BlockSizes(block_q=kernel.block_q, block_k=kernel.block_k, block_q_dkv=back,
                                  block_kv_dkv=back, block_q_dq=back, block_kv_dq=back)
    k_btnh, v_btnh = (jnp.repeat(x, n // kv, axis=2) for x in (k_bskh, v_bskh))
    return attention.mha(q_btnh, k_btnh, v_btnh, segment_ids_bt, sm_scale=1.0, causal=True, block_sizes=blocks,
                         interpret=kernel.interpret)


def flash_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, segment_ids_bt: jax.Array,
                    kernel: Splash | Triton | None = None, window: int = 0, soft_cap: float = 0.0,
                    sinks_n: jax.Array | None = None) -> jax.Array:
    """`reference`'s attention through a flash kernel (kernel_for() the first device by default). q [b, t, n,
    h] is already scaled; k, v [b, t, kv, h] with n a multiple of kv, query head i using key/value head
    i // (n / kv). `window` > 0: a sliding window of that many keys (the query's own included); `soft_cap` > 0:
    scores capped to cap * tanh(score / cap); `sinks_n`: a sink logit per query head (kernels/sinks.py) - splash
    only."""
    kernel = kernel or kernel_for(jax.devices()[0])
    t = q_btnh.shape[1]
    padded = round_up(t, _LANES if isinstance(kernel, Splash) else max(kernel.block_q, kernel.block_k))
    if padded != t:
        pad = lambda x: jnp.pad(x, [(0, 0), (0, padded - t)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
        q_btnh, k_bskh, v_bskh = pad(q_btnh), pad(k_bskh), pad(v_bskh)
        segment_ids_bt = jnp.pad(segment_ids_bt, [(0, 0), (0, padded - t)], constant_values=_PAD_SEGMENT)
    attend = _splash if isinstance(kernel, Splash) else _triton
    return attend(q_btnh, k_bskh, v_bskh, segment_ids_bt.astype(jnp.int32), kernel, window, soft_cap,
                  sinks_n)[:, :t]
