"""The zero-bubble pipeline schedule (pipeline.schedule=zero_bubble): each layer's backward pass cut in two - the
input gradient, which the stage before waits for, and the weight gradient, which nobody waits for - and the
weight gradients run where 1F1B's stages would idle (the ZB-H1 schedule of Qi et al., "Zero Bubble Pipeline
Parallelism", 2023, in the lockstep of one SPMD program).

The cut is backward_split.py's, on the program of each layer's vjp: the forward slot (F) runs the layers and
keeps what their backward reads (remat policy `none`'s residuals: nothing runs twice); the input slot (B) pulls
the cotangent through the layers, the last first, and keeps each weight matmul's output cotangent; the weight
slot (W) forms the weights' gradient from those. Each costs about one layer-stack forward (F: the matmuls; B:
their input-side transposes and attention's backward; W: their weight-side transposes).

A tick runs one slot on every stage - each stage its own (a conditional on the stage's row of a static table, so
a stage computes only what it has) - then sends the forward slots' outputs on and the input slots' cotangents back.
The table (`table`) is made greedily, tick by tick, each stage taking: a forward slot while its 1F1B warm-up
allows (fewer than P - s microbatches between forward and input slot) and fewer than 2 P - 1 - s microbatches
wait for their weight slot; else an input slot if its cotangent has come; else a weight slot. The step takes
3 M + P - 1 ticks of one slot, against 1F1B's 4 (M + P - 1) (its backward slot runs each layer's forward again):
the bubble (P - 1) / (3 M + P - 1), and a stage keeps the residuals of up to 2 P - 1 - s microbatches.

Microbatch inputs and cotangents that arrive before their slot wait in a few buffers, their slot a microbatch's
index modulo the most that ever wait at once (`depths`): every stage runs each kind of slot in microbatch order,
so those waiting are consecutive. Nothing runs in a bubble: a stage without a slot skips the tick's compute.
"""

from __future__ import annotations

import functools
import types
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from scaletrain.parallel import backward_split, pipeline

SCHEDULE = "zero_bubble"
IDLE, FORWARD, INPUT, WEIGHT = range(4)
_LABELS = {FORWARD: "F", INPUT: "B", WEIGHT: "W"}


@functools.lru_cache(maxsize=None)
def table(stages: int, microbatches: int) -> np.ndarray:
    """[ticks, stages, 2]: each tick's (slot, microbatch) on each stage (slot IDLE, FORWARD, INPUT or WEIGHT)."""
    p, m = stages, microbatches
    done = {}  # (slot, stage, microbatch) -> tick
    count = np.zeros((p, 4), int)  # per stage, how many of each slot it has run
    rows = []
    while count[:, WEIGHT].min() < m:
        t, row = len(rows), []
        for s in range(p):
            f, b, w = count[s, FORWARD], count[s, INPUT], count[s, WEIGHT]

            def before(*key):
                return done.get(key, t) < t

            if (f < m and (s == 0 or before(FORWARD, s - 1, f)) and f - b < p - s and f - w < 2 * p - 1 - s):
                row.append((FORWARD, f))
            elif b < f and before(FORWARD, s, b) and (s == p - 1 or before(INPUT, s + 1, b)):
                row.append((INPUT, b))
            elif w < b:
                row.append((WEIGHT, w))
            else:
                row.append((IDLE, -1))
        for s, (slot, i) in enumerate(row):
            if slot != IDLE:
                done[slot, s, i] = t
                count[s, slot] += 1
        rows.append(row)
    return np.array(rows, np.int32)


def ticks(stages: int, microbatches: int) -> int:
    return len(table(stages, microbatches))


def bubble(stages: int, microbatches: int, costs: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> float:
    """The share of the step a stage idles, each tick as long as its costliest slot on any stage (lockstep), the
    slots' costs `costs` (forward, input, weight): (P - 1) / (3 M + P - 1) where they cost alike."""
    cost = np.array([0.0, *costs])
    step = sum(cost[row[:, 0]].max() for row in table(stages, microbatches))
    return 1 - microbatches * sum(costs) / step


def sends(stages: int, microbatches: int) -> tuple[int, int]:
    """(Stage-to-stage sends per step, those the step waits for): one on and one back every tick, each the
    tick's last work."""
    n = ticks(stages, microbatches)
    return 2 * n, n


def timeline(stages: int, microbatches: int) -> list[list[str]]:
    """The step as ticks x stages: `F3` microbatch 3's forward slot, `B3` its input slot, `W3` its weight slot,
    `.` the bubble."""
    return [[f"{_LABELS[slot]}{i}" if slot != IDLE else "." for slot, i in row]
            for row in table(stages, microbatches)]


def arrivals(stages: int, microbatches: int) -> tuple[np.ndarray, np.ndarray]:
    """[ticks, stages] each: the microbatch whose input (cotangent) a stage receives at the end of each tick from
    the stage before (after), or -1."""
    tab = table(stages, microbatches)
    on, back = np.full(tab.shape[:2], -1, np.int32), np.full(tab.shape[:2], -1, np.int32)
    on[:, 1:] = np.where(tab[:, :-1, 0] == FORWARD, tab[:, :-1, 1], -1)
    back[:, :-1] = np.where(tab[:, 1:, 0] == INPUT, tab[:, 1:, 1], -1)
    return on, back


@functools.lru_cache(maxsize=None)
def depths(stages: int, microbatches: int) -> Mapping[str, int]:
    """The most microbatches any stage holds at once in each buffer: `inputs` received, awaiting their forward
    slot; `cotangents` received (or the head's), awaiting their input slot; `to_input` forward -> input slot;
    `to_weight` forward -> weight slot; `on_weight` input -> weight slot."""
    tab = table(stages, microbatches)
    on, back = arrivals(stages, microbatches)
    when = {}
    for t, row in enumerate(tab):
        for s, (slot, i) in enumerate(row):
            when[slot, s, i] = t
            if on[t, s] >= 0:
                when["on", s, on[t, s]] = t
            if back[t, s] >= 0:
                when["back", s, back[t, s]] = t

    def most(start, end, on=range(stages)):  # at least 1: a buffer of none would not be indexable
        return max(1, *(sum(when[start, s, i] <= t < when[end, s, i] for i in range(microbatches))
                        for s in on for t in range(len(tab))))

    # Stage 0 takes its inputs from the batch; the last stage its cotangents from the head, in its forward slot.
    return types.MappingProxyType({  # read-only: the planner asks for it again and again (cached)
        "inputs": most("on", FORWARD, range(1, stages)),
        "cotangents": max(most("back", INPUT, range(stages - 1)), most(FORWARD, INPUT, [stages - 1])),
        "to_input": most(FORWARD, INPUT), "to_weight": most(FORWARD, WEIGHT), "on_weight": most(INPUT, WEIGHT)})


def run(c: dict, s, body: Callable, stacked, aux_weights, stages: int, microbatches: int, unroll: bool,
        first_inputs: Callable, extras_at: Callable, head_loss: Callable, permute: Callable) -> dict:
    """The step's ticks on stage `s` (inside pipeline_1f1b's shard_map): the carry `c` in, with its running
    sums - total, aux, dxs (the embedding's cotangents [b, m, T, D]), dstacked, dhead - out.

    `first_inputs(i)`: stage 0's input for microbatch i; `extras_at(i)`: its per-row arrays; `head_loss(y, i)`:
    (loss, head gradient, cotangent of y) at the last stage, zeros elsewhere; `permute(on, back)`: the tick's
    sends, (what came from before, what came from after)."""
    p, m = stages, microbatches
    first, last = s == 0, s == p - 1
    like = c["from_before"]
    depth = depths(p, m)
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), (stacked, aux_weights))
    cut = backward_split.split(body, one[0], jax.ShapeDtypeStruct(like.shape, like.dtype),
                               jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), extras_at(0)), one[1])
    layers = jax.tree.leaves(stacked)[0].shape[0]

    fill = pipeline.BUBBLE_FILL

    def buffer(which):  # [depth, layers, ...] of each kept value
        return tuple(jnp.full((depth[which], layers, *a.shape), fill if jnp.issubdtype(a.dtype, jnp.floating) else 0,
                              a.dtype) for a in cut.shapes(which))

    c = c | {"inputs": jnp.full((depth["inputs"], *like.shape), fill, like.dtype),
             "cotangents": jnp.full((depth["cotangents"], *like.shape), fill, like.dtype),
             **{which: buffer(which) for which in ("to_input", "to_weight", "on_weight")}}

    def put(buf, i, value, where=True):  # microbatch i's slot of a buffer [depth, ...]
        k = i % buf.shape[0]
        return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(where, value, buf[k]), k, 0)

    def get(buf, i):
        return buf[i % buf.shape[0]]

    nothing = jnp.zeros(like.shape, like.dtype)
    # Each layer's kept values are read and written in place, [slot, layer] of their buffers, inside the layer
    # loops: a microbatch's whole stack of them is never gathered in one array (a copy as large again).
    index = jnp.arange(layers)

    def at(bufs, i, layer):
        return tuple(b[i % b.shape[0], layer] for b in bufs)

    def set_(bufs, i, layer, values):
        return tuple(b.at[i % b.shape[0], layer].set(v) for b, v in zip(bufs, values))

    def skip(c, i):
        return c, nothing, nothing

    def forward(c, i):
        extras = extras_at(i)

        def one(carry, layer):
            x, to_input, to_weight = carry
            params, w, n = layer
            (y, aux), new_input, new_weight = backward_split.forward(cut, params, extras, w, x)
            return (y, set_(to_input, i, n, new_input), set_(to_weight, i, n, new_weight)), aux

        x = jnp.where(first, first_inputs(i), get(c["inputs"], i))
        (y, to_input, to_weight), aux = jax.lax.scan(one, (x, c["to_input"], c["to_weight"]),
                                                     (stacked, aux_weights, index), unroll=unroll)
        total, dhead, dy = head_loss(y, i)
        c = c | {"aux": jax.tree.map(jnp.add, c["aux"], aux), "to_input": to_input, "to_weight": to_weight,
                 "total": c["total"] + total, "dhead": jax.tree.map(jnp.add, c["dhead"], dhead),
                 "cotangents": put(c["cotangents"], i, dy.astype(like.dtype), last)}
        return c, y, nothing

    def input_(c, i):
        extras = extras_at(i)

        def one(carry, layer):
            dy, on_weight = carry
            params, w, n = layer
            dx, new = backward_split.input_grad(cut, params, extras, w, at(c["to_input"], i, n),
                                                at(c["to_weight"], i, n), dy)
            return (dx, set_(on_weight, i, n, new)), None

        (dx, on_weight), _ = jax.lax.scan(one, (get(c["cotangents"], i), c["on_weight"]),
                                          (stacked, aux_weights, index), reverse=True, unroll=unroll)
        dxs = c["dxs"]
        dxs = jax.lax.dynamic_update_index_in_dim(
            dxs, jnp.where(first, dx, jax.lax.dynamic_index_in_dim(dxs, i, 1, False)), i, 1)
        return c | {"on_weight": on_weight, "dxs": dxs}, nothing, dx

    def weight(c, i):
        extras = extras_at(i)

        def one(dstacked, layer):
            params, w, n = layer
            dp = backward_split.weight_grad(cut, params, extras, w, at(c["to_weight"], i, n),
                                            at(c["on_weight"], i, n))
            return jax.tree.map(lambda d, g: d.at[n].add(g), dstacked, dp), None

        dstacked, _ = jax.lax.scan(one, c["dstacked"], (stacked, aux_weights, index), unroll=unroll)
        return c | {"dstacked": dstacked}, nothing, nothing

    tab = table(p, m)
    on, back = arrivals(p, m)
    rows = jnp.asarray(np.stack([tab[..., 0], tab[..., 1], on, back], -1))  # [ticks, stages, 4]

    def tick(c, row):
        slot, i, came_on, came_back = (row[s, k] for k in range(4))
        # One conditional a kind of slot, not one lax.switch: XLA copies every buffer a switch carries, each tick.
        i = jnp.maximum(i, 0)
        c, out, _ = jax.lax.cond(slot == FORWARD, forward, skip, c, i)
        c, _, dx = jax.lax.cond(slot == INPUT, input_, skip, c, i)
        c, _, _ = jax.lax.cond(slot == WEIGHT, weight, skip, c, i)
        from_before, from_after = permute(out, dx)
        return c | {"inputs": put(c["inputs"], jnp.maximum(came_on, 0), from_before, came_on >= 0),
                    "cotangents": put(c["cotangents"], jnp.maximum(came_back, 0), from_after, came_back >= 0)}, None

    c, _ = jax.lax.scan(tick, c, rows, unroll=unroll)
    return {k: c[k] for k in ("total", "aux", "dxs", "dstacked", "dhead")}
