"""Gemma's model keys (docs/gemma.md): RoPE per layer kind, (1 + w) norm gains, the scaled embedding, the query
scale, GeGLU, logit soft-capping. Checked here rather than in the model, so that checking a config never imports
Flax. Each is off by default, and any family's decoder reads them (the gemma family's block adds the norms after
attention and the MLP)."""

from __future__ import annotations

from scaletrain import config_window
from scaletrain.errors import ConfigError

MLP_ACTIVATIONS = ("silu", "gelu_tanh")
# The model keys and their defaults (config.defaults()'s model section): every piece off.
DEFAULTS = {"rope_local_theta": 0.0, "norm_plus_one": False, "embed_scale": False, "query_pre_attn_scalar": 0,
            "mlp_activation": "silu", "attn_logit_softcap": 0.0, "final_logit_softcap": 0.0}
KEYS = tuple(DEFAULTS)  # for what must refuse them where they are not off (tools/hf.py)


def check(m) -> None:
    """The sliding-window keys (config_window.check), which RoPE per layer kind builds on, then Gemma's."""
    config_window.check(m)
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
    if m.rope_local_theta and not config_window.sliding_layers(m.layer_types, m.num_layers).any():
        raise ConfigError(f"model.rope_local_theta={m.rope_local_theta} is the sliding layers' RoPE base, but no "
                          f"layer slides (model.layer_types)")
