"""The mixtral family's Hugging Face tables: MixtralForCausalLM and Qwen3MoeForCausalLM - the llama family's
tensors with a mixture of experts' rows in place of the MLP's, and their config.json keys."""

from __future__ import annotations

from typing import Any

from scaletrain import config as config_lib
from scaletrain.errors import UserError
from scaletrain.models.family import Architecture, Row
from scaletrain.models.llama import hf as llama_hf

# A mixture of experts' rows, in place of the llama table's MLP rows, under each architecture's names: the router
# ([experts, d] in Hugging Face, [d, experts] in scaletrain) and each expert's SwiGLU.
MOE_TENSORS: dict[str, tuple[Row, ...]] = {
    "MixtralForCausalLM": (
        ("model.layers.{i}.block_sparse_moe.gate.weight", ("layers", "mlp", "router"), 1),
        ("model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight", ("layers", "mlp", "w_gate"), 1),
        ("model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight", ("layers", "mlp", "w_down"), 1),
        ("model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight", ("layers", "mlp", "w_up"), 1),
    ),
    "Qwen3MoeForCausalLM": (
        ("model.layers.{i}.mlp.gate.weight", ("layers", "mlp", "router"), 1),
        ("model.layers.{i}.mlp.experts.{j}.gate_proj.weight", ("layers", "mlp", "w_gate"), 1),
        ("model.layers.{i}.mlp.experts.{j}.up_proj.weight", ("layers", "mlp", "w_up"), 1),
        ("model.layers.{i}.mlp.experts.{j}.down_proj.weight", ("layers", "mlp", "w_down"), 1),
    ),
}
# A mixture of experts' config.json keys -> model.* keys, where one is the other. The expert count is
# num_local_experts (Mixtral's; transformers 5 writes it for Qwen3-MoE too) or num_experts (Qwen3-MoE's), the
# experts' width EXPERT_WIDTH's key; every layer is a mixture (moe_every 1), dropless (capacity_factor 0).
MOE_CONFIG_KEYS = (("num_experts_per_tok", "experts_per_token"), ("router_aux_loss_coef", "router_aux_loss"))
EXPERT_COUNT = {"MixtralForCausalLM": "num_local_experts", "Qwen3MoeForCausalLM": "num_experts"}
EXPERT_WIDTH = {"MixtralForCausalLM": "intermediate_size", "Qwen3MoeForCausalLM": "moe_intermediate_size"}


def _table(arch: str) -> tuple[Row, ...]:
    """The llama table with MOE_TENSORS[arch] in place of the MLP's rows."""
    rows = llama_hf.TENSORS
    mlp = [row for row, (_, path, _) in enumerate(rows) if path[:2] == ("layers", "mlp")]
    return rows[:mlp[0]] + MOE_TENSORS[arch] + rows[mlp[-1] + 1:]


def _keys_in(arch: str):
    def keys(hf: dict, source: str, refuse) -> dict[str, Any]:
        """A mixture of experts in every layer, routed as scaletrain routes: the top k of the softmax,
        renormalised to sum to 1 (Mixtral always; Qwen3-MoE with norm_topk_prob)."""
        if arch == "Qwen3MoeForCausalLM":
            if not hf.get("norm_topk_prob"):
                raise refuse("norm_topk_prob=false (top-k router weights not renormalised)")
            if hf.get("decoder_sparse_step", 1) != 1:
                raise refuse(f"decoder_sparse_step={hf['decoder_sparse_step']} (dense layers between the mixtures)")
            if hf.get("mlp_only_layers"):
                raise refuse(f"mlp_only_layers {hf['mlp_only_layers']} (dense layers between the mixtures)")
        # transformers reads either name of the expert count for either architecture
        count = next((k for k in ("num_local_experts", "num_experts") if hf.get(k) is not None), EXPERT_COUNT[arch])
        for key in (count, "num_experts_per_tok", EXPERT_WIDTH[arch]):
            if hf.get(key) is None:
                raise UserError(f"{source}: config.json has no {key}")
        return {"num_experts": hf[count], "moe_d_ff": hf[EXPERT_WIDTH[arch]],
                **{ours: hf[theirs] for theirs, ours in MOE_CONFIG_KEYS if hf.get(theirs) is not None}}
    return keys


def _keys_out(arch: str):
    def keys(model) -> dict[str, Any]:
        """A mixture of experts' config.json keys (Hugging Face's mixtures are dropless, whatever
        model.capacity_factor: it does not change the weights)."""
        out = {EXPERT_COUNT[arch]: model.num_experts, EXPERT_WIDTH[arch]: config_lib.moe_d_ff(model),
               **{theirs: model[ours] for theirs, ours in MOE_CONFIG_KEYS}}
        if arch == "Qwen3MoeForCausalLM":  # transformers' defaults route otherwise
            out |= {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
        return out
    return keys


ARCHITECTURES = {
    "MixtralForCausalLM": Architecture("mixtral", _table("MixtralForCausalLM"), llama_hf.CONFIG_KEYS,
                                       sliding_window=True, keys_in=_keys_in("MixtralForCausalLM"),
                                       keys_out=_keys_out("MixtralForCausalLM")),
    "Qwen3MoeForCausalLM": Architecture("qwen3_moe", _table("Qwen3MoeForCausalLM"), llama_hf.CONFIG_KEYS,
                                        bias_keys=("attention_bias",), qk_norm=True,
                                        keys_in=_keys_in("Qwen3MoeForCausalLM"),
                                        keys_out=_keys_out("Qwen3MoeForCausalLM")),
}


def export(model) -> str:
    """Qwen3-MoE where Q and K are normalised, else Mixtral; both have a mixture in every layer."""
    if model.moe_every != 1:
        raise UserError(f"model.moe_every={model.moe_every}: Hugging Face's Mixtral and Qwen3-MoE have a mixture "
                        f"of experts in every layer (moe_every 1)")
    return "Qwen3MoeForCausalLM" if model.qk_norm else "MixtralForCausalLM"
