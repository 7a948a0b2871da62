"""Multi-head latent attention (DeepSeek-V2/V3; model.kv_lora_rank > 0). Keys and values come from one shared
latent per token: c_kv = RMSNorm(x W_kv_a) (kv_lora_rank wide), expanded per head by W_kv_b into the keys' no-RoPE
part and the values (v_head_dim, unlike the keys' head_dim). The keys' RoPE part (rope_head_dim of head_dim) is
projected from x beside the latent and shared by every head. Queries are projected directly, or through their
own latent (q_lora_rank > 0): q = RMSNorm(x W_q_a) W_q_b. Each query/key head is [no-RoPE dims, RoPE dims].

Training expands K and V per head and runs the skeleton's attention on them (as MaxText does): XLA's attention
takes values of another width than the keys as they are; the flash kernels, which need one head size, get V
padded with zeros to head_dim and the padding cut from their output. Decoding caches the expanded K and V.

RoPE is the split-half rotation the rest of scaletrain uses; Hugging Face's interleaved pairs
(model.rope_interleave) are a permutation of the RoPE dims' weights at import and export (models/deepseek/hf.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from scaletrain.models import quantize, rope
from scaletrain.models.attention import Attention
from scaletrain.models.layers import RMSNorm, param, project
from scaletrain.parallel.sharding import constrain

# The latents' RMSNorm epsilon: DeepSeek's (transformers' DeepseekV3RMSNorm default; not its config's rms_norm_eps).
LATENT_NORM_EPS = 1e-6
QKV = ("batch", "seq", "heads", "head_dim")
KV = ("batch", "seq", "kv_heads", "head_dim")


class LatentAttention(Attention):
    def __init__(self, cfg, rngs: nnx.Rngs):
        d, n, h, pd, std = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.param_dtype, cfg.init_std
        nope, vh = h - cfg.rope_head_dim, cfg.v_head_dim or h
        self.cfg = cfg
        self.quant = quantize.for_group(cfg, "attention")
        if cfg.q_lora_rank:
            self.wq_a = param(rngs, (d, cfg.q_lora_rank), ("embed", "latent"), pd, std, self.quant)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, pd, axis="latent")
            self.wq_b = param(rngs, (cfg.q_lora_rank, n, h), ("latent_in", "heads", "head_dim"), pd, std, self.quant)
        else:
            self.wq = param(rngs, (d, n, h), ("embed", "heads", "head_dim"), pd, std, self.quant)
        # the latent and the shared RoPE key, one matmul: [kv_lora_rank | rope_head_dim] columns
        self.wkv_a = param(rngs, (d, cfg.kv_lora_rank + cfg.rope_head_dim), ("embed", "latent"), pd, std, self.quant)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, pd, axis="latent")
        self.wkv_b = param(rngs, (cfg.kv_lora_rank, n, nope + vh), ("latent_in", "heads", "head_dim"), pd, std,
                           self.quant)
        self.wo = param(rngs, (n, vh, d), ("heads", "head_dim", "embed"), pd, cfg.out_std, self.quant)
        self.wo_lora = None

    def _queries_keys_values(self, x_btd: jax.Array, norm, sin_bth: jax.Array, cos_bth: jax.Array,
                             one_matmul: bool = True):
        """Q (scaled: ModelConfig.softmax_scale), K [b, t, heads, head_dim] and V [b, t, heads, v_head_dim] of
        norm(x); the input norm is applied with the projections from x (model.norm)."""
        cfg = self.cfg
        rkv, nope = cfg.kv_lora_rank, cfg.head_dim - cfg.rope_head_dim
        first = self.wq_a if cfg.q_lora_rank else self.wq
        q_first, kv_a = norm.project_each(x_btd, ((first[...], ("embed", *first.out_sharding[1:])),
                                                  (self.wkv_a[...], ("embed", "latent"))), quant=self.quant)
        q_btnh = project(self.q_a_norm(q_first), self.wq_b[...], quant=self.quant) if cfg.q_lora_rank else q_first
        kv_btnc = project(self.kv_a_norm(kv_a[..., :rkv]), self.wkv_b[...], quant=self.quant)
        q_rope = rope.apply(q_btnh[..., nope:], sin_bth, cos_bth)
        k_rope = rope.apply(kv_a[..., None, rkv:], sin_bth, cos_bth)  # one head, shared by all
        b, t, n, _ = q_btnh.shape
        q_btnh = constrain(jnp.concatenate([q_btnh[..., :nope], q_rope], axis=-1), QKV)
        k_btkh = jnp.concatenate([kv_btnc[..., :nope], jnp.broadcast_to(k_rope, (b, t, n, cfg.rope_head_dim))],
                                 axis=-1)
        k_btkh, v_btkh = constrain(k_btkh, KV), constrain(kv_btnc[..., nope:], KV)
        q_btnh, k_btkh, v_btkh = (checkpoint_name(q_btnh, "query_proj"), checkpoint_name(k_btkh, "key_proj"),
                                  checkpoint_name(v_btkh, "value_proj"))
        return q_btnh * jnp.asarray(cfg.softmax_scale, x_btd.dtype), k_btkh, v_btkh

    def _flash(self, q_btnh, k_btkh, v_btkh, segment_ids_bt, order) -> jax.Array:
        """The flash kernel with V padded to the keys' head size, the padding cut from its output."""
        vh = v_btkh.shape[-1]
        v_btkh = jnp.pad(v_btkh, [(0, 0)] * 3 + [(0, q_btnh.shape[-1] - vh)])
        return super()._flash(q_btnh, k_btkh, v_btkh, segment_ids_bt, order)[..., :vh]
