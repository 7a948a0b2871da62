"""The optimizer: AdamW with warmup + cosine decay, global-norm clipping and masked weight decay.

Clipping is a scale the step computes from the gradient norm it reports anyway (`clip_scale`), applied where
the update reads the gradients, rather than a transformation in the optax chain: what `make` returns is then
elementwise, which lets `offload.streamed_update` apply it a layer at a time, and no clipped copy of the
gradients is ever written.

Adam's moments are kept in `optim.moment_dtype` whatever the parameters' dtype (`moments_in`): bfloat16 parameters
with float32 moments is the usual mixed-precision state (2 + 4 + 4 bytes a parameter).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from scaletrain.models.routing import ROUTER_BIAS
from scaletrain.models.transformer import STACKS
from scaletrain.parallel.sharding import is_logical


def schedule(optim_cfg, steps: int) -> optax.Schedule:
    """Linear warmup from 0 to the peak, then cosine decay to peak * min_lr_ratio at optim.schedule_steps - or at
    `steps`, the run's, where that is 0 - after which the rate stays there."""
    length = optim_cfg.schedule_steps or steps
    warmup = min(optim_cfg.warmup_steps, length)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=optim_cfg.learning_rate, warmup_steps=warmup,
        decay_steps=max(length, warmup + 1), end_value=optim_cfg.learning_rate * optim_cfg.min_lr_ratio)


# The config keys the learning-rate schedule reads.
SCHEDULE_KEYS = ("steps", "optim.schedule_steps", "optim.learning_rate", "optim.warmup_steps", "optim.min_lr_ratio")


def schedule_change(then: dict, now: dict, step: int) -> tuple[str, bool] | None:
    """How resuming at `step` changes the learning-rate schedule, as (one line naming each changed key's old and
    new value and the rate the next step takes under each, whether that rate changed); None when no key of
    SCHEDULE_KEYS changed. `then` and `now`: configs as dicts (a checkpoint's metadata, cfg.to_dict()); a key
    `then` lacks was not there yet (optim.schedule_steps: 0)."""
    def value(tree: dict, key: str):
        *parents, leaf = key.split(".")
        for part in parents:
            tree = tree.get(part, {})
        return tree.get(leaf, 0 if key == "optim.schedule_steps" else None)

    if any(value(then, k) is None for k in SCHEDULE_KEYS):
        return None  # saved before the schedule had these keys: nothing to compare
    changed = [(k, value(then, k), value(now, k)) for k in SCHEDULE_KEYS if value(then, k) != value(now, k)]
    if not changed:
        return None

    def rate(tree: dict) -> float:
        optim_cfg = types.SimpleNamespace(**{k.removeprefix("optim."): value(tree, k) for k in SCHEDULE_KEYS[1:]})
        return float(schedule(optim_cfg, value(tree, "steps"))(step))  # what step `step + 1` takes (lr(state.step))

    def length(tree: dict) -> int:
        return value(tree, "optim.schedule_steps") or value(tree, "steps")

    before, after = rate(then), rate(now)
    line = (f"{', '.join(f'{k} {old} -> {new}' for k, old, new in changed)}: the learning rate from step {step + 1} "
            + (f"is {after:.3g}, as before" if after == before else f"is {after:.3g}, not {before:.3g}"))
    if after != before and length(now) != length(then):
        line += f" (optim.schedule_steps={length(then)} keeps the schedule's old length)"
    return line, after != before


def decay_mask(optim_cfg, logical: Any) -> Any:
    """True where weight decay applies, told by logical axes: norm gains hold only `embed` (or `head_dim`, per
    head QK norms; `latent`, latent attention's), per layer; embeddings and the output projection hold `vocab`; a
    router's selection bias is never decayed."""

    def decays(names: tuple[str | None, ...]) -> bool:
        dims = tuple(n for n in names if n not in STACKS)
        if dims in (("embed",), ("head_dim",), ("latent",)):  # RMSNorm gains, QK and latent norms' included
            return optim_cfg.decay_norms
        if "vocab" in dims:
            return optim_cfg.decay_embeddings
        if dims == (ROUTER_BIAS,):  # no gradient, moved by its own rule (models/routing.py)
            return False
        return True

    return jax.tree.map(decays, logical, is_leaf=is_logical)


def moments_in(dtype: Any, tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` (elementwise, its state's floating leaves moments shaped like the parameters: Adam's) with that
    state in `dtype`, whatever the parameters' dtype, and kept in it.

    `init` gives `tx` the parameters cast to `dtype`, a leaf at a time: optax.tree_utils.tree_map_params calls it on
    a placeholder that is a pytree without leaves, which a tree_map passes through (and which has no `.astype`).
    `update` computes in the wider of the gradients' dtype and `dtype` (float32 moments of bfloat16 parameters:
    float32 arithmetic), then casts every state leaf back to the dtype it had (optax's scale_by_adam keeps only
    mu's: float32 squares added to a bfloat16 nu would promote it, and the jitted step, which donates the state
    and fixes its out_shardings, needs the state's dtypes unchanged). The updates stay in the wider dtype:
    optax.apply_updates rounds parameter + update to the parameters' dtype once.
    With float32 everywhere every cast is the identity: the same program as `tx` alone."""

    def wide(tree: Any) -> Any:
        return jax.tree.map(lambda x: x.astype(jnp.promote_types(x.dtype, dtype)), tree)

    def init(params: Any) -> Any:
        return tx.init(jax.tree.map(lambda p: p.astype(dtype), params))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        new_updates, new_state = tx.update(wide(updates), state, None if params is None else wide(params))
        return new_updates, jax.tree.map(lambda new, old: new.astype(old.dtype), new_state, state)

    return optax.GradientTransformation(init, update)


def make(optim_cfg, steps: int, logical: Any) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW, elementwise (see the module docstring), its moments in `optim.moment_dtype`; clipping is
    `clip_scale`'s."""
    lr = schedule(optim_cfg, steps)
    adamw = optax.adamw(lr, b1=optim_cfg.b1, b2=optim_cfg.b2, eps=optim_cfg.eps,
                        weight_decay=optim_cfg.weight_decay, mask=decay_mask(optim_cfg, logical))
    return moments_in(jnp.dtype(optim_cfg.moment_dtype), adamw), lr


def clip_scale(norm: jax.Array, max_norm: float) -> jax.Array:
    """The factor optax.clip_by_global_norm multiplies the gradients by; max_norm 0 turns clipping off."""
    if max_norm <= 0:
        return jnp.ones(())
    return jnp.where(norm < max_norm, 1.0, max_norm / norm)


def scaled(grads: Any, grad_scale: jax.Array) -> Any:
    return jax.tree.map(lambda g: g * grad_scale.astype(g.dtype), grads)


def kept(keep: jax.Array, new: Any, old: Any) -> Any:
    """`new` where the step keeps its update, else `old`: a NaN/Inf (or a loss spike's update, skipped) never
    reaches parameters or moments."""
    return jax.tree.map(lambda n, o: jnp.where(keep, n, o), new, old)


def update(tx: optax.GradientTransformation, grads: Any, grad_scale: jax.Array, keep: jax.Array, opt_state: Any,
           params: Any) -> tuple[Any, Any]:
    """One optimizer update of the whole state on the device: (params, opt_state)."""
    updates, new_opt_state = tx.update(scaled(grads, grad_scale), opt_state, params)
    return kept(keep, (optax.apply_updates(params, updates), new_opt_state), (params, opt_state))


@dataclasses.dataclass(frozen=True)
class Update:
    """How the step updates the state: `on_device`, or offload.streamed when state lives in host memory."""
    apply: Callable[..., tuple[Any, Any]]  # (grads, grad_scale, keep, opt_state, params) -> (params, opt_state)
    norm: Callable[[Any], jax.Array] = optax.tree.norm
    # With parameters in host memory: the model's view of them, fetched to the device where used (their
    # gradients land in host memory).
    fetch_params: Callable[[Any], Any] | None = None
    # Gradient accumulation's running sum: its zeros, shaped like the parameters, and a microbatch's gradients
    # added to it - wherever the gradients live.
    zeros: Callable[[Any], Any] = functools.partial(jax.tree.map, jnp.zeros_like)
    add: Callable[[Any, Any], Any] = functools.partial(jax.tree.map, jnp.add)


def on_device(tx: optax.GradientTransformation) -> Update:
    return Update(apply=functools.partial(update, tx))
