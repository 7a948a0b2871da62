"""The llama family's Hugging Face tables: every tensor of LlamaForCausalLM, MistralForCausalLM and
Qwen3ForCausalLM, and their config.json keys (scaletrain/tools/hf.py reads and writes them). scaletrain's RoPE is
rotate-half like Hugging Face's and it scales q by head_dim**-0.5 itself, so the weights need no permutation and
no scaling: linear weights are transposed and reshaped, everything else is copied as is."""

from __future__ import annotations

from scaletrain.models.family import Architecture, Row

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
    ("model.layers.{i}.post_attention_layernorm.weight", ("layers", "mlp_norm", "scale"), None),
    ("model.layers.{i}.mlp.gate_proj.weight", ("layers", "mlp", "w_gate"), 1),
    ("model.layers.{i}.mlp.up_proj.weight", ("layers", "mlp", "w_up"), 1),
    ("model.layers.{i}.mlp.down_proj.weight", ("layers", "mlp", "w_down"), 1),
    ("model.norm.weight", ("final_norm", "scale"), None),
    ("lm_head.weight", ("lm_head",), 1),
)

# config.json key -> model.* key, where one is the other.
CONFIG_KEYS = (("vocab_size", "vocab_size"), ("hidden_size", "d_model"), ("num_hidden_layers", "num_layers"),
               ("num_attention_heads", "num_heads"), ("num_key_value_heads", "num_kv_heads"),
               ("head_dim", "head_dim"), ("intermediate_size", "d_ff"), ("rms_norm_eps", "norm_eps"),
               ("tie_word_embeddings", "tie_embeddings"))

ARCHITECTURES = {
    "LlamaForCausalLM": Architecture("llama", TENSORS, CONFIG_KEYS, bias_keys=("attention_bias", "mlp_bias")),
    "MistralForCausalLM": Architecture("mistral", TENSORS, CONFIG_KEYS, sliding_window=True),
    "Qwen3ForCausalLM": Architecture("qwen3", TENSORS, CONFIG_KEYS, bias_keys=("attention_bias",), qk_norm=True),
}


def export(model) -> str:
    """Qwen3 where Q and K are normalised, else Llama."""
    return "Qwen3ForCausalLM" if model.qk_norm else "LlamaForCausalLM"
