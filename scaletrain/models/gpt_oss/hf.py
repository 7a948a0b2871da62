"""GPT-OSS's Hugging Face table (GptOssForCausalLM) and config.json keys.

Its experts are stacked tensors per layer, not a tensor per expert: gate_up_proj [E, d, 2f] holds the gate in its
even columns and up in its odd ones (family.Interleaved), down_proj [E, f, d] is scaletrain's layout as it is.
Biases of Q/K/V are [heads x head_dim] vectors (in_dims 0). Hub checkpoints store the experts' weights in MXFP4
(tools/hf_mxfp4.py dequantizes them as they are read)."""

from __future__ import annotations

from typing import Any

from scaletrain.errors import UserError
from scaletrain.models.family import Architecture, Interleaved, Row
from scaletrain.models.llama import hf as llama_hf

_LAYER = "model.layers.{i}."
TENSORS: tuple[Row, ...] = (
    ("model.embed_tokens.weight", ("embed", "table"), None),
    (_LAYER + "input_layernorm.weight", ("layers", "attn_norm", "scale"), None),
    *((f"{_LAYER}self_attn.{p}_proj.{kind}", ("layers", "attn", f"{'w' if kind == 'weight' else 'b'}{p}"),
       (1 if kind == "weight" else 0) if p != "o" else (2 if kind == "weight" else None))
      for p in "qkvo" for kind in ("weight", "bias")),
    (_LAYER + "self_attn.sinks", ("layers", "attn", "sinks"), None),
    (_LAYER + "post_attention_layernorm.weight", ("layers", "mlp_norm", "scale"), None),
    (_LAYER + "mlp.router.weight", ("layers", "mlp", "router"), 1),
    (_LAYER + "mlp.router.bias", ("layers", "mlp", "router_logit_bias"), None),
    (_LAYER + "mlp.experts.gate_up_proj", ("layers", "mlp", "w_gate"), Interleaved(0, 2)),
    (_LAYER + "mlp.experts.gate_up_proj", ("layers", "mlp", "w_up"), Interleaved(1, 2)),
    (_LAYER + "mlp.experts.gate_up_proj_bias", ("layers", "mlp", "b_gate"), Interleaved(0, 2)),
    (_LAYER + "mlp.experts.gate_up_proj_bias", ("layers", "mlp", "b_up"), Interleaved(1, 2)),
    (_LAYER + "mlp.experts.down_proj", ("layers", "mlp", "w_down"), None),
    (_LAYER + "mlp.experts.down_proj_bias", ("layers", "mlp", "b_down"), None),
    ("model.norm.weight", ("final_norm", "scale"), None),
    ("lm_head.weight", ("lm_head",), 1),
)
# config.json key -> model.* key, where one is the other: llama's, and the mixture's and its unit's.
CONFIG_KEYS = llama_hf.CONFIG_KEYS[:6] + (("rms_norm_eps", "norm_eps"), ("tie_word_embeddings", "tie_embeddings"),
                                          ("num_local_experts", "num_experts"),
                                          ("num_experts_per_tok", "experts_per_token"),
                                          ("intermediate_size", "moe_d_ff"),
                                          ("router_aux_loss_coef", "router_aux_loss"),
                                          ("swiglu_limit", "swiglu_limit"), ("swiglu_alpha", "swiglu_alpha"))
# What every GPT-OSS model is (Architecture.features): its family and pieces.
FEATURES = {"family": "gpt_oss", "attention_sinks": True, "attention_bias": True, "router_logit_bias": True,
            "expert_bias": True, "expert_activation": "clamped_swiglu"}


def _keys_in(hf: dict, source: str, refuse) -> dict[str, Any]:
    """A mixture in every layer, dropless, with the experts' width as d_ff too (GPT-OSS has no dense MLP)."""
    method = (hf.get("quantization_config") or {}).get("quant_method", "mxfp4")
    if method != "mxfp4":
        raise refuse(f"quantization_config quant_method {method} (MXFP4 checkpoints are read dequantized)")
    if hf.get("attention_bias") is False:
        raise refuse("attention_bias=false (scaletrain's GPT-OSS has the projections' biases)")
    for key in ("num_local_experts", "num_experts_per_tok", "intermediate_size"):
        if hf.get(key) is None:
            raise UserError(f"{source}: config.json has no {key}")
    return {"d_ff": hf["intermediate_size"], "moe_every": 1, "capacity_factor": 0.0}


def _keys_out(model) -> dict[str, Any]:
    """Biases on; plain RoPE written as such (GptOssConfig reads a missing rope_parameters as YaRN)."""
    plain = {"rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta}}
    return {"attention_bias": True, **(plain if model.rope_scaling == "none" else {})}


ARCHITECTURES = {
    "GptOssForCausalLM": Architecture("gpt_oss", TENSORS, CONFIG_KEYS, keys_in=_keys_in, keys_out=_keys_out,
                                      features=FEATURES, windows=True),
}


def export(model) -> str:
    """GptOss, for a model with a mixture in every layer and no per-head Q/K norms."""
    if model.moe_every != 1:
        raise UserError(f"model.moe_every={model.moe_every}: Hugging Face's GPT-OSS has a mixture of experts in "
                        f"every layer (moe_every 1)")
    if model.qk_norm:
        raise UserError("model.qk_norm=true: Hugging Face's GPT-OSS normalises no Q and K per head")
    return "GptOssForCausalLM"
