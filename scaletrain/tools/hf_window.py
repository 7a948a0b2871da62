"""config.json's layer_types and sliding_window <-> model.layer_types and model.sliding_window, for the
architectures that read and write them (Architecture.windows). Hugging Face lists every layer's kind
(sliding_attention | full_attention); scaletrain keeps the shortest pattern that, cycled, gives the list."""

from __future__ import annotations

from typing import Any

from scaletrain import config_window

KINDS = {"sliding_attention": "sliding", "full_attention": "full"}


def keys_in(hf: dict, refuse) -> dict[str, Any]:
    """model.layer_types and model.sliding_window of a config.json; `refuse(what)` the error for a kind scaletrain
    has not."""
    listed = list(hf.get("layer_types") or ())
    unknown = sorted({kind for kind in listed if kind not in KINDS})
    if unknown:
        raise refuse(f"layer_types {', '.join(map(str, unknown))}")
    kinds = [KINDS[kind] for kind in listed]
    if "sliding" not in kinds:
        return {"layer_types": "", "sliding_window": 0}
    if not hf.get("sliding_window"):
        raise refuse("sliding_attention layers without a sliding_window")
    period = next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))
    return {"layer_types": ",".join(kinds[:period]), "sliding_window": hf["sliding_window"]}


def keys_out(model) -> dict[str, Any]:
    """config.json's layer_types (every layer's) and sliding_window (null without sliding layers)."""
    slides = config_window.sliding_layers(model.layer_types, model.num_layers)
    return {"layer_types": ["sliding_attention" if s else "full_attention" for s in slides],
            "sliding_window": model.sliding_window if slides.any() else None}
