"""Parameter counts and training FLOPs of a Llama model: the numbers MFU, the planner and sweeps share.

Convention: a multiply-add is 2 FLOPs; training is 3x the forward pass (backward = 2x forward); causal
attention is counted as the useful half of the full T x T score and value matmuls; norms, softmax, RoPE
and the embedding lookup are not counted (well under 1% at Llama sizes). Remat recomputation is not useful
work and is not counted: MFU is model FLOPs utilisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from scaletrain import model as model_lib
from scaletrain.sharding import is_logical


@dataclass(frozen=True)
class ParamCount:
    embedding: int  # the input table, vocab x d_model
    attention: int  # per layer: Q, K, V, O
    mlp: int  # per layer: gate, up, down
    norms: int  # per layer: the RMSNorm gains (QK norms' too)
    num_layers: int
    final_norm: int
    lm_head: int  # 0 when tied to the embedding

    @property
    def per_layer(self) -> int:
        return self.attention + self.mlp + self.norms

    @property
    def total(self) -> int:
        return self.embedding + self.num_layers * self.per_layer + self.final_norm + self.lm_head

    @property
    def matmul(self) -> int:
        """Weights each token is multiplied with: every layer's projections and the output projection
        (the embedding table itself when tied)."""
        return self.num_layers * (self.attention + self.mlp) + (self.lm_head or self.embedding)


def param_count(model_cfg) -> ParamCount:
    """Counted from the model's own abstract parameters (model.abstract), so that any array the model has - QK
    norms, weightless norms' absence - is counted as built. Under `layers` (stacked, one row per layer): a
    parameter with one dim besides `layers` is a norm gain, the rest are the MLP's (under `mlp`) or attention's."""
    _, params, logical = model_lib.abstract(model_cfg)
    sizes = {"attention": 0, "mlp": 0, "norms": 0}
    layers = params.get("layers", {})
    flat = jax.tree_util.tree_flatten_with_path(layers)[0]
    for (path, x), names in zip(flat, jax.tree.leaves(logical.get("layers", {}), is_leaf=is_logical)):
        kind = ("norms" if len(names) == 2 else
                "mlp" if any(getattr(k, "key", None) == "mlp" for k in path) else "attention")
        sizes[kind] += x.size // x.shape[0]

    def size(name: str) -> int:
        return sum(x.size for x in jax.tree.leaves(params.get(name, {})))

    return ParamCount(embedding=size("embed"), **sizes, num_layers=model_cfg.num_layers,
                      final_norm=size("final_norm"), lm_head=size("lm_head"))


def attention_flops_per_token(m, seq_len: int) -> float:
    """Training FLOPs of causal attention scores and values per token: 3 * (4 T N H L) / 2."""
    return 6.0 * seq_len * m.num_heads * m.head_dim * m.num_layers


def flops_per_token(m, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul parameter, plus causal attention."""
    return 6.0 * param_count(m).matmul + attention_flops_per_token(m, seq_len)
