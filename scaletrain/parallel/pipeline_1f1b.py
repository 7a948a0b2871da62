"""The 1F1B pipeline schedule: every stage alternates one microbatch's forward pass with an earlier one's backward
pass, so a stage keeps the inputs of a few microbatches in flight instead of all of them (GPipe's).

JAX's own differentiation cannot give this order: jax.grad of a loop runs every forward iteration before the
first backward one (GPipe). So the step is written out by hand, as one SPMD program under `shard_map` over the
pipeline axis (the other axes stay automatic: FSDP, tensor and data parallelism inside a stage are GSPMD's, as
everywhere else). Each tick every stage runs a forward slot and a backward slot:

- forward: stage s takes microbatch f = t - s (stage 0 from the embedded batch, the others from the stage before
  it, one collective permute on) and keeps each of its layers' inputs; the last stage runs the head (final norm,
  output projection, loss) on its output and its vjp at once, which gives the cotangent its backward slot starts
  from;
- backward: stage s takes microbatch b = t - (2 P - 2 - s) and pulls the cotangent from the stage after it (one
  permute back) through its layers, the last first, each under `jax.vjp` from its kept input - the layer's
  forward runs again there, as full remat runs it, but never the whole stage's: every layer's input is at hand -
  adding its weights' gradient to a running sum; stage 0's input cotangents go to the embedding.

A microbatch's layer inputs are kept from its forward tick to its backward tick, 2 (P - 1 - s) ticks: at most
min(M, 2 P - 1) microbatches' per stage, against GPipe's M - the lockstep of one SPMD program makes each hop a
tick, so the depth is 2 P - 1, not the P of a per-device (multi-program) 1F1B. Those layer inputs are what full
remat keeps, and the work is full remat's whatever the remat policy: the body comes without one (runner.py), as
a layer's vjp keeps its residuals for that layer only - a policy would only add its recomputation to the vjp's
forward. With pipeline.keep=stage_inputs a stage keeps only its input, and its backward slot runs the stage's
forward from it first, to have its layers' inputs again: a microbatch's activations kept rather than a stage of
layers' worth, for a forward of every layer more work. The P - 1 ticks before the first backward slot and the
P - 1 after the last forward one run only the slot that has work anywhere, so the step takes (M + P - 1)
(forward + backward) - GPipe's bubble, (P - 1) / (M + P - 1). Slots without a microbatch compute on
zeros, so nothing in them reaches the loss or a gradient.

Interleaved (`repeats` R > 1, docs/pipeline.md): each stage holds R blocks of layers (pipeline.memory_order) and
a slot runs one block. Forward, a stage's slots take the microbatches in groups of P, every block in turn for the
group (`work`): a microbatch leaving the last stage meets stage 0 at the next tick for its next block, the send
wrapping round; backward, the blocks in reverse, the cotangent wrapping the other way. The last stage's first
backward slot comes R P - 1 ticks in, with its forward slot that reaches the head; a stage keeps up to 2 R P - 1
block inputs, and the step takes (M + (P - 1) / R) (forward + backward): the bubble (P - 1) / (R M + P - 1).

The whole computation is a custom VJP of the summed loss: its forward pass runs the schedule and keeps the
gradients it formed; its backward pass scales them by the loss's cotangent. Without differentiation (an eval
step) only the forward slots and the head's loss run.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from scaletrain.parallel import pipeline, pipeline_zb
from scaletrain.parallel.sharding import active_axes, active_mesh, replica_axes

# The schedules this module runs: 1F1B, and interleaved 1F1B (pipeline.repeats blocks of layers per stage).
SCHEDULES = ("1f1b", "interleaved_1f1b")
# Those whose gradients its program forms itself, in a loop per device: the 1F1B family and zero-bubble's.
OWN_GRADIENTS = SCHEDULES + (pipeline_zb.SCHEDULE,)


def depth(stages: int, microbatches: int, repeats: int = 1) -> int:
    """Stage inputs (microbatches x blocks) a stage keeps at once (the first stage's count; the last keeps one)."""
    return min(repeats * microbatches, 2 * repeats * stages - 1)


def forward_index(tick, stage):
    """The position of tick `tick`'s forward slot at stage `stage` in the stage's own order of forward work."""
    return tick - stage


def backward_index(tick, stage, stages: int, repeats: int = 1):
    # The last stage starts its first backward slot (the last block's) with the forward slot that reaches the head.
    return tick - (repeats * stages - 1 + stages - 1 - stage)


def work(index, stages: int, repeats: int, backward: bool = False):
    """(block, microbatch) of a stage's `index`-th forward (or backward) slot. Microbatches go in groups of P
    (stages): forward, every block in turn for the group - so a microbatch leaving the last stage meets stage 0
    at the very next tick, for its next block -, backward the blocks in reverse. One block: the microbatches in
    order."""
    group, k = index // (repeats * stages), index % (repeats * stages)
    block = k // stages
    return (repeats - 1 - block if backward else block), group * stages + k % stages


def kept_slot(block, microbatch, stages: int, repeats: int, keep: int):
    """Where a stage keeps the input of (block, microbatch) from its forward slot to its backward one."""
    return ((microbatch // stages) * repeats * stages + block * stages + microbatch % stages) % keep


def ticks(stages: int, microbatches: int, repeats: int = 1) -> tuple[int, int, int]:
    """The ticks of the warm-up (forward slots only), the steady state (both) and the cool-down (backward only)."""
    warmup = repeats * stages - 1
    steady = repeats * microbatches + stages - 1 - warmup
    return warmup, steady, warmup


def sends(stages: int, microbatches: int, repeats: int = 1) -> tuple[int, int]:
    """(Stage-to-stage sends per step, those the step waits for): one on from every tick with a forward slot and
    one back from every tick with a backward slot, R M + P - 1 of each. A tick's send on can overlap its backward
    slot, which does not need it; the warm-up's have no backward slot, and a send back is its tick's last work."""
    n = repeats * microbatches + stages - 1
    return 2 * n, ticks(stages, microbatches, repeats)[0] + n


def timeline(stages: int, microbatches: int, repeats: int = 1) -> list[list[str]]:
    """The step as ticks x stages: `F3` the forward slot of microbatch 3 (`F3.1` in its second block of layers,
    interleaved), `B3` a backward slot, `F3+B1` a tick that runs both, `.` the bubble."""
    n = repeats * microbatches

    def label(kind: str, index: int, backward: bool) -> list[str]:
        if not 0 <= index < n:
            return []
        block, m = work(index, stages, repeats, backward)
        return [f"{kind}{m}" + (f".{block}" if repeats > 1 else "")]

    def cell(t: int, s: int) -> str:
        slots = (label("F", forward_index(t, s), False)
                 + label("B", backward_index(t, s, stages, repeats), True))
        return "+".join(slots) or "."

    return [[cell(t, s) for s in range(stages)] for t in range(sum(ticks(stages, microbatches, repeats)))]


def loss(body: Callable, head: Callable, stages: int, microbatches: int, repeats: int, gather_once: bool,
         keep_layers: bool, zero_bubble: bool, unroll: bool, x: jax.Array, stacked: Any, head_params: Any,
         extras: tuple, rows: tuple, aux_weights: Any) -> tuple[jax.Array, Any]:
    """(The summed loss of a batch through the layer stack as a 1F1B pipeline and the head, the stack's auxiliary
    sums [layers, ...] summed over the microbatches).

    `body(x, layer_params, *extras) -> (x, aux)` runs one layer of `stacked` [layers, ...] on a microbatch
    [b, T, D] with its rows of `extras`; `head(head_params, stacked, x, rows) -> summed loss` runs the
    head on a stage output with its rows of `rows` (targets, mask). `x` is the embedded batch [B, T, D]; `extras`
    and `rows` are per-row arrays [B, ...]. Differentiable in x, stacked and head_params.

    The gradient formed is that of loss + penalty(aux) for a penalty linear in the auxiliary sums (a router's
    losses), `aux_weights` being its gradient (shaped like aux): each backward slot pulls them through its layers
    beside the stream's cotangent. The caller's objective must be exactly that sum - its cotangent for the loss
    scales the gradients; the one for aux is taken to be aux_weights times it.

    The loop runs per device along the pipeline axis and along the batch axes whose devices hold the same
    weights (data parallelism: each sums its own gradients, reduced once after the loop). `gather_once` makes it
    per device along every batch axis: FSDP's weights are gathered once on the way in and their gradients
    reduced once on the way out, at the memory of a whole stage's weights and gradients on every device;
    otherwise FSDP gathers each weight where a slot uses it, as everywhere else. `keep_layers` keeps each layer's
    input from the forward slot to the backward one; otherwise only the stage's (its block's) input, and the
    backward slot runs the block's forward again from it first (pipeline.keep=stage_inputs: less memory, a
    forward of every layer more work). `zero_bubble` runs pipeline_zb's schedule instead (one block a stage; the
    eval step's forward slots are 1F1B's). `unroll` unrolls the ticks (for XLA's cost estimate only, as
    model.unroll_loops)."""
    return _loss((body, head, stages, microbatches, repeats, gather_once, keep_layers, zero_bubble, unroll), x,
                 stacked, head_params, extras, rows, aux_weights)


# The static arguments travel as one tuple: (body, head, stages, microbatches, repeats, gather_once, keep_layers,
# zero_bubble, unroll).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _loss(static, x, stacked, head_params, extras, rows, aux_weights):
    return _program(*static, False, x, stacked, head_params, extras, rows, aux_weights)


def _loss_forward(static, x, stacked, head_params, extras, rows, aux_weights):
    (total, aux), grads = _program(*static, True, x, stacked, head_params, extras, rows, aux_weights)
    return (total, aux), (grads, aux_weights)


def _loss_backward(static, residuals, g):
    (grads, aux_weights), (g_total, _) = residuals, g
    dx, dstacked, dhead = jax.tree.map(lambda a: (g_total * a).astype(a.dtype), grads)
    return dx, dstacked, dhead, None, None, jax.tree.map(jnp.zeros_like, aux_weights)


_loss.defvjp(_loss_forward, _loss_backward)


def _zeros(a: jax.Array) -> jax.Array:
    # Not zeros_like: under shard_map that would carry the argument's sharding, on the mesh before the pipeline
    # axis turned manual.
    return jnp.zeros(a.shape, a.dtype)


def _program(body, head, stages, microbatches, repeats, gather_once, keep_layers, zero_bubble, unroll, with_grads,
             x, stacked, head_params, extras, rows, aux_weights):
    axis = active_axes("stage")
    own = active_axes("batch") if gather_once else replica_axes()  # batch axes along which each device sums
    everywhere = axis + own
    m, v = microbatches, repeats
    keep = depth(stages, m, v)
    # Interleaved, the last stage's output goes round to stage 0 for the next block (and its cotangent back).
    wrap = v > 1
    send_on = [(i, (i + 1) % stages) for i in range(stages - (0 if wrap else 1))]
    send_back = [((i + 1) % stages, i) for i in range(stages - (0 if wrap else 1))]

    def block_of(tree, b):  # block b's layers of a stage's [layers, ...] (in pipeline.memory_order)
        if v == 1:
            return tree
        return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, b * (a.shape[0] // v), a.shape[0] // v),
                            tree)

    def add_to_block(tree, b, part):
        if v == 1:
            return jax.tree.map(jnp.add, tree, part)
        return jax.tree.map(lambda a, d: jax.lax.dynamic_update_slice_in_dim(
            a, jax.lax.dynamic_slice_in_dim(a, b * d.shape[0], d.shape[0]) + d, b * d.shape[0], 0), tree, part)

    def run_block(params, x, extras):
        """A block of layers forward: (its output, each layer's input [layers, b, T, D], its auxiliary sums)."""
        def one(x, p):
            y, aux = body(x, p, *extras)
            return y, (x, aux)

        out, (inputs, aux) = jax.lax.scan(one, x, params, unroll=unroll)
        return out, inputs, aux

    def pull_block(params, layer_inputs, extras, dy, aux_weights):
        """A block of layers backward from each layer's kept input, the last first: (its weights' gradient, the
        cotangent of its input). Each layer's forward runs again here, as under full remat, and never the
        whole block's: its layers' inputs were kept."""
        def one(dy, kept):
            p, x, w = kept
            _, pull = jax.vjp(lambda p, x: body(x, p, *extras), p, x)
            dp, dx = pull((dy.astype(x.dtype), w))
            return dx, dp

        dx, dp = jax.lax.scan(one, dy, (params, layer_inputs, aux_weights), reverse=True, unroll=unroll)
        return dp, dx

    def per_stage(x, stacked, head_params, extras, rows, aux_weights):
        s = jax.lax.axis_index(axis)
        first, last = s == 0, s == stages - 1
        # Microbatch i is rows i, m + i, 2m + i, ... (pipeline.split_microbatches'), read and written in place
        # along axis 1 of a [B/m, m, ...] view: no transposed copy of the batch.
        xs, extras_m, rows_m = (jax.tree.map(lambda a: a.reshape(a.shape[0] // m, m, *a.shape[1:]), t)
                                for t in (x, extras, rows))

        def at(tree, i):
            return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, jnp.clip(i, 0, m - 1), 1, False), tree)

        def run_head(y, i):
            return jax.vjp(lambda hp, y: head(hp, stacked, y, at(rows_m, i)), head_params, y)

        def head_loss(y, i):  # the loss and its gradients at the last stage; nothing elsewhere
            def go(y):
                total, pull = run_head(y, i)
                dhead, dy = pull(jnp.ones_like(total))
                return total, dhead, dy

            def nothing(y):
                return jnp.zeros((), jnp.float32), jax.tree.map(_zeros, head_params), _zeros(y)

            return jax.lax.cond(last & (0 <= i) & (i < m), go, nothing, y)

        def forward_slot(c, t):
            i = forward_index(t, s)
            valid = (0 <= i) & (i < v * m)
            block, f = work(i, stages, v)
            inputs = jnp.where(valid, jnp.where(first & (block == 0), at(xs, f), c["from_before"]), 0)
            out, layer_inputs, aux = run_block(block_of(stacked, block), inputs, at(extras_m, f))
            c = dict(c, aux=add_to_block(c["aux"], block, jax.tree.map(lambda a: jnp.where(valid, a, 0), aux)))
            if with_grads:  # each layer's input (or the block's), for the backward slot
                slot = kept_slot(block, f, stages, v, keep)
                kept = c["kept"]
                c = dict(c, kept=jax.lax.dynamic_update_index_in_dim(
                    kept, jnp.where(valid, layer_inputs if keep_layers else inputs,
                                    jax.lax.dynamic_index_in_dim(kept, slot, keepdims=False)), slot, 0))
            return c, layer_inputs, out, jnp.where(valid & (block == v - 1), f, -1)

        def backward_slot(c, t, fresh, dy):
            """`fresh`: this tick's forward slot's layer inputs, which the last stage pulls its cotangent through
            at once."""
            j = backward_index(t, s, stages, v)
            valid = (0 <= j) & (j < v * m)
            block, b = work(j, stages, v, backward=True)
            at_head = last & (block == v - 1)  # its cotangent is the head's, from this tick's forward slot
            kept = jax.lax.dynamic_index_in_dim(c["kept"], kept_slot(block, b, stages, v, keep), keepdims=False)
            if not keep_layers:  # the block's input kept: its layers' inputs again, from a forward
                kept = run_block(block_of(stacked, block), kept, at(extras_m, b))[1]
            layer_inputs = jnp.where(valid, jnp.where(at_head, fresh, kept), 0)
            cotangent = jnp.where(valid, jnp.where(at_head, dy, c["from_after"]), 0)
            dstacked, dx = pull_block(block_of(stacked, block), layer_inputs, at(extras_m, b), cotangent,
                                      jax.tree.map(lambda w: jnp.where(valid, w, 0), block_of(aux_weights, block)))
            i = jnp.clip(b, 0, m - 1)
            dxs = c["dxs"]
            to_embedding = first & (block == 0) & valid
            dxs = jax.lax.dynamic_update_index_in_dim(
                dxs, jnp.where(to_embedding, dx, jax.lax.dynamic_index_in_dim(dxs, i, 1, False)), i, 1)
            return dict(c, dxs=dxs, dstacked=add_to_block(c["dstacked"], block, dstacked)), dx

        def warmup(c, t):  # no stage has a backward slot yet
            c, _, out, _ = forward_slot(c, t)
            return dict(c, from_before=jax.lax.ppermute(out, axis, send_on)), None

        def steady(c, t):
            c, inputs, out, f = forward_slot(c, t)
            total, dhead, dy = head_loss(out, f)
            c = dict(c, total=c["total"] + total, dhead=jax.tree.map(jnp.add, c["dhead"], dhead))
            c, dx = backward_slot(c, t, inputs, dy)
            return dict(c, from_before=jax.lax.ppermute(out, axis, send_on),
                        from_after=jax.lax.ppermute(dx, axis, send_back)), None

        def cooldown(c, t):  # no stage has a forward slot left
            c, dx = backward_slot(c, t, c["from_before"], _zeros(dx_like))
            return dict(c, from_after=jax.lax.ppermute(dx, axis, send_back)), None

        def forward_only(c, t):
            c, _, out, f = forward_slot(c, t)  # f: the microbatch reaching the head, or -1
            total = jax.lax.cond(last & (0 <= f), lambda y: run_head(y, f)[0],
                                 lambda y: jnp.zeros((), jnp.float32), out)
            return dict(c, total=c["total"] + total, from_before=jax.lax.ppermute(out, axis, send_on)), None

        dx_like = at(xs, 0)
        fill = jnp.full(dx_like.shape, pipeline.BUBBLE_FILL, dx_like.dtype)
        c = {"from_before": fill, "total": jnp.zeros((), jnp.float32), "aux": jax.tree.map(_zeros, aux_weights)}

        def sums(c):  # the loss, whole; each stage's auxiliary sums, over the devices' own rows
            return jax.lax.psum(c["total"], everywhere), jax.lax.psum(c["aux"], own) if own else c["aux"]

        if not with_grads:
            c, _ = jax.lax.scan(forward_only, c, jnp.arange(v * m + stages - 1), unroll=unroll)
            return sums(c)
        kept_shape = ((jax.tree.leaves(stacked)[0].shape[0] // v,) if keep_layers else ()) + dx_like.shape
        c |= {"from_after": fill, "kept": jnp.full((keep, *kept_shape), pipeline.BUBBLE_FILL, x.dtype),
              "dxs": _zeros(xs), "dstacked": jax.tree.map(_zeros, stacked),
              "dhead": jax.tree.map(_zeros, head_params)}
        if zero_bubble:
            c = pipeline_zb.run(c, s, body, stacked, aux_weights, stages, m, unroll, lambda i: at(xs, i),
                                lambda i: at(extras_m, i), head_loss,
                                lambda on, back: (jax.lax.ppermute(on, axis, send_on),
                                                  jax.lax.ppermute(back, axis, send_back)))
        else:
            up, steady_ticks, down = ticks(stages, m, v)
            c, _ = jax.lax.scan(warmup, c, jnp.arange(up), unroll=unroll)
            c, _ = jax.lax.scan(steady, c, jnp.arange(up, up + steady_ticks), unroll=unroll)
            c, _ = jax.lax.scan(cooldown, c, jnp.arange(up + steady_ticks, up + steady_ticks + down),
                                unroll=unroll)
        dx = jax.lax.psum(c["dxs"].reshape(x.shape), axis)
        dstacked = jax.lax.psum(c["dstacked"], own) if own else c["dstacked"]
        return sums(c), (dx, dstacked, jax.lax.psum(c["dhead"], everywhere))

    # The per-row arrays are split along the devices' own batch axes, whole along the pipeline; the head's
    # weights whole, the stacked layers split by stage - along the manual axes, that is: over the others (FSDP's
    # when per use, tensor's) XLA splits them as everywhere else.
    def rows_spec(tree):
        return jax.tree.map(lambda _: P(own or None), tree)

    def by_stage(tree):
        return jax.tree.map(lambda _: P(axis), tree)

    in_specs = (P(own or None), by_stage(stacked), jax.tree.map(lambda _: P(), head_params), rows_spec(extras),
                rows_spec(rows), by_stage(aux_weights))
    out_specs = (P(), by_stage(aux_weights))
    if with_grads:
        out_specs = (out_specs, (in_specs[0], in_specs[1], in_specs[2]))
    return jax.shard_map(per_stage, mesh=active_mesh(), in_specs=in_specs, out_specs=out_specs,
                         axis_names=set(everywhere), check_vma=False)(x, stacked, head_params, extras, rows,
                                                                      aux_weights)
