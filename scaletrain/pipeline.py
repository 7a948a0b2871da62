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
from jax.ad_checkpoint import checkpoint_name

from scaletrain import remat
from scaletrain.sharding import active_axes, constrain

STAGE_INPUT = "pipeline_stage_input"  # the checkpoint name of an iteration's inputs, kept for its recomputation
# What the shift buffer holds before a stage's first microbatch arrives. Never read: bubble iterations are masked
# (tests set it to NaN to prove it).
BUBBLE_FILL = 0.0


def scan(body: Callable, x: jax.Array, stacked: Any, extras: tuple, unroll: bool = False) -> jax.Array:
    """`body(x, layer_params, *extras) -> x` for every layer in turn."""
    x, _ = jax.lax.scan(lambda x, p: (body(x, p, *extras), None), x, stacked, unroll=unroll)
    return x


def split_microbatches(a: jax.Array, n: int) -> jax.Array:
    """[B, ...] -> [n, B/n, ...], microbatch i taking rows i, n+i, 2n+i, ...: every data shard contributes equally
    to every microbatch, so no rows move between devices (gradient accumulation's split too)."""
    a = a.reshape(a.shape[0] // n, n, *a.shape[1:]).swapaxes(0, 1)
    return constrain(a, (None, "batch") + (None,) * (a.ndim - 2))


def _join(a: jax.Array) -> jax.Array:
    """split_microbatches' inverse."""
    return a.swapaxes(0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def microbatch_at(iteration, stage, microbatches: int):
    """GPipe's schedule: the microbatch stage `stage` works on at forward iteration `iteration` (Python ints or
    arrays); outside [0, microbatches) the stage idles in the bubble."""
    return iteration - stage


def gpipe_timeline(stages: int, microbatches: int) -> list[list[str]]:
    """The whole step as ticks x stages: `F3` the forward pass of microbatch 3, `B3` its backward pass, `.` the
    bubble - the forward iterations, then the backward ones (jax.grad of the scan: the last first)."""
    ticks = microbatches + stages - 1

    def cell(i: int, p: int, kind: str) -> str:
        mb = microbatch_at(i, p, microbatches)
        return f"{kind}{mb}" if 0 <= mb < microbatches else "."

    return ([[cell(i, p, "F") for p in range(stages)] for i in range(ticks)]
            + [[cell(i, p, "B") for p in range(stages)] for i in reversed(range(ticks))])


def gpipe(body: Callable, x: jax.Array, stacked: Any, extras: tuple, stages: int, microbatches: int,
          unroll: bool = False, remat_policy: str = "none", remat_custom: tuple = ()) -> jax.Array:
    """The layer stack as a GPipe pipeline of `stages` stages over `microbatches` microbatches of the batch rows
    of `x` [B, T, D] (and of each of `extras`, per-row arrays such as RoPE's tables and the segment ids): the
    forward pass takes microbatches + stages - 1 iterations, stage p working on microbatch i - p at iteration i;
    jax.grad runs them backwards. Returns `x` after every layer, rows in their order. Under a remat policy other
    than none each iteration is rematerialised from its stage inputs (remat.around_stages)."""
    layers = jax.tree.leaves(stacked)[0].shape[0]
    per_stage = jax.tree.map(lambda a: a.reshape(stages, layers // stages, *a.shape[1:]), stacked)
    xs = split_microbatches(x, microbatches)
    extras_m = tuple(split_microbatches(e, microbatches) for e in extras)
    stage_axis = active_axes("stage")

    def stage(params, x, microbatch):
        # Each stage picks its microbatch's rows of the per-row arrays itself: local to its devices, which hold
        # every microbatch's (they are not split over stages).
        return scan(body, x, params, tuple(e[microbatch] for e in extras_m), unroll)

    where = ("stage", "batch", "residual_seq", "embed")

    def run_stages(params, inputs, current):
        inputs = checkpoint_name(inputs, STAGE_INPUT)
        return constrain(jax.vmap(stage, spmd_axis_name=stage_axis or None)(params, inputs, current), where)

    run_stages = remat.around_stages(run_stages, remat_policy, remat_custom, STAGE_INPUT)

    def iteration(carry, i):
        state, outputs = carry
        mb = microbatch_at(i, jnp.arange(stages), microbatches)
        valid = (mb >= 0) & (mb < microbatches)
        # Stage 0 takes microbatch i; stage p > 0 what stage p - 1 made in the iteration before. Selects, not an
        # update of row 0: elementwise on the stage-split arrays.
        first = (jnp.arange(stages) == 0)[:, None, None, None]
        inputs = jnp.where(first, xs[jnp.clip(i, 0, microbatches - 1)][None], jnp.roll(state, 1, axis=0))
        inputs = constrain(jnp.where(valid[:, None, None, None], inputs, 0), where)
        state = run_stages(per_stage, inputs, jnp.clip(mb, 0, microbatches - 1))
        # The last stage finishes microbatch i - (stages - 1); before the first one, slot 0 takes a bubble's zeros,
        # overwritten when microbatch 0 finishes.
        done = jnp.maximum(i - (stages - 1), 0)
        outputs = jax.lax.dynamic_update_index_in_dim(outputs, state[stages - 1], done, 0)
        return (state, outputs), None

    state = jnp.full((stages, *xs.shape[1:]), BUBBLE_FILL, x.dtype)
    (_, outputs), _ = jax.lax.scan(iteration, (constrain(state, where), jnp.zeros_like(xs)),
                                   jnp.arange(microbatches + stages - 1), unroll=unroll)
    return _join(outputs)
