"""The deepseek family: DeepSeek-V3 and the models built like it (Kimi K2, Moonlight) - latent attention (mla.py),
dense first layers and mixtures of experts with shared experts and DeepSeek's routing (decoder.py), their Hugging
Face tables (hf.py) and the planner's matmul inventory (`matmuls`)."""

from __future__ import annotations

from scaletrain.config import moe_d_ff
from scaletrain.models.deepseek import hf
from scaletrain.models.deepseek.decoder import DeepSeek
from scaletrain.models.family import Family, Matmul


def attention_matmuls(m, tensor: int = 1, share: float = 1.0) -> dict[str, Matmul]:
    """Latent attention's projections in `share` of the layers (per layer of the stack): from x the query (or its
    latent), the key/value latent and the shared RoPE key (`qkv`: the latents whole on every device, the query's
    heads split over `tensor`); the latents' expansions per head (`q_up`, `kv_up`, split by heads); the output
    projection (split by its inputs)."""
    n, h, vh = m.num_heads / tensor, m.head_dim, m.v_head_dim or m.head_dim
    q_out = m.q_lora_rank or n * h
    out = {"qkv": Matmul.dense(share, m.d_model, q_out + m.kv_lora_rank + m.rope_head_dim),
           "kv_up": Matmul.dense(share, m.kv_lora_rank, n * (h - m.rope_head_dim + vh)),
           "out": Matmul.dense(share, n * vh, m.d_model)}
    if m.q_lora_rank:
        out["q_up"] = Matmul.dense(share, m.q_lora_rank, n * h)
    return out


def matmuls(m, tensor: int = 1, expert: int = 1) -> dict[str, Matmul]:
    """A layer's projections on one device, averaged over the layers: attention's; the SwiGLU MLPs (`gate_up`,
    `down`: the dense first layers' of width d_ff and the mixtures' shared experts', of shared_experts x the
    experts' width, as one average); the router and the routed experts' (mixtral's), in the mixtures' share. The
    multi-token prediction modules (model.mtp_depth, models/mtp.py) count as that many more mixture layers, and
    their input projections (`mtp_proj`, 2 d_model x d_model) with them."""
    d, layers, ahead = m.d_model, m.num_layers, m.mtp_depth
    dense, moe = m.first_dense_layers / layers, (layers - m.first_dense_layers + ahead) / layers
    f = (dense * m.d_ff + moe * m.shared_experts * moe_d_ff(m)) / tensor  # the MLPs' width per layer, summed
    fe, k, local = moe_d_ff(m) / tensor, m.experts_per_token, m.num_experts / expert
    out = attention_matmuls(m, tensor, (layers + ahead) / layers) | {
        "router": Matmul.dense(moe, d, m.num_experts),
        "expert_gate_up": Matmul(moe, k, d, 2 * fe, local * d * 2 * fe),
        "expert_down": Matmul(moe, k, fe, d, local * fe * d)}
    if f:
        out |= {"gate_up": Matmul.dense(1, d, 2 * f), "down": Matmul.dense(1, f, d)}
    if ahead:
        out["mtp_proj"] = Matmul.dense(ahead / layers, 2 * d, d)
    return out


FAMILY = Family(name="deepseek", decoder=DeepSeek, matmuls=matmuls, architectures=hf.ARCHITECTURES,
                export=hf.export, experts=True, adapters=("gate_proj", "up_proj", "down_proj"))

__all__ = ["FAMILY", "DeepSeek", "matmuls"]
