"""Named rematerialisation policies for the scanned layer body.

The names refer to `checkpoint_name` tags in model code (decoder_layer_input, query_proj, key_proj,
value_proj, attention_out, out_proj, mlp_gate, mlp_up, mlp_out).
"""

from __future__ import annotations

from typing import Callable

import jax

POLICIES: dict[str, Callable | None] = {
    "full": jax.checkpoint_policies.nothing_saveable,  # save only the layer input (the scan carry)
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs
}


def apply(fn: Callable, name: str) -> Callable:
    """Wrap a layer body in jax.checkpoint with the named policy; 'none' keeps every activation."""
    if name == "none":
        return fn
    return jax.checkpoint(fn, policy=POLICIES[name], prevent_cse=False)
