"""The deepseek family's Hugging Face tables: DeepseekV3ForCausalLM (DeepSeek-V3, V3.1, R1, Kimi K2, Moonlight),
every tensor and its config.json keys. The dense first layers are scaletrain's `dense_layers` stack and Hugging
Face's first layers; the mixtures follow them (Architecture.stacks). Hugging Face's interleaved RoPE pairs
(rope_interleave) become scaletrain's split halves by permuting the RoPE columns of the query and shared-key
projections (`permute`), so the model itself always rotates split halves. The checkpoint's multi-token prediction
layers (model.layers.{num_hidden_layers}.* on) are the `mtp` modules (models/mtp.py) where config.json names them
and the files hold them; else they are skipped, as transformers skips them."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from scaletrain.errors import UserError
from scaletrain.models.family import Architecture, Row
from scaletrain.models.llama import hf as llama_hf


def _attention(*block: str) -> tuple[Row, ...]:
    """A block's attention rows, the block at `block` in the parameters (a stack, or the MTP modules' blocks)."""
    a = (*block, "attn")
    return (
        ("model.layers.{i}.input_layernorm.weight", (*block, "attn_norm", "scale"), None),
        ("model.layers.{i}.self_attn.q_proj.weight", (*a, "wq"), 1),
        ("model.layers.{i}.self_attn.q_a_proj.weight", (*a, "wq_a"), 1),
        ("model.layers.{i}.self_attn.q_a_layernorm.weight", (*a, "q_a_norm", "scale"), None),
        ("model.layers.{i}.self_attn.q_b_proj.weight", (*a, "wq_b"), 1),
        ("model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", (*a, "wkv_a"), 1),
        ("model.layers.{i}.self_attn.kv_a_layernorm.weight", (*a, "kv_a_norm", "scale"), None),
        ("model.layers.{i}.self_attn.kv_b_proj.weight", (*a, "wkv_b"), 1),
        ("model.layers.{i}.self_attn.o_proj.weight", (*a, "wo"), 2),
        ("model.layers.{i}.post_attention_layernorm.weight", (*block, "mlp_norm", "scale"), None),
    )


def _swiglu(prefix: str, path: tuple[str, ...]) -> tuple[Row, ...]:
    return tuple((f"{prefix}.{hf}.weight", (*path, ours), 1)
                 for hf, ours in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")))


def _mixture(*block: str) -> tuple[Row, ...]:
    """A mixture block's rows: its attention, router, routed and shared experts."""
    mlp = (*block, "mlp")
    return (*_attention(*block),
            ("model.layers.{i}.mlp.gate.weight", (*mlp, "routed", "router"), 1),
            ("model.layers.{i}.mlp.gate.e_score_correction_bias", (*mlp, "routed", "router_bias"), None),
            *_swiglu("model.layers.{i}.mlp.experts.{j}", (*mlp, "routed")),
            *_swiglu("model.layers.{i}.mlp.shared_experts", (*mlp, "shared")))


TENSORS: tuple[Row, ...] = (
    ("model.embed_tokens.weight", ("embed", "table"), None),
    *_attention("dense_layers"),
    *_swiglu("model.layers.{i}.mlp", ("dense_layers", "mlp")),
    *_mixture("layers"),
    # The multi-token prediction modules (models/mtp.py): the layers after the last one, each a mixture block with
    # its two input norms, their projection and the norm before the head.
    ("model.layers.{i}.enorm.weight", ("mtp", "embed_norm", "scale"), None),
    ("model.layers.{i}.hnorm.weight", ("mtp", "hidden_norm", "scale"), None),
    ("model.layers.{i}.eh_proj.weight", ("mtp", "proj"), 1),
    *_mixture("mtp", "block"),
    ("model.layers.{i}.shared_head.norm.weight", ("mtp", "final_norm", "scale"), None),
    ("model.norm.weight", ("final_norm", "scale"), None),
    ("lm_head.weight", ("lm_head",), 1),
)
# Each MTP layer repeats the model's embedding and output head: one parameter each in scaletrain.
COPIES = (("model.layers.{i}.embed_tokens.weight", "mtp", ("embed", "table"), None),
          ("model.layers.{i}.shared_head.head.weight", "mtp", ("lm_head",), 1))

# The llama keys but head_dim, which DeepSeek's config.json gives as the RoPE dims (qk_rope_head_dim).
CONFIG_KEYS = tuple((hf, ours) for hf, ours in llama_hf.CONFIG_KEYS if hf != "head_dim")
# DeepSeek's own config.json keys -> model.* keys, where one is the other.
DEEPSEEK_KEYS = (
    ("kv_lora_rank", "kv_lora_rank"), ("qk_rope_head_dim", "rope_head_dim"), ("v_head_dim", "v_head_dim"),
    ("n_routed_experts", "num_experts"), ("num_experts_per_tok", "experts_per_token"),
    ("moe_intermediate_size", "moe_d_ff"), ("first_k_dense_replace", "first_dense_layers"),
    ("n_group", "router_groups"), ("topk_group", "router_topk_groups"), ("routed_scaling_factor", "router_scale"),
    ("norm_topk_prob", "router_norm_topk"), ("rope_interleave", "rope_interleave"))
# Their values where the config.json leaves them out: transformers' DeepseekV3Config defaults.
DEFAULTS = {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
            "rope_interleave": True, "first_k_dense_replace": 3, "n_shared_experts": 1}
# Keys of other DeepSeek code (the original remote code, V3.2) whose values scaletrain's model does not have.
FIXED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


def keys_in(hf: dict, source: str, refuse) -> dict[str, Any]:
    """DeepSeek's model.* keys: latent attention, sigmoid routing with the selection bias, the scores' magnitude
    of YaRN in the softmax scale; no router losses (DeepSeek-V3 balances by its bias)."""
    for key, value in FIXED.items():
        if hf.get(key, value) != value:
            raise refuse(f"{key}={hf[key]}")
    if hf.get("index_topk") or hf.get("mlp_layer_types"):
        raise refuse("DeepSeek-V3.2's sparse attention indexer")
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                "moe_intermediate_size", "num_experts_per_tok"):
        if hf.get(key) is None:
            raise UserError(f"{source}: config.json has no {key}")
    given = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    keys = {ours: given[theirs] for theirs, ours in DEEPSEEK_KEYS}
    # transformers' latent attention expands keys and values for every head, whatever num_key_value_heads says
    return keys | {"family": "deepseek", "head_dim": hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
                   "mtp_depth": hf.get("num_nextn_predict_layers") or 0,
                   "num_kv_heads": hf["num_attention_heads"],
                   "q_lora_rank": hf.get("q_lora_rank") or 0, "shared_experts": given["n_shared_experts"],
                   "router_score": "sigmoid", "router_correction_bias": True, "rope_softmax_mscale": True,
                   "router_aux_loss": 0.0, "router_z_loss": 0.0}


def keys_out(model) -> dict[str, Any]:
    out = {theirs: model[ours] for theirs, ours in DEEPSEEK_KEYS}
    out |= {"q_lora_rank": model.q_lora_rank or None, "qk_nope_head_dim": model.head_dim - model.rope_head_dim,
            "head_dim": model.rope_head_dim, "n_shared_experts": model.shared_experts,
            "num_nextn_predict_layers": model.mtp_depth}
    if model.rope_scaling == "yarn":  # transformers' YaRN reads its factor from these when the config has none
        out["max_position_embeddings"] = int(model.rope_scaling_factor * model.rope_original_max_position)
    return out


def export(model) -> str:
    """DeepseekV3ForCausalLM, for what it represents: latent attention, sigmoid scores with the selection bias,
    every layer after the dense first ones a mixture, the YaRN magnitude in the softmax scale."""
    wrong = [what for bad, what in (
        (not model.kv_lora_rank, "model.kv_lora_rank=0 (Hugging Face's DeepSeek-V3 has latent attention)"),
        (model.router_score != "sigmoid", f"model.router_score={model.router_score} (DeepSeek scores by sigmoid)"),
        (not model.router_correction_bias, "model.router_correction_bias=false (DeepSeek selects with its bias)"),
        (model.moe_every != 1, f"model.moe_every={model.moe_every}"),
        (model.rope_scaling == "yarn" and model.rope_mscale_all_dim and not model.rope_softmax_mscale,
         "model.rope_softmax_mscale=false (DeepSeek puts YaRN's magnitude in the softmax scale)"),
        (model.rope_scaling == "llama3", "model.rope_scaling=llama3")) if bad]
    if wrong:
        raise UserError(f"DeepseekV3ForCausalLM cannot represent {wrong[0]}")
    return "DeepseekV3ForCausalLM"


def _rope_columns(model, path: tuple[str, ...]) -> slice | None:
    """The last-axis slice of a parameter (scaletrain's layout) whose columns feed RoPE: the queries' last
    rope_head_dim of each head, the shared key's after the latent. None for every other parameter."""
    if path[-1] in ("wq", "wq_b"):
        return slice(model.head_dim - model.rope_head_dim, None)
    if path[-1] == "wkv_a":
        return slice(model.kv_lora_rank, None)
    return None


def permute(model, path: tuple[str, ...], x: np.ndarray, to_hf: bool) -> np.ndarray:
    """With rope_interleave, Hugging Face rotates pairs (2i, 2i + 1) into the split halves (i, i + r/2): its RoPE
    columns in the order evens then odds are scaletrain's (`to_hf`: back)."""
    columns = _rope_columns(model, path) if model.rope_interleave else None
    if columns is None:
        return x
    r = model.rope_head_dim
    order = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])
    x = x.copy()
    x[..., columns] = x[..., columns][..., np.argsort(order) if to_hf else order]
    return x


def mtp_layers(hf: dict):
    """The checkpoint's multi-token prediction layers' tensors (model.layers.{num_hidden_layers}.* on): passed
    over where the model has no MTP modules (config.json's num_nextn_predict_layers 0 or absent, or no such layer
    in the files), as transformers passes over them."""
    first = hf.get("num_hidden_layers")

    def skipped(name: str) -> bool:
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        return layer is not None and int(layer[1]) >= first

    return skipped


def keys_from_files(hf: dict, names: set) -> tuple[dict, str]:
    """model.mtp_depth 0 where config.json names MTP layers (num_nextn_predict_layers) the files do not hold:
    transformers drops them when it saves a model."""
    depth, first = hf.get("num_nextn_predict_layers") or 0, hf.get("num_hidden_layers")
    if not depth or f"model.layers.{first}.eh_proj.weight" in names:
        return {}, ""
    return {"mtp_depth": 0}, (f"note: config.json's num_nextn_predict_layers={depth}, but the files hold no "
                              f"multi-token prediction layer (model.layers.{first}.*): converted without it "
                              f"(model.mtp_depth=0)")


ARCHITECTURES = {
    "DeepseekV3ForCausalLM": Architecture("deepseek_v3", TENSORS, CONFIG_KEYS,
                                          bias_keys=("attention_bias",), keys_in=keys_in, keys_out=keys_out,
                                          stacks=("dense_layers", "layers", "mtp"), permute=permute,
                                          skipped=mtp_layers, copies=COPIES, keys_from_files=keys_from_files),
}
