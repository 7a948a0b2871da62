"""The config checks of the mixture-of-experts keys (docs/moe.md): the routing's shape, and the grouped matmul
(model.moe_matmul) against the experts' quantization."""

from __future__ import annotations

import ml_collections

from scaletrain.errors import ConfigError

# model.moe_matmul: the experts' grouped matmul - XLA's ragged dot or megablox's Pallas kernels; auto: megablox
# on a TPU, ragged_dot elsewhere (kernels/grouped_matmul.py).
MOE_MATMULS = ("auto", "ragged_dot", "megablox")


def check(m: ml_collections.ConfigDict) -> None:
    """The `model` section's mixture-of-experts keys; ConfigError naming the keys."""
    if not m.num_experts:
        return
    if m.experts_per_token > m.num_experts:
        raise ConfigError(f"model.experts_per_token={m.experts_per_token} must be <= model.num_experts="
                          f"{m.num_experts}: each token goes to that many different experts")
    if m.num_layers % m.moe_every:
        raise ConfigError(f"model.num_layers={m.num_layers} must be divisible by model.moe_every={m.moe_every}: "
                          f"the stack repeats groups of moe_every layers, the last of each a mixture of experts")
    quantized = {name.strip() for name in m.quantized_matmuls.split(",")}
    if m.moe_matmul == "megablox" and m.quantization != "none" and "experts" in quantized:
        raise ConfigError(f"model.moe_matmul=megablox with model.quantization={m.quantization} on the experts: "
                          "megablox's kernels multiply in the compute dtype; quantized experts run their own grouped "
                          "matmul (model.moe_matmul=auto picks it), or leave experts out of model.quantized_matmuls")
