"""The config checks of GPT-OSS's pieces (docs/gpt-oss.md): attention sinks, biases on the attention projections,
the router and the experts, and the experts' clamped SwiGLU. Each is a model.* key of its own, off by default;
config.validate calls `check`."""

from __future__ import annotations

import ml_collections

from scaletrain.errors import ConfigError

# model.expert_activation: the experts' gated unit. swiglu: silu(gate) * up; clamped_swiglu: GPT-OSS's
# (up + 1) * gate * sigmoid(alpha * gate), gate clamped above at the limit and up to [-limit, limit].
EXPERT_ACTIVATIONS = ("swiglu", "clamped_swiglu")
# The keys' choices and bounds, which config.validate checks with the rest of the schema's.
CHOICES = {"model.expert_activation": EXPERT_ACTIVATIONS}
POSITIVE = ("model.swiglu_limit", "model.swiglu_alpha")
# The keys that only a mixture of experts reads.
_EXPERT_KEYS = ("router_logit_bias", "expert_bias")
# The model section's keys of GPT-OSS's pieces and their defaults (config.defaults() takes them): all off.
DEFAULTS = {"attention_sinks": False, "attention_bias": False, "router_logit_bias": False, "expert_bias": False,
            "expert_activation": "swiglu", "swiglu_limit": 7.0, "swiglu_alpha": 1.702}


def check(m: ml_collections.ConfigDict) -> None:
    """ConfigError for a value or a combination the model cannot compute."""
    if not m.num_experts:
        for key in _EXPERT_KEYS:
            if m[key]:
                raise ConfigError(f"model.{key}=true needs a mixture of experts (model.num_experts > 0)")
        if m.expert_activation != "swiglu":
            raise ConfigError(f"model.expert_activation={m.expert_activation} needs a mixture of experts "
                              f"(model.num_experts > 0)")
    if m.attention_bias and m.norm_cancellation:
        raise ConfigError("model.attention_bias=true with model.norm_cancellation=true: a bias added to Q and K "
                          "breaks the cancellation of the input norm's 1/rms (their projections skip it)")
