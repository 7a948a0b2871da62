"""Rematerialisation policies for the scanned layer body: which named activations the backward pass finds
saved on the device, which it finds in host memory (`pinned_host`), and which it recomputes.

The names are the `checkpoint_name` tags in model code. docs/memory.md explains the policies and their costs.
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax

NAMES = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "attention_out", "out_proj", "mlp_gate",
         "mlp_up", "mlp_out", "moe_gate", "moe_up")
MODES = ("remat", "device", "offload")

_QKV = ("query_proj", "key_proj", "value_proj")
_MINIMAL = (*_QKV, "out_proj", "mlp_out")  # every projection's output but the MLP's input projections
NAMED: dict[str, Mapping[str, str]] = {  # policy -> {name: where it is kept}; names left out are recomputed
    "save_qkv_proj": {n: "device" for n in _QKV},
    "save_out_proj": {"out_proj": "device"},
    "minimal": {n: "device" for n in _MINIMAL},
    "qkv_proj_offloaded": {n: "offload" for n in _QKV},
    "minimal_offloaded": {n: "offload" for n in _MINIMAL},
}
POLICIES = ("none", "full", "save_dots", *NAMED, "custom")


def policy(name: str, custom: Mapping[str, str]) -> Callable:
    """The jax.checkpoint policy of a policy name; `custom` is {checkpoint name: remat|device|offload}."""
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable  # only the layer input (the scan carry) survives
    if name == "save_dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    modes = custom if name == "custom" else NAMED[name]
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[n for n, m in modes.items() if m == "device"],
        names_which_can_be_offloaded=[n for n, m in modes.items() if m == "offload"],
        offload_src="device", offload_dst="pinned_host")


def apply(fn: Callable, name: str, custom: tuple[tuple[str, str], ...] = (), unrolled: bool = False) -> Callable:
    """Wrap a layer body in jax.checkpoint with the named policy; 'none' keeps every activation.

    In a scan the loop keeps XLA from merging the recomputation with the forward pass, so no barrier is needed
    (prevent_cse=False lets XLA optimise across it). `unrolled` (the cost-estimate compiles, model.unroll_loops)
    has no loop: without the barrier XLA drops the recomputation as a duplicate, and the estimate would leave out
    work the scanned step does."""
    if name == "none":
        return fn
    return jax.checkpoint(fn, policy=policy(name, dict(custom)), prevent_cse=unrolled)


def around_stages(fn: Callable, name: str, custom: tuple[tuple[str, str], ...], input_name: str,
                  unrolled: bool = False) -> Callable:
    """Wrap one pipeline iteration (every stage's block of layers) in jax.checkpoint: its input, tagged
    `input_name`, is kept, and within it what the policy keeps - so the backward pass recomputes each iteration's
    layers from its input instead of keeping every layer's input for every microbatch, and a policy's saved (or
    offloaded) activations stay saved. 'none' keeps every activation: no wrap. `unrolled`: as in `apply`."""
    if name == "none":
        return fn
    keep = jax.checkpoint_policies.save_only_these_names(input_name)
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.save_from_both_policies(policy(name, dict(custom)), keep),
                          prevent_cse=unrolled)
