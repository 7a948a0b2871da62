"""Grouped-query causal self-attention with RoPE, restricted to each packed document (segment)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from scaletrain.errors import ConfigError
from scaletrain.kernels import flash_attention, ring_attention, ring_splash
from scaletrain.models import lora, quantize, rope, window
from scaletrain.models.layers import RMSNorm, added, param, project
from scaletrain.parallel import context, sharding
from scaletrain.parallel.sharding import active_device, constrain, local, placement, sequence_order, ways


def block_mask(q_segments_bt: jax.Array, k_segments_bs: jax.Array, q_index_t: jax.Array,
               k_index_s: jax.Array, cfg=None) -> jax.Array:
    """The mask for queries at sequence positions q_index against keys at k_index (within the sliding window
    of the layer being traced, where `cfg`'s layers have one: models/window.py)."""
    causal = q_index_t[:, None] >= k_index_s[None, :]
    if cfg is not None:
        causal = causal & window.visible(cfg, q_index_t, k_index_s)
    same_doc = q_segments_bt[:, :, None] == k_segments_bs[:, None, :]
    return (causal & same_doc)[:, None, None, :, :]


def dot_attention(q_btkgh, k_bskh, v_bskh, mask, soft_cap: float = 0.0, sinks_kg: jax.Array | None = None
                  ) -> jax.Array:
    """softmax(q k^T) v per kv group, with a float32 softmax; q is already scaled. `soft_cap` > 0: the scores
    capped to cap * tanh(score / cap) first (Gemma 2's model.attn_logit_softcap). `sinks_kg`: a logit per query
    head [kv, g] that joins each softmax's denominator as one more key without a value (model.attention_sinks)."""
    logits = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=jnp.float32)
    if soft_cap:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    if sinks_kg is None:
        probs = jax.nn.softmax(logits, axis=-1).astype(q_btkgh.dtype)
    else:
        sink = jnp.broadcast_to(sinks_kg.astype(jnp.float32)[None, :, :, None, None], (*logits.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1].astype(q_btkgh.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v_bskh)


def blocked_attention(q_btkgh, k_bskh, v_bskh, segment_ids_bt, block: int, unroll: bool = False, *,
                      k_segments_bs: jax.Array | None = None, index_t: jax.Array | None = None,
                      shards: int = 1, cfg=None, sinks_kg: jax.Array | None = None) -> jax.Array:
    """dot_attention one block of queries at a time, each block rematerialised in the backward pass, so the
    [t, s] score matrix never exists whole: memory O(block x s) instead of O(t x s), the same FLOPs. Queries and
    keys in the same slots, unless `k_segments_bs` (the keys' segment ids) and `index_t` (the sequence position
    of each query and key slot: context parallelism's layout) say otherwise. `shards`: the devices the queries
    are split over along the sequence (context parallelism); each step of the loop takes the next block of every
    shard, so each device works on its own queries (a loop over the blocks of the whole sequence would take them
    from one device at a time). `cfg`: the model's, for its sliding window (block_mask) and soft cap."""
    t = q_btkgh.shape[1]
    soft_cap = cfg.attn_logit_softcap if cfg is not None else 0.0
    k_segments_bs = segment_ids_bt if k_segments_bs is None else k_segments_bs
    index_t = jnp.arange(t) if index_t is None else index_t

    def blocks(x):
        return context.blocks(x, shards, block)

    @jax.checkpoint
    def one(args):
        q, seg, q_index = args
        return dot_attention(q, k_bskh, v_bskh, block_mask(seg, k_segments_bs, q_index, index_t, cfg), soft_cap,
                             sinks_kg)

    _, out = jax.lax.scan(lambda _, args: (None, one(args)), None,
                          (blocks(q_btkgh), blocks(segment_ids_bt), blocks(index_t[None])[:, 0]), unroll=unroll)
    return context.unblocks(out, shards)


def _whole_sequence(k_bskh: jax.Array, v_bskh: jax.Array, segment_ids_bs: jax.Array) -> tuple[jax.Array, ...]:
    """Keys, values and their segment ids split along the sequence (context parallelism), gathered whole on every
    device (only the key/value heads travel)."""
    kv = ("batch", None, "kv_heads", "head_dim")
    return constrain(k_bskh, kv), constrain(v_bskh, kv), constrain(segment_ids_bs, ("batch", None))


class Attention(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.quant = quantize.for_group(cfg, "attention")
        std, pd = cfg.init_std, cfg.param_dtype
        self.wq = param(rngs, (d, n, h), ("embed", "heads", "head_dim"), pd, std, self.quant)
        self.wk = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), pd, std, self.quant)
        self.wv = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), pd, std, self.quant)
        self.wo = param(rngs, (n, h, d), ("heads", "head_dim", "embed"), pd, cfg.out_std, self.quant)
        self.wq_lora = lora.adapter(cfg, "q_proj", (d, n, h), ("embed", "heads", "head_dim"), rngs)
        self.wk_lora = lora.adapter(cfg, "k_proj", (d, k, h), ("embed", "kv_heads", "head_dim"), rngs)
        self.wv_lora = lora.adapter(cfg, "v_proj", (d, k, h), ("embed", "kv_heads", "head_dim"), rngs)
        self.wo_lora = lora.adapter(cfg, "o_proj", (n, h, d), ("heads", "head_dim", "embed"), rngs, in_dims=2)
        for name, shape, logical, in_dims in (("wq", (d, n, h), ("embed", "heads", "head_dim"), 1),
                                              ("wk", (d, k, h), ("embed", "kv_heads", "head_dim"), 1),
                                              ("wv", (d, k, h), ("embed", "kv_heads", "head_dim"), 1),
                                              ("wo", (n, h, d), ("heads", "head_dim", "embed"), 2)):
            lora.base_scale(cfg, self, name, shape, logical, in_dims)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg.qk_norm_eps, pd, axis="head_dim", plus_one=cfg.norm_plus_one)
            self.k_norm = RMSNorm(h, cfg.qk_norm_eps, pd, axis="head_dim", plus_one=cfg.norm_plus_one)
        if cfg.attention_bias:
            for name, shape, logical in (("bq", (n, h), ("heads", "head_dim")),
                                         ("bk", (k, h), ("kv_heads", "head_dim")),
                                         ("bv", (k, h), ("kv_heads", "head_dim")), ("bo", (d,), ("embed",))):
                setattr(self, name, added(shape, logical, pd))
        if cfg.attention_sinks:
            self.sinks = added((n,), ("heads",), pd)

    def _sinks(self, groups: int | None = None) -> jax.Array | None:
        """The sink logits per query head [n] (None without model.attention_sinks); with `groups` (kv heads),
        [kv, n / kv] as the XLA paths group the heads."""
        if not self.cfg.attention_sinks:
            return None
        return self.sinks[...] if groups is None else self.sinks[...].reshape(groups, -1)

    def _project_qkv(self, x_btd: jax.Array, norm, one_matmul: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Q, K and V of norm(x) (`norm` an RMSNorm, applied by its `project`). Split over `tensor`, they are
        one matmul against [embed, kv_heads, q_per_kv + 2, head_dim] (kv-head major, so a tensor-parallel shard of
        kv heads holds whole groups): the backward pass then sums the three input gradients before they leave
        the device - one reduce-scatter instead of three. Otherwise three matmuls: slicing the joined output
        costs relayout copies the separate ones do not have (docs/parallelism.md). Three also serve kv heads
        replicated over `tensor` (fewer than its ways) and decoding (`one_matmul` False: no backward pass, and
        joining the weights would copy them at every token), and quantized matmuls (`self.quant`): the joined
        matmul's gradient would share one scale per row across Q, K and V, so its rounding would depend on the
        mesh."""
        n, k = self.cfg.num_heads, self.cfg.num_kv_heads
        if self.cfg.norm_cancellation:
            return self._project_qkv_cancelled(x_btd, norm)
        if not (self.cfg.fuse_qkv and one_matmul and ways("heads") > 1 and self.quant is None):
            query, key, value = norm.project_each(x_btd, ((self.wq[...], ("embed", "heads", "head_dim")),
                                                (self.wk[...], ("embed", "kv_heads", "head_dim")),
                                                (self.wv[...], ("embed", "kv_heads", "head_dim"))), quant=self.quant)
        else:
            d, _, h = self.wq.shape
            w_dkch = jnp.concatenate([self.wq[...].reshape(d, k, n // k, h), self.wk[...][:, :, None],
                                      self.wv[...][:, :, None]], axis=2)
            qkv_btkch = norm.project(x_btd, w_dkch, ("embed", "kv_heads", None, "head_dim"))
            b, t = x_btd.shape[:2]
            query, key, value = (qkv_btkch[:, :, :, : n // k].reshape(b, t, n, h), qkv_btkch[:, :, :, n // k],
                                 qkv_btkch[:, :, :, n // k + 1])
        query, key, value = self._adapted(x_btd, norm, (query, key, value))
        return (checkpoint_name(query, "query_proj"), checkpoint_name(key, "key_proj"),
                checkpoint_name(value, "value_proj"))

    def _adapted(self, x_btd: jax.Array, norm, qkv: tuple[jax.Array, ...], cancelled: bool = False):
        """Q, K and V with their adapters' outputs added (models/lora.py), from the input their projections
        took: norm(x), or for Q and K under norm cancellation x * g, unscaled by 1/rms(x) like them."""
        adapters = (self.wq_lora, self.wk_lora, self.wv_lora)
        if all(a is None for a in adapters):
            return qkv
        normed = norm(x_btd)
        inputs = (norm.scaled_input(x_btd),) * 2 + (normed,) if cancelled else (normed,) * 3
        return tuple(lora.delta(a, h, y) for a, h, y in zip(adapters, inputs, qkv))

    def _project_qkv_cancelled(self, x_btd: jax.Array, norm) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Norm cancellation (FlashNorm Proposition 3): Q and K are renormalised per head, and RMSNorm(c q) =
        RMSNorm(q) with eps = 0, so the input norm's row scale 1/rms(x) is dropped for them - computed once,
        for V only. (config.validate admits this only with qk norms of eps 0.)"""
        q = norm.project_unscaled(x_btd, self.wq[...], self.quant).astype(x_btd.dtype)
        k = norm.project_unscaled(x_btd, self.wk[...], self.quant).astype(x_btd.dtype)
        v = (norm.project_unscaled(x_btd, self.wv[...], self.quant) * norm.row_scale(x_btd, 2)).astype(x_btd.dtype)
        q, k, v = self._adapted(x_btd, norm, (q, k, v), cancelled=True)
        return checkpoint_name(q, "query_proj"), checkpoint_name(k, "key_proj"), checkpoint_name(v, "value_proj")

    def _queries_keys_values(self, x_btd: jax.Array, norm, sin_bth: jax.Array, cos_bth: jax.Array,
                             one_matmul: bool = True):
        """Q (scaled by ModelConfig.softmax_scale: head_dim**-0.5 or model.query_pre_attn_scalar**-0.5, or YaRN's),
        K and V of norm(x), Q and K rotated by RoPE (the layer kind's: models/window.py): the input norm is applied
        with the projection (model.norm)."""
        cfg = self.cfg
        q_btnh, k_btkh, v_btkh = self._project_qkv(x_btd, norm, one_matmul)
        if cfg.attention_bias:
            q_btnh, k_btkh, v_btkh = (x + b[...].astype(x.dtype) for x, b in ((q_btnh, self.bq), (k_btkh, self.bk),
                                                                              (v_btkh, self.bv)))
        if cfg.qk_norm:
            q_btnh, k_btkh = self.q_norm(q_btnh), self.k_norm(k_btkh)
        sin_bth, cos_bth = window.layer_rope(cfg, sin_bth, cos_bth)
        q_btnh = constrain(rope.apply(q_btnh, sin_bth, cos_bth), ("batch", "seq", "heads", "head_dim"))
        k_btkh = constrain(rope.apply(k_btkh, sin_bth, cos_bth), ("batch", "seq", "kv_heads", "head_dim"))
        v_btkh = constrain(v_btkh, ("batch", "seq", "kv_heads", "head_dim"))
        return q_btnh * jnp.asarray(cfg.softmax_scale, x_btd.dtype), k_btkh, v_btkh

    def _out(self, out_btnh: jax.Array) -> jax.Array:
        out_btd = lora.delta(self.wo_lora, out_btnh, project(out_btnh, self.wo[...], in_dims=2, quant=self.quant))
        if self.cfg.attention_bias:
            out_btd = out_btd + self.bo[...].astype(out_btd.dtype)
        return checkpoint_name(constrain(out_btd, ("batch", "residual_seq", "embed")), "out_proj")

    def __call__(self, x_btd: jax.Array, norm, sin_bth: jax.Array, cos_bth: jax.Array,
                 segment_ids_bt: jax.Array) -> jax.Array:
        """Attention over norm(x) within each document."""
        cfg = self.cfg
        q_btnh, k_btkh, v_btkh = self._queries_keys_values(x_btd, norm, sin_bth, cos_bth)
        b, t, n, h = q_btnh.shape
        k = cfg.num_kv_heads
        order = sequence_order(t)
        if ways("seq") > 1 and cfg.context_attention == "ring":
            out_btnh = checkpoint_name(self._ring(q_btnh, k_btkh, v_btkh, segment_ids_bt), "attention_out")
        elif cfg.attention == "flash":
            out_btnh = self._flash(q_btnh, k_btkh, v_btkh, segment_ids_bt, order)
        else:
            q_btkgh = q_btnh.reshape(b, t, k, n // k, h)
            # Split along the sequence, the queries stay where they are and meet every key, in the layout's order.
            k_btkh, v_btkh, k_segments_bt = _whole_sequence(k_btkh, v_btkh, segment_ids_bt) if order is not None \
                else (k_btkh, v_btkh, segment_ids_bt)
            index_t = jnp.arange(t) if order is None else jnp.asarray(order)
            block = cfg.attention_block
            if 0 < block < t and t % block == 0:
                out_btkgh = blocked_attention(q_btkgh, k_btkh, v_btkh, segment_ids_bt, block, cfg.unroll_loops,
                                              k_segments_bs=k_segments_bt, index_t=index_t, shards=ways("seq"),
                                              cfg=cfg, sinks_kg=self._sinks(k))
            else:
                out_btkgh = dot_attention(q_btkgh, k_btkh, v_btkh,
                                          block_mask(segment_ids_bt, k_segments_bt, index_t, index_t, cfg),
                                          cfg.attn_logit_softcap, self._sinks(k))
            out_btnh = checkpoint_name(out_btkgh.reshape(b, t, n, -1), "attention_out")  # V's head size
        return self._out(out_btnh)

    def decode(self, x_btd: jax.Array, norm, sin_bth: jax.Array, cos_bth: jax.Array, start: jax.Array,
               cache_bskh: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Attention of the t positions [start, start + t) of one sequence per row, over the keys and values
        cached for the positions before them (the KV cache, [b, max_len, kv_heads, head_dim] each). Returns the
        output and the cache with these positions' keys and values written in."""
        q_btnh, k_btkh, v_btkh = self._queries_keys_values(x_btd, norm, sin_bth, cos_bth, one_matmul=False)
        k_cache, v_cache = (jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), start, axis=1)
                            for c, new in zip(cache_bskh, (k_btkh, v_btkh)))
        b, t, n, h = q_btnh.shape
        k = self.cfg.num_kv_heads
        # Cache slots past the newest position hold zeros, or nothing yet: causality masks them.
        q_index, k_index = start + jnp.arange(t), jnp.arange(k_cache.shape[1])
        causal = (q_index[:, None] >= k_index[None, :]) & window.visible(self.cfg, q_index, k_index)
        out_btkgh = dot_attention(q_btnh.reshape(b, t, k, n // k, h), k_cache, v_cache, causal[None, None, None],
                                  self.cfg.attn_logit_softcap, self._sinks(k))
        return self._out(out_btkgh.reshape(b, t, n, -1)), (k_cache, v_cache)

    def _kv_beside_queries(self, k_btkh, v_btkh) -> tuple[jax.Array, jax.Array, str]:
        """K and V for code run per device on its query heads (`local`), and the logical axis of their heads:
        where the key/value heads are not split like the query heads (fewer of them than `tensor` ways), each
        device's query heads get copies of the K/V heads they use."""
        if ways("kv_heads") == ways("heads"):
            return k_btkh, v_btkh, "kv_heads"
        g = self.cfg.num_heads // self.cfg.num_kv_heads
        k_btkh, v_btkh = (constrain(jnp.repeat(x, g, axis=2), ("batch", "seq", "heads", "head_dim"))
                          for x in (k_btkh, v_btkh))
        return k_btkh, v_btkh, "heads"

    def _ring(self, q_btnh, k_btkh, v_btkh, segment_ids_bt) -> jax.Array:
        """Context parallelism's ring schedule (kernels/ring_attention.py): each device's queries meet the keys
        and values passed around the context axes, one shard at a time; each pass's work XLA's
        (`attention_block` queries per tile) or, with model.attention=flash, the splash kernel's
        (kernels/ring_splash.py)."""
        t = q_btnh.shape[1]
        k_btkh, v_btkh, kv_heads = self._kv_beside_queries(k_btkh, v_btkh)
        q_logical, kv_logical = ("batch", "seq", "heads", "head_dim"), ("batch", "seq", kv_heads, "head_dim")
        # The sinks (None without them: an empty argument) split over the devices like the query heads.
        logical = (q_logical, kv_logical, kv_logical, ("batch", "seq"), ("heads",))
        axes, shards, sinks_n = sharding.active_axes("seq"), ways("seq"), self._sinks()
        if self.cfg.attention == "flash":
            kernel = flash_attention.kernel_for(active_device())
            if not isinstance(kernel, flash_attention.Splash):
                raise ConfigError("model.context_attention=ring with model.attention=flash runs splash attention "
                                  "(TPU, or interpreted on CPU); on a GPU set model.attention=xla")
            kernels = ring_splash.pass_kernels(q_btnh.shape[2] // ways("heads"), t, shards,
                                               sharding.sequence_layout(), kernel)
            specs = [k.manual_sharding_spec(placement((None, "seq"))) for k in kernels]
            return local(lambda kernels, q, k, v, seg, sinks: ring_splash.ring_splash_attention(
                kernels, q, k, v, seg, axes, sinks),
                (specs, *logical), q_logical)(kernels, q_btnh, k_btkh, v_btkh, segment_ids_bt, sinks_n)
        order = sequence_order(t)
        order_ct = (np.arange(t, dtype=np.int32) if order is None else order).reshape(shards, -1)
        block = self.cfg.attention_block

        slides = window.sliding(self.cfg)  # a traced kind enters the per-device code as an argument

        def attend(q_btnh, k_btkh, v_btkh, segments_bt, sinks_n, slides):
            b, tl, n, h = q_btnh.shape
            q_btkgh = q_btnh.reshape(b, tl, k_btkh.shape[2], -1, h)
            out = ring_attention.ring_attention(q_btkgh, k_btkh, v_btkh, segments_bt, segments_bt, order_ct, axes,
                                                block, self.cfg.unroll_loops,
                                                None if sinks_n is None else sinks_n.reshape(q_btkgh.shape[2:4]),
                                                self.cfg.sliding_window, slides)
            return out.reshape(q_btnh.shape)

        if isinstance(slides, bool):
            return local(lambda *a: attend(*a, slides), logical, q_logical)(q_btnh, k_btkh, v_btkh, segment_ids_bt,
                                                                            sinks_n)
        return local(attend, (*logical, ()), q_logical)(q_btnh, k_btkh, v_btkh, segment_ids_bt, sinks_n, slides)

    def _flash(self, q_btnh, k_btkh, v_btkh, segment_ids_bt, order) -> jax.Array:
        """The flash kernel per device on its batch rows and heads (kernels/flash_attention.py). The kernel
        names its own residuals attention_out. Split along the sequence (`order`: context parallelism's layout),
        each device's queries meet the whole sequence's keys and values, gathered by the kernel's own shard_map
        (flash_attention.split_attention) and put back in sequence order for the kernel's causal mask. A kernel's
        mask is static: in a stack that mixes sliding and full layers, each layer runs one of two kernels, chosen
        by its kind (models/window.py)."""
        kernel = flash_attention.kernel_for(active_device())
        slides = window.sliding(self.cfg)
        # What only splash takes: the GPU's Triton kernel has no window, no soft cap and no log-sum-exp to fold
        # sinks in with.
        splash_only = [key for key, on in (("model.sliding_window", slides is not False),
                                           ("model.attn_logit_softcap", self.cfg.attn_logit_softcap),
                                           ("model.attention_sinks", self.cfg.attention_sinks)) if on]
        if splash_only and not isinstance(kernel, flash_attention.Splash):
            raise ConfigError(f"{', '.join(splash_only)} with model.attention=flash runs splash attention (TPU, or "
                              f"interpreted on CPU); the GPU's Triton kernel takes none of them: set "
                              f"model.attention=xla")

        def run(window_size: int) -> jax.Array:
            return self._flash_kernel(kernel, window_size, q_btnh, k_btkh, v_btkh, segment_ids_bt, order)

        if isinstance(slides, bool):
            return run(self.cfg.sliding_window if slides else 0)
        return jax.lax.cond(slides, lambda: run(self.cfg.sliding_window), lambda: run(0))

    def _flash_kernel(self, kernel, window_size: int, q_btnh, k_btkh, v_btkh, segment_ids_bt, order) -> jax.Array:
        """`_flash` with one kernel: a sliding window of `window_size` keys, or none (0)."""
        k_btkh, v_btkh, kv_heads = self._kv_beside_queries(k_btkh, v_btkh)
        kv_logical = ("batch", "seq", kv_heads, "head_dim")
        q_logical = ("batch", "seq", "heads", "head_dim")
        sinks_n = self._sinks()  # None without them: an empty argument of the shard_maps below
        if ways("seq") == 1:
            return local(lambda q, k, v, seg, sinks: flash_attention.flash_attention(
                q, k, v, seg, kernel, window_size, self.cfg.attn_logit_softcap, sinks_n=sinks),
                (q_logical, kv_logical, kv_logical, ("batch", "seq"), ("heads",)), q_logical)(
                q_btnh, k_btkh, v_btkh, segment_ids_bt, sinks_n)
        if not isinstance(kernel, flash_attention.Splash):
            raise ConfigError("context parallelism (mesh.context > 1) with model.attention=flash runs splash "
                              "attention (TPU, or interpreted on CPU); on a GPU set model.attention=xla")
        if order is None:  # the contiguous layout: each device's slots are in sequence order
            order = np.arange(q_btnh.shape[1], dtype=np.int32)
        splash = flash_attention.split_splash(q_btnh.shape[2] // ways("heads"), order, ways("seq"), kernel,
                                              window_size, self.cfg.attn_logit_softcap, sinks=sinks_n is not None)
        kernel_spec = splash.manual_sharding_spec(placement((None, "seq")))
        axes, in_order = sharding.active_axes("seq"), np.argsort(order)
        return local(lambda splash, *qkv: flash_attention.split_attention(splash, axes, in_order, *qkv),
                     (kernel_spec, q_logical, kv_logical, kv_logical, ("batch", "seq"), ("heads",)), q_logical)(
            splash, q_btnh, k_btkh, v_btkh, segment_ids_bt, sinks_n)
