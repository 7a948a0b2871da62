"""Rotary position embeddings, with Llama-3 frequency scaling or linear scaling.

Rotate-half convention (as in the Hugging Face Llama): the first and second halves of each head are the
pair's two coordinates.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def inverse_frequencies(head_dim: int, theta: float, scaling: str = "none", factor: float = 8.0,
                        low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                        original_max_position: int = 8192) -> np.ndarray:
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling == "none":
        return inv_freq.astype(np.float32)
    if scaling == "linear":  # positions divided by `factor` (Gemma 3's global layers)
        return (inv_freq / factor).astype(np.float32)
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_max_position / low_freq_factor
    high_freq_wavelen = original_max_position / high_freq_factor
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    medium = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
    scaled = np.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return scaled.astype(np.float32)


def sin_cos(positions_bt: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    angles = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [b, t, h/2]
    return jnp.sin(angles), jnp.cos(angles)


def apply(x_btnh: jax.Array, sin_bth: jax.Array, cos_bth: jax.Array) -> jax.Array:
    """Rotate each head's (first half, second half) pairs by the position's angles, in float32."""
    x = x_btnh.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    sin, cos = sin_bth[:, :, None, :], cos_bth[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_btnh.dtype)
