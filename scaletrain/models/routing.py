"""How a mixture of experts' router picks each token's experts and weighs them (model.router_*): softmax or
sigmoid scores, an optional per-expert bias that moves the selection only (DeepSeek-V3's aux-loss-free
balancing), group-limited top-k, renormalisation and a scale. The default - softmax, no groups, no bias,
renormalised, scale 1 - is Mixtral's routing, computed as it always was."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# The logical axis of the router's selection bias (model.router_correction_bias): replicated, never weight-decayed
# (optim.decay_mask), moved only by the decoder's after_update (models/deepseek: aux-loss-free balancing).
ROUTER_BIAS = "router_bias"


@dataclasses.dataclass(frozen=True)
class Routing:
    score: str = "softmax"  # softmax | sigmoid
    groups: int = 1  # experts in this many equal groups
    topk_groups: int = 1  # a token picks its experts from its best groups (each scored by its top 2)
    scale: float = 1.0  # the routed experts' weights multiplied by this
    norm_topk: bool = True  # the k weights divided by their sum

    @classmethod
    def of(cls, cfg) -> "Routing":
        return cls(cfg.router_score, cfg.router_groups, cfg.router_topk_groups, cfg.router_scale,
                   cfg.router_norm_topk)

    def select(self, logits_te: jax.Array, k: int, bias_e: jax.Array | None = None):
        """(expert ids [T, k], their weights [T, k], each token's scores as a distribution over the experts [T, E]
        - for the load-balancing statistics), in float32. `bias_e` is added to the scores to choose the experts,
        never to their weights, and no gradient flows into it."""
        scores = jax.nn.softmax(logits_te, axis=-1) if self.score == "softmax" else jax.nn.sigmoid(logits_te)
        choice = scores if bias_e is None else scores + jax.lax.stop_gradient(bias_e.astype(jnp.float32))
        if self.groups > 1:
            t, e = choice.shape
            grouped = choice.reshape(t, self.groups, e // self.groups)
            group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
            _, best = jax.lax.top_k(group_scores, self.topk_groups)
            keep = jnp.any(best[:, :, None] == jnp.arange(self.groups)[None, None], axis=1)  # [T, groups]
            choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(t, e)
        if bias_e is None and self.groups == 1:
            top_w, top_e = jax.lax.top_k(scores, k)
        else:
            top_e = jax.lax.top_k(choice, k)[1]
            top_w = jnp.take_along_axis(scores, top_e, axis=-1)
        if self.norm_topk:
            # sigmoid scores as transformers' DeepSeek-V3 divides them (its epsilon against an all-zero sum)
            top_w = top_w / (jnp.sum(top_w, axis=-1, keepdims=True) + (1e-20 if self.score == "sigmoid" else 0.0))
        if self.scale != 1.0:
            top_w = top_w * self.scale
        probs = scores if self.score == "softmax" else scores / jnp.sum(scores, axis=-1, keepdims=True)
        return top_e, top_w, probs


# Mixtral's routing: the default.
SOFTMAX = Routing()
