"""The gemma family's Hugging Face tables: every tensor of Gemma3ForCausalLM (text-only, model_type gemma3_text)
and Gemma2ForCausalLM, and their config.json keys (scaletrain/tools/hf.py reads and writes them). The norm gains
are stored as Hugging Face stores them (w of 1 + w: model.norm_plus_one), the embedding unscaled
(model.embed_scale), so every tensor is copied as is or transposed like Llama's."""

from __future__ import annotations

from typing import Any, Callable

from scaletrain import config_gemma
from scaletrain.errors import UserError
from scaletrain.models.family import Architecture, Row
from scaletrain.models.llama.hf import CONFIG_KEYS

# models/family.py's Row says how to read a row.
TENSORS: tuple[Row, ...] = (
    ("model.embed_tokens.weight", ("embed", "table"), None),
    ("model.layers.{i}.input_layernorm.weight", ("layers", "attn_norm", "scale"), None),
    ("model.layers.{i}.self_attn.q_proj.weight", ("layers", "attn", "wq"), 1),
    ("model.layers.{i}.self_attn.k_proj.weight", ("layers", "attn", "wk"), 1),
    ("model.layers.{i}.self_attn.v_proj.weight", ("layers", "attn", "wv"), 1),
    ("model.layers.{i}.self_attn.o_proj.weight", ("layers", "attn", "wo"), 2),
    ("model.layers.{i}.self_attn.q_norm.weight", ("layers", "attn", "q_norm", "scale"), None),
    ("model.layers.{i}.self_attn.k_norm.weight", ("layers", "attn", "k_norm", "scale"), None),
    ("model.layers.{i}.post_attention_layernorm.weight", ("layers", "post_attn_norm", "scale"), None),
    ("model.layers.{i}.pre_feedforward_layernorm.weight", ("layers", "mlp_norm", "scale"), None),
    ("model.layers.{i}.mlp.gate_proj.weight", ("layers", "mlp", "w_gate"), 1),
    ("model.layers.{i}.mlp.up_proj.weight", ("layers", "mlp", "w_up"), 1),
    ("model.layers.{i}.mlp.down_proj.weight", ("layers", "mlp", "w_down"), 1),
    ("model.layers.{i}.post_feedforward_layernorm.weight", ("layers", "post_mlp_norm", "scale"), None),
    ("model.norm.weight", ("final_norm", "scale"), None),
    ("lm_head.weight", ("lm_head",), 1),
)

HIDDEN_ACT = "gelu_pytorch_tanh"


def _cap(value) -> float:
    return float(value or 0.0)


def _keys_in(gemma3: bool):
    def keys_in(hf: dict, source: str, refuse: Callable[[str], Exception]) -> dict[str, Any]:
        """Gemma's keys: its pieces on; the query scalar and the final soft cap as given; the attention soft cap
        Gemma 2's only (Gemma 3's Hugging Face attention does not apply the one its config carries)."""
        if hf.get("use_bidirectional_attention"):
            raise refuse("use_bidirectional_attention=true")
        keys = {"family": "gemma", "norm_plus_one": True, "embed_scale": True, "mlp_activation": "gelu_tanh",
                "query_pre_attn_scalar": int(hf.get("query_pre_attn_scalar") or 0),
                "final_logit_softcap": _cap(hf.get("final_logit_softcapping"))}
        if not gemma3:
            keys["attn_logit_softcap"] = _cap(hf.get("attn_logit_softcapping"))
        return keys
    return keys_in


def _rope(params: dict, refuse, kind: str) -> dict[str, Any]:
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in ("default", "linear") or (kind == "sliding_attention" and rope_type != "default"):
        raise refuse(f"rope_type {rope_type} on {kind} layers")
    keys = {"rope_theta": float(params["rope_theta"])}
    return keys | ({"rope_scaling": "linear", "rope_scaling_factor": float(params["factor"])}
                   if rope_type == "linear" else {})


def _gemma3_rope_keys(hf: dict, refuse) -> dict[str, Any]:
    """Gemma 3's RoPE per layer kind: the full layers' base and linear scaling (model.rope_theta, rope_scaling),
    the sliding layers' base (model.rope_local_theta). transformers 5 writes rope_parameters by layer kind; earlier
    versions rope_theta, rope_scaling and rope_local_base_freq."""
    rope = hf.get("rope_parameters")
    if rope is None:
        rope = {"full_attention": {"rope_theta": hf.get("rope_theta", 1e6), **(hf.get("rope_scaling") or {})},
                "sliding_attention": {"rope_theta": hf.get("rope_local_base_freq", 1e4)}}
    if "full_attention" not in rope:
        rope = {"full_attention": rope, "sliding_attention": rope}
    keys = _rope(rope["full_attention"], refuse, "full_attention")
    if "sliding_attention" in (hf.get("layer_types") or ()):
        keys["rope_local_theta"] = _rope(rope["sliding_attention"], refuse, "sliding_attention")["rope_theta"]
    return keys


def _keys_out(gemma3: bool):
    def keys_out(model) -> dict[str, Any]:
        out = {"hidden_activation": HIDDEN_ACT, "query_pre_attn_scalar": model.query_pre_attn_scalar or model.head_dim,
               "final_logit_softcapping": model.final_logit_softcap or None,
               "attn_logit_softcapping": model.attn_logit_softcap or None}
        if gemma3:
            full = {"rope_type": "default", "rope_theta": model.rope_theta}
            if model.rope_scaling == "linear":
                full = {"rope_type": "linear", "factor": model.rope_scaling_factor, "rope_theta": model.rope_theta}
            local = {"rope_type": "default", "rope_theta": model.rope_local_theta or model.rope_theta}
            out |= {"rope_parameters": {"full_attention": full, "sliding_attention": local}, "rope_scaling": None}
        return out
    return keys_out


def _architecture(model_type: str, gemma3: bool) -> Architecture:
    return Architecture(model_type, TENSORS, CONFIG_KEYS, bias_keys=("attention_bias",), qk_norm=gemma3,
                        keys_in=_keys_in(gemma3), keys_out=_keys_out(gemma3), windows=True, hidden_act=HIDDEN_ACT,
                        rope_keys=_gemma3_rope_keys if gemma3 else None, own_keys=config_gemma.KEYS)


ARCHITECTURES = {"Gemma3ForCausalLM": _architecture("gemma3_text", True),
                 "Gemma2ForCausalLM": _architecture("gemma2", False)}


def export(model) -> str:
    """Gemma 3 where Q and K are normalised, else Gemma 2; a UserError for what neither represents."""
    gemma3 = bool(model.qk_norm)
    name = "Gemma3ForCausalLM" if gemma3 else "Gemma2ForCausalLM"
    wrong = [f"model.{key}={model[key]}" for key, want in (("norm_plus_one", True), ("embed_scale", True),
                                                          ("mlp_activation", "gelu_tanh")) if model[key] != want]
    if gemma3 and model.attn_logit_softcap:
        wrong.append(f"model.attn_logit_softcap={model.attn_logit_softcap} (Gemma 3's attention has none)")
    if not gemma3 and model.rope_local_theta:
        wrong.append(f"model.rope_local_theta={model.rope_local_theta} (Gemma 2 has one RoPE base)")
    if not gemma3 and model.rope_scaling != "none":
        wrong.append(f"model.rope_scaling={model.rope_scaling} (Gemma 2's RoPE is unscaled)")
    if wrong:
        raise UserError(f"{name} cannot represent {', '.join(wrong)}")
    return name
