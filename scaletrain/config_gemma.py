"""Gemma's model keys (docs/gemma.md): RoPE per layer kind, (1 + w) norm gains, the scaled embedding, the query
scale, GeGLU, logit soft-capping. Checked here rather than in the model, so that checking a config never imports
Flax. Each is off by default, and any family's decoder reads them (the gemma family's block adds the norms after
attention and the MLP)."""

from __future__ import annotations

from scaletrain.config_window import sliding_layers
from scaletrain.errors import ConfigError

MLP_ACTIVATIONS = ("silu", "gelu_tanh")
# The keys, for what must refuse them where they are not off (tools/hf.py: an architecture without them).
KEYS = ("rope_local_theta", "norm_plus_one", "embed_scale", "query_pre_attn_scalar", "mlp_activation",
        "attn_logit_softcap", "final_logit_softcap")


def check(m) -> None:
    if m.mlp_activation not in MLP_ACTIVATIONS:
        raise ConfigError(f"model.mlp_activation must be one of {', '.join(MLP_ACTIVATIONS)}; got "
                          f"'{m.mlp_activation}'")
    if m.mlp_activation != "silu" and m.num_experts:
        raise ConfigError(f"model.mlp_activation={m.mlp_activation} with a mixture of experts: the experts compute "
                          f"SwiGLU; use model.mlp_activation=silu")
    for key in ("rope_local_theta", "query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
        if m[key] < 0:
            raise ConfigError(f"model.{key} must be >= 0 (0: off), got {m[key]}")
    if m.norm_plus_one and m.norm_weights != "standard":
        raise ConfigError(f"model.norm_plus_one=true with model.norm_weights={m.norm_weights}: a (1 + w) gain "
                          f"folded into the next weights would change what weight decay and the (1 + w) rounding "
                          f"act on; use model.norm_weights=standard")
    if m.rope_local_theta and not sliding_layers(m.layer_types, m.num_layers).any():
        raise ConfigError(f"model.rope_local_theta={m.rope_local_theta} is the sliding layers' RoPE base, but no "
                          f"layer slides (model.layer_types)")
