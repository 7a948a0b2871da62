"""The pure training step: (state, batch) -> (state, metrics), with gradient accumulation over microbatches, for
the config's objective (train/objective.py) and trainable parameters (train/trainable.py)."""

from __future__ import annotations

from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from scaletrain.models import lora
from scaletrain.parallel.pipeline import split_microbatches
from scaletrain.parallel.sharding import use_rules
from scaletrain.train import objective as objective_lib
from scaletrain.train import optim
from scaletrain.train.runner import DROPOUT_SEEDS, Runner
from scaletrain.train.trainable import Partition


@flax.struct.dataclass
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array
    # DPO's frozen copy of checkpoint.init_from's parameters (dpo.reference copy), or None. Never in a checkpoint:
    # a run reads it from init_from again when it resumes.
    reference: Any = None


Objective = objective_lib.Objective


def terms(graphdef: nnx.GraphDef, params: Any, batch: dict[str, jax.Array], runner: Runner,
          objective: Objective = objective_lib.NEXT_TOKEN) -> tuple[jax.Array, dict]:
    """What a step differentiates - the objective's summed loss plus the model's penalty for the layer stack's
    auxiliary sums (a mixture of experts' router losses, summed over the tokens like the cross-entropy so that
    microbatches add up to their batch and the step's division by the count makes them means) - and the sums its
    metrics are made of: {"loss": the summed loss, "count": what it is a mean over (tokens, pairs), "aux": the
    auxiliary sums, "head": the objective's own}."""
    model = nnx.merge(graphdef, params)
    total, aux, head = runner.loss(graphdef, params, batch, model.penalty, objective)
    return total + model.penalty(aux), {"loss": total, "count": objective.count(batch), "aux": aux, "head": head}


def loss_sum(graphdef: nnx.GraphDef, params: Any, batch: dict[str, jax.Array], runner: Runner = Runner(),
             objective: Objective = objective_lib.NEXT_TOKEN) -> tuple[jax.Array, jax.Array]:
    """The summed loss of a batch and what it is a mean over (tokens, or DPO's pairs)."""
    _, sums = terms(graphdef, params, batch, runner, objective)
    return sums["loss"], sums["count"]


def with_reference(kind: str, graphdef: nnx.GraphDef, runner: Runner, parts: Partition,
                   fetch_params: Callable) -> Callable:
    """(params, reference, batch) -> the batch with DPO's reference log-probs per token (`ref_logprobs`), from a
    forward pass of the reference's parameters: the frozen copy (`copy`), or the policy's own with its adapters at
    zero (`adapters_off`: LoRA's base, the only model copy). The batch as it is without a reference, or with the
    data's (`precomputed`). objective.reference_kind names the kind."""
    def add(params: Any, reference: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        if kind in ("", "precomputed"):
            return batch
        if kind == "copy":
            weights = reference
        else:
            trained, frozen = parts.split(params)
            weights = fetch_params(parts.join(jax.tree.map(jnp.zeros_like, trained), frozen))
        logprobs = -runner.token_losses(graphdef, weights, batch)
        return batch | {"ref_logprobs": jax.lax.stop_gradient(logprobs)}

    return add


def make_eval_step(graphdef: nnx.GraphDef, runner: Runner, fetch_params: Callable | None, mesh, rules,
                   objective: Objective = objective_lib.NEXT_TOKEN, reference: Callable | None = None) -> Callable:
    """(params, batch, reference) -> (summed loss, count): the training loss of a batch, without its gradient.
    `fetch_params` brings parameters kept in host memory to the device (optim.Update.fetch_params); `reference`
    adds DPO's reference log-probs (with_reference)."""
    fetch = fetch_params or (lambda p: p)

    def eval_step(params: Any, batch: dict[str, jax.Array], ref: Any = None) -> tuple[jax.Array, jax.Array]:
        with use_rules(mesh, rules):
            if reference is not None:
                batch = reference(params, ref, batch)
            return loss_sum(graphdef, fetch(params), batch, runner, objective)

    return eval_step


def make_logprobs(graphdef: nnx.GraphDef, runner: Runner, fetch_params: Callable | None, mesh, rules) -> Callable:
    """(params, batch) -> each position's log-prob of its target [b, t], a forward pass alone: what `data
    reference` stores as DPO's reference log-probs (tools/reference.py), computed as the step computes them."""
    fetch = fetch_params or (lambda p: p)

    def logprobs(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        with use_rules(mesh, rules):
            return -runner.token_losses(graphdef, fetch(params), batch)

    return logprobs


def make_train_step(graphdef: nnx.GraphDef, runner: Runner, update: optim.Update, lr: optax.Schedule,
                    grad_clip_norm: float, grad_accum_steps: int, mesh, rules, grad_shardings: Any,
                    parts: Partition = Partition(), objective: Objective = objective_lib.NEXT_TOKEN,
                    reference: Callable | None = None, dropout: bool = False) -> Callable:
    """(state, batch, loss ceiling) -> (state, metrics). `rules` is a sharding.Rules; `grad_shardings` places
    gradients per the preset (ZeRO-2: scattered). `parts` splits the parameters into those trained - the only
    ones differentiated, the optimizer's - and the frozen (LoRA's base). `reference` adds DPO's reference
    log-probs to each microbatch (with_reference). `dropout`: LoRA's adapters drop their input (lora.dropout):
    each token's seed, from the state's key and step, joins the batch."""
    fetch_params = update.fetch_params or (lambda p: p)
    grad_fn = jax.value_and_grad(
        lambda trained, frozen, b: terms(graphdef, fetch_params(parts.join(trained, frozen)), b, runner, objective),
        has_aux=True)

    def place(grads):
        return jax.lax.with_sharding_constraint(grads, grad_shardings)

    def step(state: TrainState, batch: dict[str, jax.Array], loss_ceiling: jax.Array) -> tuple[TrainState, dict]:
        trained, frozen = parts.split(state.params)
        if dropout:
            key = jax.random.bits(jax.random.fold_in(state.rng, state.step), (), jnp.uint32)
            batch = batch | {DROPOUT_SEEDS: lora.token_seeds(key, batch["segment_ids"], batch["positions"])}

        def referenced(b):
            return b if reference is None else reference(state.params, state.reference, b)

        with use_rules(mesh, rules):
            if grad_accum_steps == 1:
                (total, sums), grads = grad_fn(trained, frozen, referenced(batch))
                grads = place(grads)
            else:
                def accumulate(carry, micro):
                    (m_total, m_sums), m_grads = grad_fn(trained, frozen, referenced(micro))
                    total, sums, grads = carry
                    return (total + m_total, jax.tree.map(jnp.add, sums, m_sums),
                            place(update.add(grads, m_grads))), None

                zeros = place(update.zeros(trained))
                micro = jax.tree.map(lambda x: split_microbatches(x, grad_accum_steps), batch)
                first = jax.tree.map(lambda x: x[0], micro)
                shapes = jax.eval_shape(lambda: terms(graphdef, fetch_params(state.params), referenced(first), runner,
                                                      objective)[1])
                no_sums = jax.tree.map(jnp.zeros_like, shapes)
                (total, sums, grads), _ = jax.lax.scan(accumulate, (jnp.zeros(()), no_sums, zeros), micro)
        # `grads` are sums over tokens: the mean is folded into the scale the update applies, so no
        # normalised copy of the gradients is ever written.
        count = jnp.maximum(sums["count"], 1.0)
        # `loss` is the objective's alone (the router's losses are logged beside it); the update's gate checks
        # the whole sum differentiated.
        loss, grad_norm = sums["loss"] / count, update.norm(grads) / count
        # A NaN/Inf loss or gradient never reaches the parameters or Adam's moments: that update is dropped
        # (the trainer then goes on or stops, per train.on_nonfinite), so every checkpoint holds a good state.
        # So is one whose loss is above the ceiling the trainer passes (train.spike.action=skip; else inf).
        keep = jnp.isfinite(total) & jnp.isfinite(grad_norm) & (loss <= loss_ceiling)
        grad_scale = optim.clip_scale(grad_norm, grad_clip_norm) / count
        trained, opt_state = update.apply(grads, grad_scale, keep, state.opt_state, trained)
        model = nnx.merge(graphdef, state.params)
        # What the model moves itself, outside the gradient, from the step's sums (DeepSeek's router bias).
        units = model.cfg.stack_layers // model.unit_layers(model.cfg)
        params = model.after_update(parts.join(trained, frozen), sums["aux"], keep, runner.memory_order(units))
        metrics = {"loss": loss, "grad_norm": grad_norm, "learning_rate": lr(state.step),
                   "update_skipped": (~keep).astype(jnp.float32)}
        metrics |= model.aux_metrics(sums["aux"]) | objective.metrics(sums["head"], count)
        return state.replace(params=params, opt_state=opt_state, step=state.step + 1), metrics

    return step
