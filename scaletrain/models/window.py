"""Sliding-window attention layers (model.sliding_window, model.layer_types): a sliding layer's query at
position q sees the keys at positions > q - window (itself included, as Hugging Face counts it); a full layer's
sees every earlier key.

Layers are stacked and scanned, so a stack that mixes the kinds cannot give each layer its kind as a Python value:
the layer body (transformer.Decoder.stack_inputs, decode) traces one layer for all of them. It sets the index of
the layer it runs (`at_layer`, the canonical index that rides with the stacked weights) and attention asks
`sliding`, which looks the kind up in the config's static table: a Python bool where every layer is alike, else a
traced one. Masks built in XLA take it as a value; the flash kernels, whose masks are static, choose between a
sliding and a full kernel with it (models/attention.py). With model.rope_local_theta the sliding layers rotate by
their own RoPE base: both tables ride with the per-row arrays (`rope_tables`), and each layer takes its kind's
(`layer_rope`)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from scaletrain.config_window import sliding_layers
from scaletrain.models import rope

_ACTIVE: list[jax.Array] = []  # whether the layer being traced slides (`at_layer`), innermost last


def kinds(cfg) -> np.ndarray:
    """Whether each layer of the config's stack slides."""
    return sliding_layers(cfg.layer_types, cfg.num_layers)


def mixed(cfg) -> bool:
    """Whether the stack has both sliding and full layers (so a layer's kind rides with its index)."""
    slides = kinds(cfg)
    return bool(slides.any() and not slides.all())


@contextlib.contextmanager
def at_layer(cfg, index: jax.Array | None) -> Iterator[None]:
    """Attention traced inside is layer `index`'s (a traced int, its canonical place in the stack); a no-op where
    every layer is alike (index may then be None)."""
    if not mixed(cfg):
        yield
        return
    _ACTIVE.append(jnp.asarray(kinds(cfg))[index])
    try:
        yield
    finally:
        _ACTIVE.pop()


def sliding(cfg) -> bool | jax.Array:
    """Whether the layer being traced slides: a Python bool where the stack's layers are alike, else a traced
    bool (`at_layer`'s)."""
    if not mixed(cfg):
        return bool(cfg.sliding_window)
    assert _ACTIVE, "a stack of mixed layer kinds is traced inside window.at_layer"
    return _ACTIVE[-1]


def visible(cfg, q_index: jax.Array, k_index: jax.Array) -> jax.Array | bool:
    """[t, s]: whether the window lets the query at each position see the key at each position (True where the
    layer does not slide); causality is the caller's."""
    slides = sliding(cfg)
    if slides is False:
        return True
    near = q_index[:, None] - k_index[None, :] < cfg.sliding_window
    return near if slides is True else near | ~slides


def rope_tables(cfg, positions_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """RoPE's sin and cos [b, t, head_dim / 2] for the positions; with model.rope_local_theta, [..., 2]: the full
    layers' (model.rope_theta, scaled by model.rope_scaling) and the sliding layers' (unscaled) side by side."""
    sin, cos = rope.sin_cos(positions_bt, cfg.inverse_frequencies(), cfg.rope_scale)
    if not cfg.rope_local_theta:
        return sin, cos
    local_sin, local_cos = rope.sin_cos(positions_bt,
                                        rope.inverse_frequencies(cfg.rope_dim, cfg.rope_local_theta))
    return jnp.stack([sin, local_sin], -1), jnp.stack([cos, local_cos], -1)


def layer_rope(cfg, sin: jax.Array, cos: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The RoPE tables of the layer being traced, from `rope_tables`'."""
    if not cfg.rope_local_theta:
        return sin, cos
    slides = sliding(cfg)
    if isinstance(slides, bool):
        return sin[..., int(slides)], cos[..., int(slides)]
    return jnp.where(slides, sin[..., 1], sin[..., 0]), jnp.where(slides, cos[..., 1], cos[..., 0])
