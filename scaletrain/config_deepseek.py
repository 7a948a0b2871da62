"""The config checks of DeepSeek-V3's model keys (docs/deepseek.md): multi-head latent attention
(model.kv_lora_rank > 0), dense first layers, the router's scores, groups and selection bias, shared experts. Each
key is off by default, so these checks pass every other config as it is."""

from __future__ import annotations

import ml_collections

from scaletrain.errors import ConfigError

# The model keys and their defaults (config.defaults()'s model section), every piece off. YaRN RoPE (rope_scaling:
# yarn): the ramp's bounds, truncation, attention magnitude (GPT-OSS's too).
DEFAULTS = {
    "rope_beta_fast": 32.0,
    "rope_beta_slow": 1.0,
    "rope_truncate": True,
    "rope_mscale": 0.0,
    "rope_mscale_all_dim": 0.0,
    "rope_attention_factor": 0.0,
    "rope_softmax_mscale": False,
    # DeepSeek-V3: latent attention, dense first layers, routing, shared experts
    "q_lora_rank": 0,
    "kv_lora_rank": 0,
    "rope_head_dim": 0,
    "v_head_dim": 0,
    "rope_interleave": False,
    "first_dense_layers": 0,
    "router_score": "softmax",
    "router_groups": 1,
    "router_topk_groups": 1,
    "router_scale": 1.0,
    "router_norm_topk": True,
    "router_correction_bias": False,
    "router_bias_update_rate": 0.0,
    "shared_experts": 0,
    # multi-token prediction (models/mtp.py): modules after the stack, each predicting one token further ahead
    "mtp_depth": 0,
    "mtp_loss_weight": 0.1,
}


# The keys' choices and bounds, which config.validate checks with the rest of the schema's.
CHOICES = {"model.router_score": ("softmax", "sigmoid")}
POSITIVE = ("model.router_groups", "model.router_topk_groups", "model.router_scale")
NON_NEGATIVE = tuple(f"model.{key}" for key in (
    "rope_mscale", "rope_mscale_all_dim", "rope_attention_factor", "q_lora_rank", "kv_lora_rank", "rope_head_dim",
    "v_head_dim", "first_dense_layers", "router_bias_update_rate", "shared_experts", "mtp_depth", "mtp_loss_weight"))


def check(m: ml_collections.ConfigDict) -> None:
    if m.rope_scaling == "yarn" and not 0 < m.rope_beta_slow <= m.rope_beta_fast:
        raise ConfigError(f"model.rope_beta_fast={m.rope_beta_fast} must be >= model.rope_beta_slow="
                          f"{m.rope_beta_slow} > 0 (rotations over the original context that bound YaRN's ramp)")
    _check_latent_attention(m)
    _check_routing(m)


def check_run(cfg: ml_collections.ConfigDict) -> None:
    """What multi-token prediction (model.mtp_depth > 0) needs of the rest of the run."""
    m = cfg.model
    if not m.mtp_depth:
        return
    if m.family != "deepseek":
        raise ConfigError(f"model.mtp_depth={m.mtp_depth}: multi-token prediction is built for model.family=deepseek "
                          f"(DeepSeek-V3's modules and checkpoint layer), got {m.family}")
    if m.mtp_loss_weight <= 0:
        raise ConfigError(f"model.mtp_depth={m.mtp_depth} with model.mtp_loss_weight={m.mtp_loss_weight}: the modules "
                          f"would learn nothing; set a weight > 0 (DeepSeek-V3: 0.3, then 0.1) or model.mtp_depth=0")
    if cfg.train.objective != "lm":
        raise ConfigError(f"model.mtp_depth={m.mtp_depth} with train.objective={cfg.train.objective}: multi-token "
                          f"prediction adds to the next-token loss only; set model.mtp_depth=0")
    if cfg.lora.rank:
        raise ConfigError(f"model.mtp_depth={m.mtp_depth} with lora.rank={cfg.lora.rank}: LoRA trains without the "
                          f"multi-token prediction modules; set model.mtp_depth=0")


def _check_latent_attention(m: ml_collections.ConfigDict) -> None:
    if m.family == "deepseek" and not m.kv_lora_rank:
        raise ConfigError("model.family=deepseek attends through latents: set model.kv_lora_rank > 0 (and "
                          "model.rope_head_dim)")
    if not m.kv_lora_rank:
        for key in ("q_lora_rank", "rope_head_dim", "v_head_dim"):
            if m[key]:
                raise ConfigError(f"model.{key}={m[key]} is a latent attention key: it needs model.kv_lora_rank > 0")
        if m.rope_interleave:
            raise ConfigError("model.rope_interleave=true is a latent attention key: it needs model.kv_lora_rank > 0")
        return
    if not 0 < m.rope_head_dim < m.head_dim or m.rope_head_dim % 2:
        raise ConfigError(f"model.rope_head_dim={m.rope_head_dim} must be even, > 0 and < model.head_dim="
                          f"{m.head_dim}: with latent attention RoPE rotates that many of each query/key head's dims")
    if m.num_kv_heads != m.num_heads:
        raise ConfigError(f"model.kv_lora_rank={m.kv_lora_rank} (latent attention) expands keys and values for every "
                          f"head: model.num_kv_heads={m.num_kv_heads} must equal model.num_heads={m.num_heads}")
    if m.norm_weights != "standard":
        raise ConfigError(f"model.norm_weights={m.norm_weights} with latent attention (model.kv_lora_rank > 0): "
                          f"its latents' projections are not folded; use standard")
    if m.qk_norm or m.norm_cancellation:
        raise ConfigError("model.qk_norm / model.norm_cancellation do not apply to latent attention "
                          "(model.kv_lora_rank > 0), which normalises its latents instead")
    if m.context_attention == "ring":
        raise ConfigError("model.context_attention=ring is not built for latent attention (model.kv_lora_rank > 0); "
                          "use allgather")


def _check_routing(m: ml_collections.ConfigDict) -> None:
    if m.first_dense_layers:
        if not m.num_experts:
            raise ConfigError(f"model.first_dense_layers={m.first_dense_layers} needs a mixture of experts "
                              f"(model.num_experts > 0) after them")
        if m.first_dense_layers >= m.num_layers:
            raise ConfigError(f"model.first_dense_layers={m.first_dense_layers} must be < model.num_layers="
                              f"{m.num_layers}: the layers after them are mixtures of experts")
        if m.moe_every != 1:
            raise ConfigError(f"model.first_dense_layers={m.first_dense_layers} with model.moe_every={m.moe_every}: "
                              f"after the dense first layers every layer is a mixture (moe_every 1)")
    if m.family == "deepseek" and m.moe_every != 1:
        raise ConfigError(f"model.family=deepseek has a mixture of experts in every layer after the dense first "
                          f"ones (model.first_dense_layers): model.moe_every must be 1, got {m.moe_every}")
    if m.router_bias_update_rate and not m.router_correction_bias:
        raise ConfigError(f"model.router_bias_update_rate={m.router_bias_update_rate} moves the router's selection "
                          f"bias: it needs model.router_correction_bias=true")
    if not m.num_experts:
        return
    groups = m.router_groups
    if m.num_experts % groups:
        raise ConfigError(f"model.num_experts={m.num_experts} must be divisible by model.router_groups={groups}")
    if groups > 1 and m.num_experts // groups < 2:
        raise ConfigError(f"model.router_groups={groups} leaves fewer than 2 experts a group: a group's score is the "
                          f"sum of its top 2")
    if m.router_topk_groups > groups:
        raise ConfigError(f"model.router_topk_groups={m.router_topk_groups} must be <= model.router_groups={groups}")
    if m.experts_per_token > m.router_topk_groups * (m.num_experts // groups):
        raise ConfigError(f"model.experts_per_token={m.experts_per_token} exceeds the experts of the "
                          f"model.router_topk_groups={m.router_topk_groups} groups a token may use")
