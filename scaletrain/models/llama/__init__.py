"""The llama family: Llama, Mistral and Qwen3 - one dense decoder (decoder.py), their Hugging Face tables
(hf.py) and the planner's matmul inventory (`matmuls`)."""

from __future__ import annotations

from scaletrain.models.family import Family, Matmul
from scaletrain.models.llama import hf
from scaletrain.models.llama.decoder import Block, Llama
from scaletrain.parallel import sharding
from scaletrain.parallel.checks import shards_kv_heads


def attention_matmuls(m, tensor: int = 1) -> dict[str, Matmul]:
    """Q/K/V (split by their outputs, kv heads only where `tensor` divides them) and the output projection
    (split by its inputs), in every layer."""
    # Split as the trainer's activation rules split heads and kv heads (every preset alike, no sequence split).
    rules = sharding.rules_for("fsdp", False, shards_kv_heads(m.num_kv_heads, tensor)).activations
    heads = m.num_heads * m.head_dim / sharding.split_ways("heads", rules, {"tensor": tensor})
    kv = m.num_kv_heads * m.head_dim / sharding.split_ways("kv_heads", rules, {"tensor": tensor})
    return {"qkv": Matmul.dense(1, m.d_model, heads + 2 * kv), "out": Matmul.dense(1, heads, m.d_model)}


def mlp_matmuls(m, tensor: int = 1, layers: float = 1.0) -> dict[str, Matmul]:
    """The SwiGLU MLP's gate/up (split by outputs) and down (by inputs), in a share `layers` of the stack."""
    d, f = m.d_model, m.d_ff / tensor
    return {"gate_up": Matmul.dense(layers, d, 2 * f), "down": Matmul.dense(layers, f, d)}


def matmuls(m, tensor: int = 1, expert: int = 1) -> dict[str, Matmul]:
    """A layer's projections on one device, by matmul group (Megatron's splits over `tensor`)."""
    return attention_matmuls(m, tensor) | mlp_matmuls(m, tensor)


FAMILY = Family(name="llama", decoder=Llama, matmuls=matmuls, architectures=hf.ARCHITECTURES, export=hf.export)

__all__ = ["FAMILY", "Block", "Llama", "matmuls"]
