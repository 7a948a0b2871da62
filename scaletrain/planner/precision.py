"""Which of a step's FLOPs run in low precision (model.quantization): the roofline times them at the chip's peak
for their operands (hardware.Chip.matmul_peak: int8_ops, fp8_flops) rather than its bf16 peak
(docs/quantization.md)."""

from __future__ import annotations

from typing import Mapping

from scaletrain import config

# The config's matmul groups (model.quantized_matmuls) of the families' planner groups (Family.matmuls); the
# router is never quantized (its float32 logits choose the experts).
QUANTIZED_GROUPS = {"qkv": "attention", "out": "attention", "gate_up": "mlp", "down": "mlp",
                    "expert_gate_up": "experts", "expert_down": "experts",
                    # latent attention's expansions (models/deepseek)
                    "q_up": "attention", "kv_up": "attention"}


def quantized_flops(cfg, forward: Mapping[str, float], recompute: frozenset[str], logits_recomputed: bool,
                    passes: int = 3) -> float:
    """Training FLOPs per token of the matmuls model.quantization runs in int8 or fp8 - forward, the backward
    matmuls and any recomputation -, from a layer's forward FLOPs per group (roofline.forward_flops), the groups
    the backward pass recomputes, and the output head (recomputed too where `logits_recomputed`). `passes`: over
    each weight per token (flops.passes: 3, or fewer for a frozen base, one more for DPO's reference)."""
    m = cfg.model
    if m.quantization == "none":
        return 0.0
    groups = set(config.quantized_groups(m.quantized_matmuls))
    layer = sum(f * (passes + (g in recompute)) for g, f in forward.items() if QUANTIZED_GROUPS.get(g) in groups)
    # the output projection, again for each multi-token prediction module (models/mtp.py)
    head = ((passes + logits_recomputed) * 2 * m.d_model * m.vocab_size * (1 + m.mtp_depth) if "output" in groups
            else 0.0)
    return m.num_layers * layer + head
