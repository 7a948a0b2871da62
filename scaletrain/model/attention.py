"""Grouped-query causal self-attention with RoPE, restricted to each packed document (segment)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from scaletrain.model import rope
from scaletrain.model.layers import param, project
from scaletrain.sharding import constrain


def attention_mask(segment_ids_bt: jax.Array) -> jax.Array:
    """[b, 1, 1, t, s]: query t sees key s iff s <= t and both lie in the same document."""
    t = segment_ids_bt.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    same_doc = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
    return (causal & same_doc)[:, None, None, :, :]


class Attention(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        std, pd = cfg.init_std, cfg.param_dtype
        self.wq = param(rngs, (d, n, h), ("embed", "heads", "head_dim"), pd, std)
        self.wk = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), pd, std)
        self.wv = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), pd, std)
        self.wo = param(rngs, (n, h, d), ("heads", "head_dim", "embed"), pd, cfg.out_std)

    def __call__(self, x_btd: jax.Array, sin_bth: jax.Array, cos_bth: jax.Array, mask: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, x_btd.dtype
        q_btnh = checkpoint_name(project(x_btd, self.wq[...]), "query_proj")
        k_btkh = checkpoint_name(project(x_btd, self.wk[...]), "key_proj")
        v_btkh = checkpoint_name(project(x_btd, self.wv[...]), "value_proj")
        q_btnh = constrain(rope.apply(q_btnh, sin_bth, cos_bth), ("batch", "seq", "heads", "head_dim"))
        k_btkh = constrain(rope.apply(k_btkh, sin_bth, cos_bth), ("batch", "seq", "kv_heads", "head_dim"))
        v_btkh = constrain(v_btkh, ("batch", "seq", "kv_heads", "head_dim"))

        b, t, n, h = q_btnh.shape
        k = cfg.num_kv_heads
        q_btkgh = q_btnh.reshape(b, t, k, n // k, h) * jnp.asarray(h ** -0.5, dt)
        logits = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_btkh, preferred_element_type=jnp.float32)
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(dt)
        out_btkgh = jnp.einsum("bkgts,bskh->btkgh", probs, v_btkh)
        out_btnh = checkpoint_name(out_btkgh.reshape(b, t, n, h), "attention_out")
        out_btd = project(out_btnh, self.wo[...], in_dims=2)
        return checkpoint_name(constrain(out_btd, ("batch", "seq", "embed")), "out_proj")
