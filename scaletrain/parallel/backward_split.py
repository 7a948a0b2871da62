"""A layer's forward and backward pass cut into three programs, for a zero-bubble pipeline (pipeline_zb.py):

- forward: the layer's output, and the values its backward pass reads (its residuals);
- input gradient: the cotangent of the layer's input, from its output's cotangent - the pass the stage before
  waits for;
- weight gradient: the cotangent of the layer's weights - the pass nobody waits for, which the schedule defers
  into the bubbles.

The cut is made on the program of the layer's whole vjp (`jax.make_jaxpr`), not in the model: every projection
(plain, FlashNorm's fused, quantized, a mixture's ragged dots) splits alike, with no seam in the model for it.
Each equation goes where its data needs it:

- the ones that do not read the output's cotangent go to the forward, if the output or the input-gradient pass
  needs them (else to the weight-gradient pass, which recomputes them: a transpose of an input);
- of those that read it, the ones the input's cotangent needs go to the input-gradient pass, the others (the
  weight-gradient matmuls, and what only they read) to the weight-gradient pass.

A value made by one pass and read by a later one is kept between them: the forward's residuals, and the
input-gradient pass's cotangents at each weight's matmul. A forward value a later pass can make again from what
it keeps anyway, or from fewer bytes, by equations of no cost (elementwise, reshapes: no matmul, kernel or
collective) is made again there instead (`lighten`): XLA attention's softmax, its casts and its mask from the
scores - one float32 score kept where jax's own vjp keeps 10 bytes' worth. An equation is cut whole:
one that forms an input's and a weight's cotangent together (a Pallas kernel, a nested shard_map) runs in the
input-gradient pass and hands its weight cotangent on as a kept value - right, only not deferred.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
from jax.extend import core

FORWARD, INPUT, WEIGHT = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Split:
    """The three programs of one layer shape (`split`): its equations by pass, and what each pass keeps for a
    later one - `to_input` (forward -> input-gradient pass only), `to_weight` (forward -> weight-gradient pass,
    which the input-gradient pass may read too), `on_weight` (input-gradient -> weight-gradient pass)."""
    jaxpr: Any
    consts: tuple
    ambient: tuple  # the invars every pass has: the layer's weights, the per-row extras, the auxiliary weights
    x: Any
    dy: Any
    passes: tuple  # (forward, input, weight) equation lists
    to_input: tuple
    to_weight: tuple
    on_weight: tuple
    outputs: tuple  # (forward: y and aux, input: dx, weight: dparams) outvars
    trees: tuple  # (aux, dparams) tree definitions

    def shapes(self, which: str) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The kept values' shapes, one layer's: which is to_input, to_weight or on_weight."""
        return tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in getattr(self, which))


def split(body: Callable, params: Any, x: jax.Array, extras: tuple, aux_weights: Any) -> Split:
    """`body(x, params, *extras) -> (y, aux)` cut at these arguments' shapes (arrays or ShapeDtypeStructs)."""
    def whole(params, extras, aux_weights, x, dy):
        (y, aux), pull = jax.vjp(lambda p, x: body(x, p, *extras), params, x)
        dparams, dx = pull((dy.astype(y.dtype), aux_weights))
        return (y, aux), dx, dparams

    shape = jax.eval_shape(lambda p, x, e: body(x, p, *e)[0], params, x, extras)
    closed, out_shape = jax.make_jaxpr(whole, return_shape=True)(params, extras, aux_weights, x, shape)
    jaxpr = closed.jaxpr
    n_ambient = len(jax.tree.leaves((params, extras, aux_weights)))
    ambient, (x_var, dy_var) = tuple(jaxpr.invars[:n_ambient]), jaxpr.invars[n_ambient:]
    (y_aux, dx, dparams) = out_shape
    n_fwd, n_dp = len(jax.tree.leaves(y_aux)), len(jax.tree.leaves(dparams))
    outs = jaxpr.outvars
    outputs = (tuple(outs[:n_fwd]), tuple(outs[n_fwd:n_fwd + 1]), tuple(outs[n_fwd + 1:n_fwd + 1 + n_dp]))
    eqns = jaxpr.eqns

    def reading(sources):  # the equations that read `sources`, or what they make, however far on
        seen, out = set(sources), set()
        for i, e in enumerate(eqns):
            if any(_is_var(v) and v in seen for v in e.invars):
                out.add(i)
                seen.update(e.outvars)
        return out

    def needed(roots, among):
        """The equations of `among` (indices) the vars `roots` need, transitively within `among`."""
        want, out = {v for v in roots if _is_var(v)}, set()
        for i in reversed(range(len(eqns))):
            if i in among and any(v in want for v in eqns[i].outvars):
                out.add(i)
                want.update(v for v in eqns[i].invars if _is_var(v))
        return out

    def invars(chosen):
        return [v for i in chosen for v in eqns[i].invars]

    reads_dy = reading({dy_var})
    # What reads neither the input nor the cotangent (a broadcast of a weight) is made again where it is needed.
    fixed = set(range(len(eqns))) - reading({x_var, dy_var})
    clean = set(range(len(eqns))) - reads_dy - fixed
    inputs = needed(outputs[INPUT], reads_dy)
    forward = needed([*outputs[FORWARD], *outputs[INPUT], *invars(inputs)], clean)
    weights = needed(outputs[WEIGHT], set(range(len(eqns))) - inputs - forward - fixed)
    chosen = [forward, set(inputs), set(weights)]
    maker = {v: i for i, e in enumerate(eqns) for v in e.outvars if i not in fixed}

    def source(v):  # the pass that makes a kept var
        return INPUT if v is dy_var or maker.get(v) in chosen[INPUT] else FORWARD

    def kept(which):
        """What pass `which` reads and does not make: an earlier pass's (x the forward's, dy the input pass's)."""
        here = {v for i in chosen[which] for v in eqns[i].outvars}
        vs = [*invars(chosen[which]), *outputs[which]]
        return [v for v in dict.fromkeys(v for v in vs if _is_var(v))
                if v not in here and (v is x_var or v is dy_var or v in maker)]

    def remake(v, keep, memo):
        """(The vars to keep to make `v` again by cheap forward equations - elementwise, reshapes: no matmul,
        kernel or collective -, those equations); `v` itself if it is kept or not so made."""
        if v not in memo:
            i = maker.get(v)
            if v in keep or i is None or i not in forward or not _cheap(eqns[i]):
                memo[v] = {v}, set()
            else:
                vars_, made = set(), {i}
                for u in eqns[i].invars:
                    if _is_var(u) and (u is x_var or u in maker):
                        more, eqs = remake(u, keep, memo)
                        vars_, made = vars_ | more, made | eqs
                memo[v] = vars_, made
        return memo[v]

    def lighten(which):
        """Forward values pass `which` reads made again there, from what it keeps anyway or from less, rather than
        kept: a softmax's probabilities and their casts from its scores, a norm from its input."""
        while True:
            keep = set(kept(which))
            for v in keep:
                vars_, made = remake(v, keep - {v}, {})
                if made and _bytes(vars_ - keep) <= _bytes([v]):
                    chosen[which].update(made)
                    break
            else:
                return

    lighten(INPUT)
    lighten(WEIGHT)
    passes = tuple([e for i, e in enumerate(eqns) if i in c | needed([*invars(c), *outputs[which]], fixed)]
                   for which, c in enumerate(chosen))
    to_weight = tuple(v for v in kept(WEIGHT) if source(v) == FORWARD)
    on_weight = tuple(v for v in kept(WEIGHT) if source(v) == INPUT)
    to_input = tuple(v for v in kept(INPUT) if v is not dy_var and v not in to_weight)
    trees = (jax.tree.structure(y_aux[1]), jax.tree.structure(dparams))
    return Split(jaxpr, tuple(closed.consts), ambient, x_var, dy_var, passes, to_input, to_weight, on_weight,
                 outputs, trees)


# Primitives that cost more than a pass over their operands (or move data between devices): never made again.
_COSTLY = frozenset({"dot_general", "ragged_dot", "ragged_dot_general", "conv_general_dilated", "pallas_call",
                     "custom_vjp_call", "custom_jvp_call", "shard_map", "scan", "while", "cond", "sort", "top_k",
                     "cumsum", "cumlogsumexp", "cummax", "cummin", "cumprod", "ppermute", "psum", "all_gather",
                     "all_to_all", "reduce_scatter", "psum_scatter", "ragged_all_to_all", "random_bits",
                     "rng_bit_generator"})


def _cheap(e) -> bool:
    subs = [j for v in e.params.values() for j in (v if isinstance(v, tuple) else (v,))
            if isinstance(j, (core.Jaxpr, core.ClosedJaxpr))]
    return e.primitive.name not in _COSTLY and all(
        _cheap(inner) for j in subs for inner in (j.jaxpr if isinstance(j, core.ClosedJaxpr) else j).eqns)


def _bytes(vs) -> int:
    return sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in vs)


def _is_var(v) -> bool:
    return not isinstance(v, core.Literal) and not isinstance(v, core.DropVar)


def _run(eqns, env: dict) -> None:
    """The equations evaluated in order, binding what they make in `env` (as jax.core.eval_jaxpr)."""
    for e in eqns:
        with e.ctx.manager:
            out = e.primitive.bind(*[_get(env, v) for v in e.invars], **e.primitive.get_bind_params(e.params))
        for v, o in zip(e.outvars, out if e.primitive.multiple_results else [out]):
            if not isinstance(v, core.DropVar):
                env[v] = o


def _env(s: Split, params, extras, aux_weights) -> dict:
    env = dict(zip(s.jaxpr.constvars, s.consts))
    env.update(zip(s.ambient, jax.tree.leaves((params, extras, aux_weights))))
    return env


def _get(env, v):
    return v.val if isinstance(v, core.Literal) else env[v]


def forward(s: Split, params, extras, aux_weights, x) -> tuple[tuple[jax.Array, Any], tuple, tuple]:
    """((y, aux), to_input values, to_weight values)."""
    env = _env(s, params, extras, aux_weights) | {s.x: x}
    _run(s.passes[FORWARD], env)
    y, *aux = (_get(env, v) for v in s.outputs[FORWARD])
    return ((y, jax.tree.unflatten(s.trees[0], aux)), tuple(env[v] for v in s.to_input),
            tuple(env[v] for v in s.to_weight))


def input_grad(s: Split, params, extras, aux_weights, to_input, to_weight, dy) -> tuple[jax.Array, tuple]:
    """(dx, on_weight values)."""
    env = _env(s, params, extras, aux_weights) | dict(zip(s.to_input, to_input)) | dict(zip(s.to_weight, to_weight))
    env[s.dy] = dy
    _run(s.passes[INPUT], env)
    return _get(env, s.outputs[INPUT][0]), tuple(env[v] for v in s.on_weight)


def weight_grad(s: Split, params, extras, aux_weights, to_weight, on_weight) -> Any:
    """The layer weights' cotangent (params' tree)."""
    env = _env(s, params, extras, aux_weights) | dict(zip(s.to_weight, to_weight)) | dict(zip(s.on_weight, on_weight))
    _run(s.passes[WEIGHT], env)
    return jax.tree.unflatten(s.trees[1], [_get(env, v) for v in s.outputs[WEIGHT]])
