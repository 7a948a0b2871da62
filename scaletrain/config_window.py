"""Local (sliding-window) and global attention layers: model.sliding_window and model.layer_types
(docs/attention.md, "Sliding windows"). Here rather than in the model, so that checking a config never imports
Flax."""

from __future__ import annotations

import numpy as np

from scaletrain.errors import ConfigError

LAYER_TYPES = ("sliding", "full")
# The model keys and their defaults (config.defaults()'s model section): no window, every layer full.
DEFAULTS = {"sliding_window": 0, "layer_types": ""}


def pattern(layer_types: str) -> tuple[str, ...]:
    """model.layer_types as its kinds ("sliding,full" -> ("sliding", "full")); ConfigError for an unknown one."""
    kinds = tuple(kind.strip() for kind in layer_types.split(",") if kind.strip())
    unknown = [kind for kind in kinds if kind not in LAYER_TYPES]
    if unknown:
        raise ConfigError(f"model.layer_types names unknown layer type(s) {', '.join(unknown)}: expected a "
                          f"comma-separated pattern of {' and '.join(LAYER_TYPES)}, cycled over the layers; got "
                          f"'{layer_types}'")
    return kinds


def sliding_layers(layer_types: str, num_layers: int) -> np.ndarray:
    """Whether each layer attends through the sliding window: model.layer_types cycled over the layers (empty:
    every layer full)."""
    kinds = pattern(layer_types) or ("full",)
    return np.array([kinds[i % len(kinds)] == "sliding" for i in range(num_layers)])


def check(m) -> None:
    """A window needs layers that use it and sliding layers a window; a stack that mixes the kinds carries each
    layer's kind with its index, which a group of layers scanned as one unit (model.moe_every > 1) does not."""
    slides = sliding_layers(m.layer_types, m.num_layers)
    if m.sliding_window < 0:
        raise ConfigError(f"model.sliding_window must be >= 0 (0: no window), got {m.sliding_window}")
    if slides.any() and not m.sliding_window:
        raise ConfigError(f"model.layer_types='{m.layer_types}' has sliding layers but model.sliding_window=0: set "
                          f"the window (keys a query sees, itself included)")
    if m.sliding_window and not slides.any():
        raise ConfigError(f"model.sliding_window={m.sliding_window} but no layer slides: name sliding layers in "
                          f"model.layer_types (e.g. 'sliding' for every layer, 'sliding,full' alternating)")
    if slides.any() and not slides.all() and m.num_experts and m.moe_every > 1:
        raise ConfigError(f"model.layer_types='{m.layer_types}' mixes sliding and full layers, which needs "
                          f"model.moe_every=1 (got {m.moe_every}): each scanned unit must be one layer")
    if slides.any() and not slides.all() and m.first_dense_layers:
        raise ConfigError(f"model.layer_types='{m.layer_types}' mixes sliding and full layers, which is not built "
                          f"with dense first layers (model.first_dense_layers={m.first_dense_layers}): a layer's kind "
                          f"rides with its index in one stack")
    if m.rope_local_theta and m.kv_lora_rank:
        raise ConfigError("model.rope_local_theta (a RoPE base per layer kind) is not built for latent attention "
                          "(model.kv_lora_rank > 0), whose shared RoPE key takes one table")
