"""The experts' gated unit (model.expert_activation) and their optional biases (model.expert_bias): what moe.py's
SwiGLU computes between the up and the down projections."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Unit:
    """swiglu: silu(gate) * up. clamped_swiglu (GPT-OSS, as transformers computes it): gate clamped above at
    `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    activation: str = "swiglu"
    limit: float = 7.0
    alpha: float = 1.702

    @classmethod
    def of(cls, cfg) -> "Unit":
        return cls(cfg.expert_activation, cfg.swiglu_limit, cfg.swiglu_alpha)

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        if self.activation == "swiglu":
            return jax.nn.silu(gate) * up
        gate = jnp.minimum(gate, jnp.asarray(self.limit, gate.dtype))
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * gate * jax.nn.sigmoid(gate * jnp.asarray(self.alpha, gate.dtype))


SWIGLU = Unit()  # the default: plain SwiGLU


def rows_of_groups(biases: tuple[jax.Array, ...], group_sizes: jax.Array, rows: int) -> tuple[jax.Array, ...]:
    """Each expert bias ([E, n]) per row of rows sorted by expert, `group_sizes[e]` of them expert e's (rows past
    their sum, which are padding, take zeros: whatever their gradient holds - megablox leaves it unwritten - it
    reaches no bias)."""
    experts = group_sizes.shape[0]
    expert = jnp.repeat(jnp.arange(experts), group_sizes, total_repeat_length=rows)
    expert = jnp.where(jnp.arange(rows) < jnp.sum(group_sizes), expert, experts)
    return tuple(jnp.take(b, expert, axis=0, mode="fill", fill_value=0) for b in biases)
