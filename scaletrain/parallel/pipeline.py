"""Runners of the layer stack: the plain scan over layers, and a GPipe pipeline over the `stage` logical axis.

The model hands a runner its layer body and the stacked layer weights in their one canonical layout,
`[layers, ...]` (sharded over the pipeline stages along `layers`: each stage's devices hold a contiguous block of
layers/stages of them, so the checkpoint on disk is the same whatever the stage count). The pipeline reshapes them
to `[stages, layers per stage, ...]` - a local view, no data moves - and runs every stage at once, each on its own
microbatch, as one SPMD program (vmap over the stage dim, which the mesh's pipeline axis shards); after each
iteration every stage's output moves one stage on (a collective permute) and stage 0 takes the next microbatch.
Iterations where a stage has no microbatch (the bubble) compute on zeros, so nothing left in the shift buffer
(a previous microbatch's, or whatever it was filled with) reaches the loss or a gradient.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from scaletrain import remat
from scaletrain.parallel.sharding import active_axes, constrain

# The schedules whose stages hold pipeline.repeats blocks of layers, the weights in `memory_order`.
BLOCKED = ("circular", "interleaved_1f1b")
STAGE_INPUT = "pipeline_stage_input"  # the checkpoint name of an iteration's inputs, kept for its recomputation
# What the shift buffer holds before a stage's first microbatch arrives. Never read: bubble iterations are masked
# (tests set it to NaN to prove it).
BUBBLE_FILL = 0.0


def scan(body: Callable, x: jax.Array, stacked: Any, extras: tuple, unroll: bool = False) -> tuple[jax.Array, dict]:
    """`body(x, layer_params, *extras) -> (x, aux)` for every layer in turn: (x after the last, each layer's
    auxiliary sums stacked along the layers, [layers, ...] - an empty dict where the blocks have none)."""
    return jax.lax.scan(lambda x, p: body(x, p, *extras), x, stacked, unroll=unroll)


def add_where(valid: jax.Array, total: Any, new: Any) -> Any:
    """`total` + `new` where `valid` (a slot that did work), else `total`: auxiliary sums across microbatches,
    never a bubble's."""
    return jax.tree.map(lambda t, n: t + jnp.where(valid, n, jnp.zeros_like(n)), total, new)


def split_microbatches(a: jax.Array, n: int) -> jax.Array:
    """[B, ...] -> [n, B/n, ...], microbatch i taking rows i, n+i, 2n+i, ...: every data shard contributes equally
    to every microbatch, so no rows move between devices (gradient accumulation's split too)."""
    a = a.reshape(a.shape[0] // n, n, *a.shape[1:]).swapaxes(0, 1)
    return constrain(a, (None, "batch") + (None,) * (a.ndim - 2))


def _join(a: jax.Array) -> jax.Array:
    """split_microbatches' inverse."""
    return a.swapaxes(0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def work_at(iteration, stage, microbatches: int, repeats: int = 1):
    """(microbatch, repeat, valid) of stage `stage` at forward iteration `iteration` (Python ints or arrays):
    GPipe (one repeat) and circular schedules alike, stage p working on the (iteration - p)th pass through it;
    outside [0, repeats x microbatches) the stage idles in the bubble."""
    k = iteration - stage
    return k % microbatches, k // microbatches, (0 <= k) & (k < repeats * microbatches)


def sends(stages: int, microbatches: int, repeats: int = 1) -> tuple[int, int]:
    """(Stage-to-stage sends per step, those the step waits for): one every iteration forward (R M + P - 1, the
    bubble's included) and as many backward. Each is its iteration's last work and the next iteration's first
    input, so none overlaps compute."""
    n = 2 * (repeats * microbatches + stages - 1)
    return n, n


def timeline(stages: int, microbatches: int, repeats: int = 1) -> list[list[str]]:
    """The whole step as ticks x stages: `F3` the forward pass of microbatch 3 (`F3.1` on its second repeat of
    a circular schedule), `B3` its backward pass, `.` the bubble - the forward iterations, then the backward
    ones (jax.grad of the scan: the last first)."""
    ticks = repeats * microbatches + stages - 1

    def cell(i: int, p: int, kind: str) -> str:
        mb, r, valid = work_at(i, p, microbatches, repeats)
        return f"{kind}{mb}" + (f".{r}" if repeats > 1 else "") if valid else "."

    return ([[cell(i, p, "F") for p in range(stages)] for i in range(ticks)]
            + [[cell(i, p, "B") for p in range(stages)] for i in reversed(range(ticks))])


def memory_order(layers: int, stages: int, repeats: int) -> np.ndarray:
    """The canonical index of the layer at each position of the stacked weights as a circular schedule keeps
    them: stage p's devices hold a contiguous block (the `layers` dim is split over the pipeline axis), which must
    be its repeats' layers - stage p at repeat r runs canonical layers [(r P + p) L', (r P + p + 1) L') of L' per
    stage and repeat. The identity for one repeat; checkpoints keep the canonical order (Setup.to_disk,
    from_disk)."""
    per = layers // (stages * repeats)
    return np.array([(r * stages + p) * per + j for p in range(stages) for r in range(repeats) for j in range(per)])


def gpipe(body: Callable, x: jax.Array, stacked: Any, extras: tuple, stages: int, microbatches: int,
          unroll: bool = False, remat_policy: str = "none", remat_custom: tuple = (),
          repeats: int = 1) -> tuple[jax.Array, dict]:
    """The layer stack as a GPipe pipeline of `stages` stages over `microbatches` microbatches of the batch rows
    of `x` [B, T, D] (and of each of `extras`, per-row arrays such as RoPE's tables and the segment ids): the
    forward pass takes microbatches + stages - 1 iterations, stage p working on microbatch i - p at iteration i;
    jax.grad runs them backwards. Returns `x` after every layer, rows in their order, and the layers' auxiliary
    sums (scan's, [layers, ...] in canonical order, summed over the microbatches). Under a remat policy other
    than none each iteration is rematerialised from its stage inputs (remat.around_stages).

    With `repeats` R > 1, the circular schedule: `stacked` in memory_order, each stage holds R blocks of layers and
    every microbatch goes round the stages R times - R M + P - 1 iterations, stage 0 taking a microbatch back from
    the last stage M iterations after it sent it (so M >= P)."""
    layers = jax.tree.leaves(stacked)[0].shape[0]
    # [stages, layers per stage, ...], or [stages, repeats, layers per block, ...] for a circular schedule: with
    # one repeat no repeats dim, so that GPipe's program is the one it was before circular schedules.
    blocks = (stages,) if repeats == 1 else (stages, repeats)
    per_stage = jax.tree.map(lambda a: a.reshape(*blocks, layers // (stages * repeats), *a.shape[1:]), stacked)
    xs = split_microbatches(x, microbatches)
    extras_m = tuple(split_microbatches(e, microbatches) for e in extras)
    stage_axis = active_axes("stage")

    def stage(params, x, microbatch, repeat):
        # Each stage picks its repeat's layers and its microbatch's rows of the per-row arrays itself: local to
        # its devices, which hold all of its repeats and every microbatch's rows (not split over stages).
        layers = params if repeats == 1 else jax.tree.map(
            lambda a: jax.lax.dynamic_index_in_dim(a, repeat, 0, False), params)
        return scan(body, x, layers, tuple(e[microbatch] for e in extras_m), unroll)

    where = ("stage", "batch", "residual_seq", "embed")

    def run_stages(params, inputs, microbatch, repeat):
        inputs = checkpoint_name(inputs, STAGE_INPUT)
        out, aux = jax.vmap(stage, spmd_axis_name=stage_axis or None)(params, inputs, microbatch, repeat)
        return constrain(out, where), aux

    run_stages = remat.around_stages(run_stages, remat_policy, remat_custom, STAGE_INPUT, unroll)

    def iteration(carry, i):
        state, outputs, aux = carry
        mb, r, valid = work_at(i, jnp.arange(stages), microbatches, repeats)
        # Stage 0 takes microbatch i mod M, fresh or (circular) back from the last stage; stage p > 0 what stage
        # p - 1 made in the iteration before. Selects, not an update of row 0: elementwise on the stage-split arrays.
        first = (jnp.arange(stages) == 0)[:, None, None, None]
        taken = xs[jnp.clip(i, 0, microbatches - 1)]
        if repeats > 1:
            taken = jnp.where(i < microbatches, taken, jax.lax.dynamic_index_in_dim(outputs, i % microbatches, 0,
                                                                                      False))
        inputs = jnp.where(first, taken[None], jnp.roll(state, 1, axis=0))
        inputs = constrain(jnp.where(valid[:, None, None, None], inputs, 0), where)
        r = jnp.clip(r, 0, repeats - 1)
        state, stage_aux = run_stages(per_stage, inputs, mb, r)
        # Each stage's sums [stages, layers per block, ...] land in its repeat's block of [stages, repeats, ...].
        at_repeat = valid[:, None] & (jnp.arange(repeats)[None, :] == r[:, None])
        aux = jax.tree.map(lambda t, n: t + jnp.where(at_repeat.reshape(at_repeat.shape + (1,) * (n.ndim - 1)),
                                                      n[:, None], 0), aux, stage_aux)
        # The last stage finishes microbatch i - (stages - 1) (of some repeat); before the first one, slot 0 takes a
        # bubble's zeros, overwritten when microbatch 0 finishes - before a circular schedule reads it back.
        done = jnp.maximum(i - (stages - 1), 0) % microbatches
        outputs = jax.lax.dynamic_update_index_in_dim(outputs, state[stages - 1], done, 0)
        return (state, outputs, aux), None

    state = jnp.full((stages, *xs.shape[1:]), BUBBLE_FILL, x.dtype)
    aux_shape = jax.eval_shape(lambda: run_stages(per_stage, state, jnp.zeros(stages, jnp.int32),
                                                  jnp.zeros(stages, jnp.int32))[1])
    aux = jax.tree.map(lambda a: jnp.zeros((stages, repeats, *a.shape[1:]), a.dtype), aux_shape)
    (_, outputs, aux), _ = jax.lax.scan(iteration, (constrain(state, where), jnp.zeros_like(xs), aux),
                                        jnp.arange(repeats * microbatches + stages - 1), unroll=unroll)
    # Stage p's repeat r holds canonical block r P + p (memory_order): [repeats, stages, ...] is canonical.
    return _join(outputs), jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(layers, *a.shape[3:]), aux)
