"""Parameter counts and training FLOPs of a Llama model: the numbers MFU, the planner and sweeps share.

Convention: a multiply-add is 2 FLOPs; training is 3x the forward pass (backward = 2x forward); causal
attention is counted as the useful half of the full T x T score and value matmuls; norms, softmax, RoPE
and the embedding lookup are not counted (well under 1% at Llama sizes). Remat recomputation is not useful
work and is not counted: MFU is model FLOPs utilisation.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParamCount:
    embedding: int  # the input table, vocab x d_model
    attention: int  # per layer: Q, K, V, O
    mlp: int  # per layer: gate, up, down
    norms: int  # per layer: two RMSNorm gains
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


def param_count(m) -> ParamCount:
    """`m` has the fields of model.ModelConfig (d_model, d_ff, num_layers, num_heads, num_kv_heads, head_dim,
    vocab_size, tie_embeddings)."""
    d = m.d_model
    table = m.vocab_size * d
    return ParamCount(embedding=table, attention=2 * d * (m.num_heads + m.num_kv_heads) * m.head_dim,
                      mlp=3 * d * m.d_ff, norms=2 * d, num_layers=m.num_layers, final_norm=d,
                      lm_head=0 if m.tie_embeddings else table)


def attention_flops_per_token(m, seq_len: int) -> float:
    """Training FLOPs of causal attention scores and values per token: 3 * (4 T N H L) / 2."""
    return 6.0 * seq_len * m.num_heads * m.head_dim * m.num_layers


def flops_per_token(m, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul parameter, plus causal attention."""
    return 6.0 * param_count(m).matmul + attention_flops_per_token(m, seq_len)
