"""RoPE's settings in a Hugging Face config.json: read into model.* keys and written back (the shared reading; a
family with its own, Gemma 3's per layer kind, gives Architecture.rope_keys)."""

from __future__ import annotations

from typing import Any

# rope_parameters / rope_scaling key -> model.* key, for rope_type llama3.
LLAMA3_ROPE_KEYS = (("factor", "rope_scaling_factor"), ("low_freq_factor", "rope_low_freq_factor"),
                    ("high_freq_factor", "rope_high_freq_factor"),
                    ("original_max_position_embeddings", "rope_original_max_position"))
# rope_parameters / rope_scaling key -> model.* key, for rope_type yarn (its factor and original context as llama3's).
YARN_ROPE_KEYS = (("factor", "rope_scaling_factor"), ("original_max_position_embeddings", "rope_original_max_position"),
                  ("beta_fast", "rope_beta_fast"), ("beta_slow", "rope_beta_slow"), ("mscale", "rope_mscale"),
                  ("mscale_all_dim", "rope_mscale_all_dim"), ("attention_factor", "rope_attention_factor"),
                  ("truncate", "rope_truncate"))


def keys_in(hf: dict, refuse) -> dict[str, Any]:
    """transformers 5 writes the rope settings as rope_parameters (theta included), earlier versions as rope_theta
    and rope_scaling; rope_parameters wins where both are present, as in transformers."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in rope.values()):
        raise refuse("rope parameters per attention type")
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind not in ("default", "llama3", "yarn", "linear"):
        raise refuse(f"rope_type {kind}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse(f"partial_rotary_factor={rope['partial_rotary_factor']}")
    keys = {"rope_theta": rope.get("rope_theta", hf.get("rope_theta", 10000.0))}
    if kind == "llama3":
        missing = [theirs for theirs, _ in LLAMA3_ROPE_KEYS if theirs not in rope]
        if missing:
            raise refuse(f"rope_type llama3 without {', '.join(missing)}")
        keys |= {"rope_scaling": "llama3", **{ours: rope[theirs] for theirs, ours in LLAMA3_ROPE_KEYS}}
    if kind == "yarn":
        if rope.get("factor") is None or rope.get("original_max_position_embeddings") is None:
            raise refuse("rope_type yarn without factor and original_max_position_embeddings")
        # transformers reads an unset (null) one as its default, as the model.* defaults are
        keys |= {"rope_scaling": "yarn", **{ours: rope[theirs] for theirs, ours in YARN_ROPE_KEYS
                                            if rope.get(theirs) is not None}}
    if kind == "linear":
        keys |= {"rope_scaling": "linear", "rope_scaling_factor": rope["factor"]}
    return keys


def scaling_out(model) -> dict | None:
    """config.json's rope_scaling for the model's (None: unscaled)."""
    if model.rope_scaling == "llama3":
        return {"rope_type": "llama3", **{theirs: model[ours] for theirs, ours in LLAMA3_ROPE_KEYS}}
    if model.rope_scaling == "yarn":  # the unset (0) magnitudes left out, as transformers reads them
        return {"rope_type": "yarn", **{theirs: model[ours] for theirs, ours in YARN_ROPE_KEYS
                                        if model[ours] or model[ours] is False}}
    if model.rope_scaling == "linear":
        return {"rope_type": "linear", "factor": model.rope_scaling_factor}
    return None
