"""Rotary position embeddings, with Llama-3, YaRN or linear frequency scaling.

Rotate-half convention (as in the Hugging Face Llama): the first and second halves of each head are the
pair's two coordinates.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


def inverse_frequencies(head_dim: int, theta: float, scaling: str = "none", factor: float = 8.0,
                        low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                        original_max_position: int = 8192, yarn: "Yarn | None" = None) -> np.ndarray:
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling == "none":
        return inv_freq.astype(np.float32)
    if scaling == "yarn":
        return _yarn(inv_freq, head_dim, theta, factor, original_max_position, yarn or Yarn())
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


def sin_cos(positions_bt: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """sin and cos of the angles [b, t, h/2], times `scale` (YaRN's attention factor)."""
    angles = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [b, t, h/2]
    if scale == 1.0:
        return jnp.sin(angles), jnp.cos(angles)
    return jnp.sin(angles) * scale, jnp.cos(angles) * scale


def apply(x_btnh: jax.Array, sin_bth: jax.Array, cos_bth: jax.Array) -> jax.Array:
    """Rotate each head's (first half, second half) pairs by the position's angles, in float32."""
    x = x_btnh.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    sin, cos = sin_bth[:, :, None, :], cos_bth[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_btnh.dtype)


# YaRN (Peng et al. 2023), as transformers' rope init function "yarn" computes it.


@dataclasses.dataclass(frozen=True)
class Yarn:
    """YaRN's settings beside the factor and the original context (model.rope_*): the rotation counts that bound
    the band interpolated between scaled and unscaled frequencies, whether that band's ends are rounded outwards
    to whole dims (`truncate`; GPT-OSS keeps them fractional), and the attention magnitude: `mscale` and
    `mscale_all_dim` (0: unset), or an explicit `attention_factor` (0: derived from them)."""

    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float = 0.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """0.1 mscale ln(factor) + 1: the magnitude YaRN restores to attention logits at `factor` (1 unscaled)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(factor: float, yarn: Yarn) -> float:
    """What cos and sin are multiplied by (so the logits by its square): explicit, or the ratio of the two
    mscales where both are set (DeepSeek's 1: its magnitude goes into the softmax scale instead), else
    yarn_mscale(factor)."""
    if yarn.attention_factor:
        return yarn.attention_factor
    if yarn.mscale and yarn.mscale_all_dim:
        return yarn_mscale(factor, yarn.mscale) / yarn_mscale(factor, yarn.mscale_all_dim)
    return yarn_mscale(factor)


def _yarn(inv_freq: np.ndarray, dim: int, theta: float, factor: float, original_max_position: int,
          yarn: Yarn) -> np.ndarray:
    """Dims that turn fewer than beta_slow times over the original context are interpolated (divided by
    `factor`), those that turn more than beta_fast times kept, a linear ramp between."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    # float32 as transformers computes the ramp and the blend
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    keep = 1 - ramp
    inv32 = inv_freq.astype(np.float32)
    return (inv32 / np.float32(factor) * (1 - keep) + inv32 * keep).astype(np.float32)
