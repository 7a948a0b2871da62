"""The mixtral family: Mixtral and Qwen3-MoE - the llama decoder with a mixture of experts (moe.py) in every
model.moe_every-th layer (decoder.py), their Hugging Face tables (hf.py), and the planner's matmul inventory
(`matmuls`: the router and the experts' projections)."""

from __future__ import annotations

from scaletrain.config import moe_d_ff
from scaletrain.models import llama
from scaletrain.models.family import Family, Matmul
from scaletrain.models.mixtral import hf
from scaletrain.models.mixtral.decoder import ROUTER, Mixtral, MoEGroup, RoutedBlock


def matmuls(m, tensor: int = 1, expert: int = 1) -> dict[str, Matmul]:
    """A layer's projections on one device, by matmul group: llama's attention; the dense layers' MLP where
    there are any (model.moe_every > 1); a mixture of experts' router (a row per token against the E experts)
    and its experts' gate/up and down (k rows per token, one per assignment, through the device's E / `expert`
    experts' weights). Only the groups the stack has."""
    d, moe = m.d_model, 1 / m.moe_every  # the share of the stack's layers that are mixtures
    out = llama.attention_matmuls(m, tensor)
    if moe < 1:
        out |= llama.mlp_matmuls(m, tensor, 1 - moe)
    fe, k, local = moe_d_ff(m) / tensor, m.experts_per_token, m.num_experts / expert
    return out | {"router": Matmul.dense(moe, d, m.num_experts),
                  "expert_gate_up": Matmul(moe, k, d, 2 * fe, local * d * 2 * fe),
                  "expert_down": Matmul(moe, k, fe, d, local * fe * d)}


FAMILY = Family(name="mixtral", decoder=Mixtral, matmuls=matmuls, architectures=hf.ARCHITECTURES,
                export=hf.export, experts=True)

__all__ = ["FAMILY", "ROUTER", "Mixtral", "MoEGroup", "RoutedBlock", "matmuls"]
