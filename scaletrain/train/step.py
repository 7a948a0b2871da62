"""The pure training step: (state, batch) -> (state, metrics), with gradient accumulation over microbatches."""

from __future__ import annotations

from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from scaletrain.parallel.pipeline import split_microbatches
from scaletrain.parallel.sharding import use_rules
from scaletrain.train import optim
from scaletrain.train.runner import Runner
from scaletrain.train.trainable import Partition


@flax.struct.dataclass
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array


def objective(graphdef: nnx.GraphDef, params: Any, batch: dict[str, jax.Array],
              runner: Runner) -> tuple[jax.Array, dict]:
    """What a step differentiates - the summed cross-entropy plus the model's penalty for the layer stack's
    auxiliary sums (a mixture of experts' router losses, summed over the tokens like the cross-entropy so that
    microbatches add up to their batch and the step's division by the token count makes them means) - and the
    sums its metrics are made of: {"loss": the summed cross-entropy, "count": its tokens, "aux": the auxiliary
    sums}."""
    model = nnx.merge(graphdef, params)
    total, aux = runner.loss(graphdef, params, batch, model.penalty)
    return total + model.penalty(aux), {"loss": total, "count": jnp.sum(batch["loss_mask"]), "aux": aux}


def loss_sum(graphdef: nnx.GraphDef, params: Any, batch: dict[str, jax.Array],
             runner: Runner = Runner()) -> tuple[jax.Array, jax.Array]:
    """The summed cross-entropy of a batch and the number of tokens it sums over."""
    _, sums = objective(graphdef, params, batch, runner)
    return sums["loss"], sums["count"]


def make_eval_step(graphdef: nnx.GraphDef, runner: Runner, fetch_params: Callable | None, mesh, rules) -> Callable:
    """(params, batch) -> (summed loss, token count): the training loss (the cross-entropy) of a batch, without
    its gradient. `fetch_params` brings parameters kept in host memory to the device (optim.Update.fetch_params)."""

    def eval_step(params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        with use_rules(mesh, rules):
            return loss_sum(graphdef, params if fetch_params is None else fetch_params(params), batch, runner)

    return eval_step


def make_train_step(graphdef: nnx.GraphDef, runner: Runner, update: optim.Update, lr: optax.Schedule,
                    grad_clip_norm: float, grad_accum_steps: int, mesh, rules, grad_shardings: Any,
                    parts: Partition = Partition()) -> Callable:
    """(state, batch, loss ceiling) -> (state, metrics). `rules` is a sharding.Rules; `grad_shardings` places
    gradients per the preset (ZeRO-2: scattered). `parts` splits the parameters into those trained - the only
    ones differentiated, the optimizer's - and the frozen (LoRA's base)."""
    fetch_params = update.fetch_params or (lambda p: p)
    grad_fn = jax.value_and_grad(
        lambda trained, frozen, b: objective(graphdef, fetch_params(parts.join(trained, frozen)), b, runner),
        has_aux=True)

    def place(grads):
        return jax.lax.with_sharding_constraint(grads, grad_shardings)

    def step(state: TrainState, batch: dict[str, jax.Array], loss_ceiling: jax.Array) -> tuple[TrainState, dict]:
        trained, frozen = parts.split(state.params)
        with use_rules(mesh, rules):
            if grad_accum_steps == 1:
                (total, sums), grads = grad_fn(trained, frozen, batch)
                grads = place(grads)
            else:
                def accumulate(carry, micro):
                    (m_total, m_sums), m_grads = grad_fn(trained, frozen, micro)
                    total, sums, grads = carry
                    return (total + m_total, jax.tree.map(jnp.add, sums, m_sums),
                            place(update.add(grads, m_grads))), None

                zeros = place(update.zeros(trained))
                micro = jax.tree.map(lambda x: split_microbatches(x, grad_accum_steps), batch)
                first = jax.tree.map(lambda x: x[0], micro)
                shapes = jax.eval_shape(lambda: objective(graphdef, fetch_params(state.params), first, runner)[1])
                no_sums = jax.tree.map(jnp.zeros_like, shapes)
                (total, sums, grads), _ = jax.lax.scan(accumulate, (jnp.zeros(()), no_sums, zeros), micro)
        # `grads` are sums over tokens: the mean is folded into the scale the update applies, so no
        # normalised copy of the gradients is ever written.
        count = jnp.maximum(sums["count"], 1.0)
        # `loss` is the cross-entropy alone (the router's losses are logged beside it); the update's gate
        # checks the whole objective.
        loss, grad_norm = sums["loss"] / count, update.norm(grads) / count
        # A NaN/Inf loss or gradient never reaches the parameters or Adam's moments: that update is dropped
        # (the trainer then goes on or stops, per train.on_nonfinite), so every checkpoint holds a good state.
        # So is one whose loss is above the ceiling the trainer passes (train.spike.action=skip; else inf).
        keep = jnp.isfinite(total) & jnp.isfinite(grad_norm) & (loss <= loss_ceiling)
        grad_scale = optim.clip_scale(grad_norm, grad_clip_norm) / count
        trained, opt_state = update.apply(grads, grad_scale, keep, state.opt_state, trained)
        params = parts.join(trained, frozen)
        metrics = {"loss": loss, "grad_norm": grad_norm, "learning_rate": lr(state.step),
                   "update_skipped": (~keep).astype(jnp.float32)}
        metrics |= nnx.merge(graphdef, state.params).aux_metrics(sums["aux"])
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1, rng=state.rng), metrics

    return step
