"""Training state in host memory (`pinned_host`), brought to the device a layer at a time.

With `optim.offload`, Adam's moments live in host memory and the update streams over the stacked layers: the
device holds one layer's moments (XLA overlaps the next layer's copy), never the whole optimizer state. With
`params.offload`, the float32 parameters live there too: the layer scan brings each layer's weights in where the
model uses them (sharding.constrain_param; a pipeline fetches its stage's weights whole, runner.Runner.fetches_layers),
the update streams them like the moments.

Every leaf of the state has a role, told by its logical axes: "layer" (stacked over `layers`: streamed a slice
at a time), "whole" (embeddings, final norm: updated in one piece) or "keep" (not shaped like a parameter,
e.g. Adam's step count).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from scaletrain.parallel.sharding import constrain_param, is_logical
from scaletrain.train.optim import Update, kept, scaled


def roles(logical_params: Any) -> Any:
    """The role of each parameter, from its logical axes."""
    return jax.tree.map(lambda names: "layer" if names[:1] == ("layers",) else "whole", logical_params,
                        is_leaf=is_logical)


def opt_roles(tx: optax.GradientTransformation, opt_state: Any, param_roles: Any) -> Any:
    """Leaves shaped like a parameter take its role; the others (Adam's count) are "keep"."""
    return optax.tree_utils.tree_map_params(
        tx, lambda _, role: role, opt_state, param_roles, transform_non_params=lambda _: "keep")


def fetch(param_roles: Any, logical_params: Any, layers: bool, params: Any) -> Any:
    """The parameters the model uses outside the layer scan - and the stacked layers too when `layers` -
    copied to the device (their gradients go back to host memory). Without `layers` the stacked layers stay
    in host memory and sharding.constrain_param fetches them a layer at a time (runner.Runner.fetches_layers)."""
    return jax.tree.map(lambda x, role, names: x if role == "layer" and not layers else constrain_param(x, names),
                        params, param_roles, logical_params, is_leaf=lambda x: is_logical(x) or isinstance(x, str))


def to_device(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)


def to_host(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host), tree)


def _view(tree: Any, tree_roles: Any, layer: jax.Array | None) -> Any:
    """The part one update works on: with `layer`, that layer of the stacked leaves; without, the whole leaves.
    The other leaves become empty (shape [0, ...]), so the same elementwise transformation costs nothing on
    them and the state keeps its structure."""
    def pick(x, role):
        if role == "keep":
            return x
        if role == "layer" and layer is not None:
            return jax.lax.dynamic_slice_in_dim(x, layer, 1)
        if role == "whole" and layer is None:
            return x
        return x[:0]

    return jax.tree.map(pick, tree, tree_roles)


def _put(tree: Any, part: Any, tree_roles: Any, layer: jax.Array | None, keep: bool) -> Any:
    """`part` (a _view's result) written back into `tree`; "keep" leaves taken from `part` when `keep`."""
    def put(x, p, role):
        if role == "keep":
            return p if keep else x
        if role == "layer" and layer is not None:
            return jax.lax.dynamic_update_slice_in_dim(x, p, layer, 0)
        if role == "whole" and layer is None:
            return p
        return x

    return jax.tree.map(put, tree, part, tree_roles)


def _num_layers(params: Any, param_roles: Any) -> int:
    return next(x.shape[0] for x, r in zip(jax.tree.leaves(params), jax.tree.leaves(param_roles)) if r == "layer")


def _streamed_update(tx: optax.GradientTransformation, param_roles: Any, opt_state_roles: Any, params_on_host: bool,
                     grads: Any, grad_scale: jax.Array, keep: jax.Array, opt_state: Any,
                     params: Any) -> tuple[Any, Any]:
    """optim.update's result a part at a time: the layers in a loop, then the whole leaves. Each part's
    moments (and parameters and gradients, when on the host) are copied in, updated, copied back."""
    def update_part(layer, params, opt_state):
        g = scaled(to_device(_view(grads, param_roles, layer)), grad_scale)
        p = to_device(_view(params, param_roles, layer))
        s = to_device(_view(opt_state, opt_state_roles, layer))
        updates, new_s = tx.update(g, s, p)
        new_p, new_s = kept(keep, (optax.apply_updates(p, updates), new_s), (p, s))
        # Every part reads the step's starting "keep" leaves (Adam's count); the last part, the whole
        # leaves, writes them.
        return (_put(params, to_host(new_p) if params_on_host else new_p, param_roles, layer, keep=False),
                _put(opt_state, to_host(new_s), opt_state_roles, layer, keep=layer is None))

    params, opt_state = jax.lax.fori_loop(0, _num_layers(params, param_roles), lambda i, c: update_part(i, *c),
                                          (params, opt_state))
    return update_part(None, params, opt_state)


def _streamed_norm(param_roles: Any, grads: Any) -> jax.Array:
    """optax.tree.norm of gradients in host memory, a layer at a time."""
    def sum_squares(layer):
        return sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(to_device(_view(grads, param_roles, layer))))

    layers = jax.lax.fori_loop(0, _num_layers(grads, param_roles), lambda i, total: total + sum_squares(i),
                               jnp.zeros((), jnp.float32))
    return jnp.sqrt(layers + sum_squares(None))


def _streamed_add(param_roles: Any, total: Any, new: Any) -> Any:
    """total + new for gradients in host memory, a layer at a time on the device (gradient accumulation's sum;
    XLA computes on the device only)."""
    def add_part(layer, total):
        both = (to_device(_view(t, param_roles, layer)) for t in (total, new))
        return _put(total, to_host(jax.tree.map(jnp.add, *both)), param_roles, layer, keep=False)

    total = jax.lax.fori_loop(0, _num_layers(total, param_roles), add_part, total)
    return add_part(None, total)


def streamed(tx: optax.GradientTransformation, logical_params: Any, abstract_opt_state: Any,
             params_on_host: bool, fetch_layers_whole: bool = False, logical_all: Any = None) -> Update:
    """The update for `optim.offload` (moments in host memory) and `params.offload` (parameters too; their
    gradients then land in host memory, and are read a layer at a time for the norm, the update and
    gradient accumulation's sum, whose zeros are made there). `tx` must be elementwise (optim.make's is).
    `logical_params`: the trained parameters' logical axes; `logical_all` every parameter's, where some are
    frozen (LoRA's base: fetched with the rest, never updated). `fetch_layers_whole`: the model's view of the
    parameters takes the stacked layers to the device at once (a runner that does not fetch them itself,
    runner.Runner.fetches_layers)."""
    param_roles = roles(logical_params)
    logical_all = logical_params if logical_all is None else logical_all
    apply = functools.partial(_streamed_update, tx, param_roles, opt_roles(tx, abstract_opt_state, param_roles),
                              params_on_host)
    if not params_on_host:
        return Update(apply=apply)
    return Update(apply=apply, norm=functools.partial(_streamed_norm, param_roles),
                  fetch_params=functools.partial(fetch, roles(logical_all), logical_all, fetch_layers_whole),
                  zeros=lambda params: to_host(jax.tree.map(jnp.zeros_like, params)),
                  add=functools.partial(_streamed_add, param_roles))
