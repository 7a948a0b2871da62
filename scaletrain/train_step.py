"""The pure training step: (state, batch) -> (state, metrics), with gradient accumulation over microbatches."""

from __future__ import annotations

from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from scaletrain import optim, pipeline, pipeline_1f1b
from scaletrain.pipeline import split_microbatches
from scaletrain.model import moe
from scaletrain.loss import blocked_linear_cross_entropy, cross_entropy, linear_cross_entropy, vocab_chunk
from scaletrain.sharding import active_device, use_rules, ways

# The CPU's fast path for the output projection + loss (loss.linear_cross_entropy); False: always the plain
# path, its slow twin in tests.
FUSED_LOSS = True


@flax.struct.dataclass
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array


def loss_sum(graphdef: nnx.GraphDef, params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Summed masked next-token cross-entropy, and the number of tokens it sums over."""
    total, count, _ = _losses(graphdef, params, batch)
    return total, count


def _losses(graphdef, params, batch):
    """(`loss_sum`'s two, the router statistics of a mixture of experts [moe layers, ...] or None)."""
    model = nnx.merge(graphdef, params)
    rows = (batch["targets"], batch["loss_mask"])
    count = jnp.sum(batch["loss_mask"])
    if model.cfg.pipeline_schedule == "1f1b":
        return _one_f_one_b_loss(graphdef, params, model, batch, rows), count, None
    x_btd, router = model.hidden_and_router(batch["tokens"], batch["positions"], batch["segment_ids"])
    return _stream_loss(graphdef, params, x_btd, *rows), count, router


def objective(graphdef: nnx.GraphDef, params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
    """What a step differentiates, and the sums its metrics are made of: {"loss": the summed cross-entropy,
    "count": its tokens} and, for a mixture of experts, the router's (`_router_sums`). A mixture of experts adds
    router_aux_loss x its load-balancing loss + router_z_loss x its z-loss, each summed over the tokens like the
    cross-entropy (and averaged over the MoE layers), so that microbatches add up to their batch and the step's
    division by the count makes both per-token means."""
    total, count, router = _losses(graphdef, params, batch)
    sums = {"loss": total, "count": count}
    if router is None:
        return total, sums
    cfg = nnx.merge(graphdef, params).cfg
    sums |= _router_sums(router, batch["tokens"].size)
    penalty = cfg.router_aux_loss * sums["router_aux"] + cfg.router_z_loss * sums["router_z"]
    return total + penalty / router.shape[0], sums


def _router_sums(router: jax.Array, tokens: int) -> dict:
    """The router statistics (moe.stats_size's per layer) as sums that add up over microbatches."""
    return {"router_aux": jnp.sum(router[:, moe.AUX]), "router_z": jnp.sum(router[:, moe.Z]),
            "router_dropped": jnp.sum(router[:, moe.DROPPED]), "router_load": router[:, moe.LOAD:],
            "router_tokens": jnp.float32(tokens * router.shape[0])}


def router_metrics(sums: dict) -> dict:
    """What metrics.jsonl logs of the router: its two losses (means over tokens and MoE layers), the busiest
    expert's load over the mean load (1 when balanced; the worst layer's), and the share of assignments dropped
    for want of capacity."""
    load = sums["router_load"]
    return {"router_aux_loss": sums["router_aux"] / sums["router_tokens"],
            "router_z_loss": sums["router_z"] / sums["router_tokens"],
            "expert_load_max": jnp.max(jnp.max(load, axis=1) / jnp.maximum(jnp.mean(load, axis=1), 1e-9)),
            "dropped_fraction": sums["router_dropped"] / jnp.sum(load)}


def _one_f_one_b_loss(graphdef, params, model, batch, rows) -> jax.Array:
    """The layer stack as a 1F1B pipeline, which runs the head on each microbatch as it leaves the last stage."""
    cfg = model.cfg
    x_btd, body, stacked, extras = model.stack_inputs(batch["tokens"], batch["positions"], batch["segment_ids"])

    def stage(stacked, x_btd, extras):
        return pipeline.scan(body, x_btd, stacked, extras, cfg.unroll_loops)

    def head(head_params, layers, x_btd, rows):
        p = {**head_params, "layers": nnx.to_pure_dict(layers)}
        return _stream_loss(graphdef, p, nnx.merge(graphdef, p).final_stream(x_btd), *rows)

    head_params = {k: v for k, v in params.items() if k != "layers"}
    return pipeline_1f1b.loss(stage, head, cfg.pipeline_stages, cfg.pipeline_microbatches, cfg.pipeline_gather_once,
                              cfg.unroll_loops, x_btd, stacked, head_params, extras, rows)


def _stream_loss(graphdef: nnx.GraphDef, params: Any, x_btd: jax.Array, targets_bt: jax.Array,
                 mask_bt: jax.Array) -> jax.Array:
    """The summed loss of `hidden`'s stream through the output projection.

    With model.logits_block, the float32 logits - at Llama 3's vocabulary the largest activation by far - exist
    one block of positions at a time: loss.blocked_linear_cross_entropy forms each block's gradient as it goes
    (an untied output projection of the normalised stream); otherwise each block's projection and loss is a
    checkpointed step of a scan, and the backward pass recomputes that block's logits."""
    model = nnx.merge(graphdef, params)

    def block_loss(params, x_btd, targets_bt, mask_bt):
        return jnp.sum(cross_entropy(nnx.merge(graphdef, params).logits(x_btd), targets_bt) * mask_bt)

    block, seq = model.cfg.logits_block, x_btd.shape[1]
    if (not block or block >= seq) and _fused_loss(model, x_btd):
        return linear_cross_entropy(x_btd, model.lm_head[...], targets_bt, mask_bt.astype(jnp.float32),
                                    vocab_chunk(model.cfg.vocab_size))
    if not block or block >= seq:
        return block_loss(params, x_btd, targets_bt, mask_bt)

    if projects_the_stream(model.cfg):
        return blocked_linear_cross_entropy(x_btd, model.lm_head[...], targets_bt, mask_bt.astype(jnp.float32),
                                            block, model.cfg.unroll_loops)

    def blocks(a):  # [b, t, ...] -> [t / block, b, block, ...]: a view along the unsharded sequence
        return a.reshape(a.shape[0], seq // block, block, *a.shape[2:]).swapaxes(0, 1)

    recomputed = jax.checkpoint(block_loss)
    total, _ = jax.lax.scan(lambda total, xs: (total + recomputed(params, *xs), None), jnp.zeros((), jnp.float32),
                            (blocks(x_btd), blocks(targets_bt), blocks(mask_bt)), unroll=model.cfg.unroll_loops)
    return total


def projects_the_stream(cfg) -> bool:
    """Whether the logits are `hidden`'s stream times lm_head, nothing else (untied, the final norm applied
    before): what the fused losses compute. FUSED_LOSS False keeps the plain paths, their twins in tests."""
    return FUSED_LOSS and not cfg.tie_embeddings and cfg.norm == "standard"


def _fused_loss(model, x_btd) -> bool:
    """Whether the whole sequences' loss takes loss.linear_cross_entropy: on CPU, where it saves the passes
    over the [tokens, vocab] logits (10-25% over the projection's matmuls per device, docs/benchmarks.md), for a
    float32 untied output projection of the standard-norm stream over an unsharded vocabulary. Elsewhere (TPU,
    GPU) whole sequences take the plain path - its logits stay one fused XLA pass, and no measurement there
    backs the change - and model.logits_block the blocked fused one."""
    cfg = model.cfg
    return (projects_the_stream(cfg) and active_device().platform == "cpu" and x_btd.dtype == jnp.float32
            and ways("vocab") == 1 and vocab_chunk(cfg.vocab_size) >= 128)


def make_eval_step(graphdef: nnx.GraphDef, fetch_params: Callable | None, mesh, rules) -> Callable:
    """(params, batch) -> (summed loss, token count): the training loss of a batch, without its gradient.
    `fetch_params` brings parameters kept in host memory to the device (optim.Update.fetch_params)."""

    def eval_step(params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        with use_rules(mesh, rules, fetch_params is not None):
            return loss_sum(graphdef, params if fetch_params is None else fetch_params(params), batch)

    return eval_step


def make_train_step(graphdef: nnx.GraphDef, update: optim.Update, lr: optax.Schedule, grad_clip_norm: float,
                    grad_accum_steps: int, mesh, rules, grad_shardings: Any) -> Callable:
    """`rules` is a sharding.Rules; `grad_shardings` places gradients per the preset (ZeRO-2: scattered)."""
    params_on_host = update.fetch_params is not None
    fetch_params = update.fetch_params or (lambda p: p)
    grad_fn = jax.value_and_grad(lambda p, b: objective(graphdef, fetch_params(p), b), has_aux=True)

    def place(grads):
        return jax.lax.with_sharding_constraint(grads, grad_shardings)

    def step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict]:
        with use_rules(mesh, rules, params_on_host):
            if grad_accum_steps == 1:
                (total, sums), grads = grad_fn(state.params, batch)
                grads = place(grads)
            else:
                def accumulate(carry, micro):
                    (m_total, m_sums), m_grads = grad_fn(state.params, micro)
                    total, sums, grads = carry
                    return (total + m_total, jax.tree.map(jnp.add, sums, m_sums),
                            place(jax.tree.map(jnp.add, grads, m_grads))), None

                zeros = place(jax.tree.map(jnp.zeros_like, state.params))
                micro = jax.tree.map(lambda x: split_microbatches(x, grad_accum_steps), batch)
                first = jax.tree.map(lambda x: x[0], micro)
                shapes = jax.eval_shape(lambda: objective(graphdef, fetch_params(state.params), first)[1])
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
        finite = jnp.isfinite(total) & jnp.isfinite(grad_norm)
        grad_scale = optim.clip_scale(grad_norm, grad_clip_norm) / count
        params, opt_state = update.apply(grads, grad_scale, finite, state.opt_state, state.params)
        metrics = {"loss": loss, "grad_norm": grad_norm, "learning_rate": lr(state.step),
                   "update_skipped": (~finite).astype(jnp.float32)}
        if "router_load" in sums:
            metrics |= router_metrics(sums)
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1, rng=state.rng), metrics

    return step
