"""The config checks of the mixture-of-experts keys (docs/moe.md): the routing's shape; the grouped matmul
(model.moe_matmul) is checked against the experts' quantization with the other quantization keys (config.py)."""

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
