"""Sliding-window layers in Hugging Face configs (an Architecture with `windows`): config.json's sliding_window and
layer_types (one `sliding_attention` / `full_attention` per layer) <-> model.sliding_window and model.layer_types
(a pattern cycled over the layers: models/window.py)."""

from __future__ import annotations

from typing import Any, Callable

from scaletrain.config_window import pattern

KINDS = {"sliding_attention": "sliding", "full_attention": "full"}


def keys_in(hf: dict, refuse: Callable[[str], Exception]) -> dict[str, Any]:
    """model.sliding_window and model.layer_types of a config whose layer_types lists each layer's kind: the
    shortest pattern that, cycled, gives the list."""
    layers = hf.get("layer_types") or ["full_attention"] * hf["num_hidden_layers"]
    unknown = sorted({str(t) for t in layers} - set(KINDS))
    if unknown:
        raise refuse(f"layer_types {', '.join(unknown)}")
    if len(layers) != hf["num_hidden_layers"]:
        raise refuse(f"{len(layers)} layer_types for {hf['num_hidden_layers']} layers")
    kinds = [KINDS[t] for t in layers]
    period = next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))
    slides = "sliding" in kinds
    window = hf.get("sliding_window")
    if slides and not window:
        raise refuse("sliding layers without a sliding_window")
    return {"sliding_window": int(window) if slides else 0, "layer_types": ",".join(kinds[:period])}


def keys_out(model) -> dict[str, Any]:
    """config.json's sliding_window and layer_types for a model section."""
    kinds = pattern(model.layer_types) or ("full",)
    by_kind = {ours: theirs for theirs, ours in KINDS.items()}
    return {"sliding_window": model.sliding_window or None,
            "layer_types": [by_kind[kinds[i % len(kinds)]] for i in range(model.num_layers)]}
