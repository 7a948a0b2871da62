"""What `convert to-hf` refuses before it writes an architecture: a model whose pieces the architecture has not
(Architecture.features: GPT-OSS's sinks and biases, say, on a model exported as Mixtral), or sliding-window
layers where it has none, or another architecture's own keys (Architecture.own_keys: Gemma's)."""

from __future__ import annotations

import json

from scaletrain import config as config_lib
from scaletrain import models
from scaletrain.errors import UserError
from scaletrain.models.family import Architecture


def check(model, arch: str, facts: Architecture) -> None:
    """UserError where the model's feature keys (every architecture's Architecture.features) are not what `arch`
    has - its own at their values, the others' at their defaults - or where it slides and `arch` does not."""
    defaults = config_lib.defaults().model
    for _, other in models.architectures().values():
        for key in other.features:
            want = facts.features.get(key, defaults[key])
            if key != "family" and model[key] != want:
                raise UserError(f"model.{key}={json.dumps(model[key])}: Hugging Face's {arch} has {key} "
                                f"{json.dumps(want)}")
    if model.sliding_window and not facts.windows:
        raise UserError(f"model.sliding_window={model.sliding_window}: Hugging Face's {arch} has no sliding-window "
                        f"layers")
    kept = [f"model.{key}={model[key]}" for _, other in models.architectures().values() for key in other.own_keys
            if key not in facts.own_keys and model[key] != defaults[key]]
    if kept:  # another architecture's own keys (Gemma's pieces) off their defaults
        raise UserError(f"Hugging Face's {arch} cannot represent {', '.join(kept)}")
