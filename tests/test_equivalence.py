"""The equivalence harness (tests/equivalence.py) fails on the bugs it exists to catch, on a data-parallel mesh:
a gradient scaled by 2, and a psum where a pmean belongs - and passes the same runs without them.

Both bugs are injected where the train step differentiates: `jax.value_and_grad` is patched (for the run under
test only) to differentiate a changed function instead of the step's own - whatever the step's objective is called
and wherever it lives. Each test checks the patch was reached: if the step stops differentiating through
jax.value_and_grad, these tests fail saying so, rather than passing on an unpatched run.

With global-norm clipping (1.0, acting on every step of the tiny model) and Adam, the doubled gradient gives the
same losses, parameters and Adam moments as the true one - only the gradient norm tells them apart; without
clipping Adam divides the scale out of the update, and `mu` tells them apart.
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from scaletrain.train import trainer
from tests import equivalence

STEPS = 3
DATA = ["mesh.data=2"]
UNCLIPPED = ["optim.grad_clip_norm=0"]  # 0: no clipping


@pytest.fixture(scope="module")
@equivalence.computed_once
def reference(batches):
    return equivalence.reference(batches)


def _differentiating(monkeypatch, change):
    """jax.value_and_grad differentiates change(fun, has_aux) instead of each `fun` it is given; returns the list of
    the functions it was given (empty if the step never called it)."""
    given, value_and_grad = [], jax.value_and_grad

    def patched(fun, *args, has_aux=False, **kwargs):
        given.append(fun)
        return value_and_grad(change(fun, has_aux), *args, has_aux=has_aux, **kwargs)

    monkeypatch.setattr(jax, "value_and_grad", patched)
    return given


def _reached(given):
    assert given, ("the train step no longer differentiates through jax.value_and_grad: the bugs these tests inject "
                   "are not injected (move the patch point in tests/test_equivalence.py)")


def test_a_data_parallel_run_passes(batches, reference):
    equivalence.assert_same(equivalence.run(batches, *DATA), reference)


def _doubled_gradient(fun, has_aux):
    """fun with its value unchanged (v + 0) and its gradient doubled."""
    def doubled(*args, **kwargs):
        out = fun(*args, **kwargs)
        value = out[0] if has_aux else out
        value = value + (value - jax.lax.stop_gradient(value))
        return (value, *out[1:]) if has_aux else value

    return doubled


@pytest.mark.parametrize("optim, seen_in", [([], "grad_norm"), (UNCLIPPED, "mu[")], ids=["clipped", "unclipped"])
def test_a_doubled_gradient_fails(batches, monkeypatch, optim, seen_in):
    want = equivalence.reference(batches, *optim)
    given = _differentiating(monkeypatch, _doubled_gradient)
    got = equivalence.run(batches, *DATA, *optim)
    _reached(given)
    with pytest.raises(AssertionError, match=seen_in.replace("[", r"\[")):
        equivalence.assert_same(got, want)


def _handoff(mesh, reduce):
    """The identity, whose backward pass hands the (replicated) cotangent through shard_map and reduces it over
    `data` with `reduce`: pmean gives it back unchanged, psum counts each of the data axis's copies."""
    @jax.custom_vjp
    def handoff(x):
        return x

    def backward(_, g):
        spec = PartitionSpec()
        return jax.shard_map(lambda g: reduce(g, "data"), mesh=mesh, in_specs=spec, out_specs=spec,
                             check_vma=False)(g),

    handoff.defvjp(lambda x: (x, None), backward)
    return handoff


def _one_gradient_reduced(meshes, reduce, touched):
    """change() for _differentiating: the first parameter whose path names a norm goes through _handoff on its way
    into the function (so its gradient comes out through it); its path is appended to `touched`."""
    def change(fun, has_aux):
        def changed(params, *args, **kwargs):
            flat, tree = jax.tree_util.tree_flatten_with_path(params)
            (i, path), *_ = [(i, jax.tree_util.keystr(p)) for i, (p, _) in enumerate(flat) if "norm" in
                             jax.tree_util.keystr(p)]
            touched.append(path)
            leaves = [x for _, x in flat]
            leaves[i] = _handoff(meshes[-1], reduce)(leaves[i])
            return fun(jax.tree.unflatten(tree, leaves), *args, **kwargs)

        return changed

    return change


@pytest.mark.parametrize("reduce, fails", [(jax.lax.psum, True), (jax.lax.pmean, False)], ids=["psum", "pmean"])
def test_a_psum_where_a_pmean_belongs_fails(batches, reference, monkeypatch, reduce, fails):
    """One parameter's gradient, replicated over `data`, reduced over it again by hand: summed (the bug) it is
    doubled, and the harness names that parameter's moment (Adam divides the scale out of the parameter's own
    update, and the gradient norm hardly changes: a norm's gain is a small part of it); averaged (right), the
    run passes."""
    meshes, touched, build = [], [], trainer.build

    def recording_build(*args, **kwargs):
        setup = build(*args, **kwargs)
        meshes.append(setup.mesh)
        return setup

    monkeypatch.setattr(trainer, "build", recording_build)
    given = _differentiating(monkeypatch, _one_gradient_reduced(meshes, reduce, touched))
    got = equivalence.run(batches, *DATA)
    _reached(given)
    assert touched, "the step's differentiated function was never traced"
    if not fails:
        equivalence.assert_same(got, reference)
        return
    with pytest.raises(AssertionError) as failure:
        equivalence.assert_same(got, reference)
    assert f"mu{touched[0]}" in str(failure.value)


def test_the_assertion_names_what_differs(reference):
    """Every difference, each named: a step's loss, a parameter, a moment."""
    import copy

    changed = copy.deepcopy(reference)
    changed.metrics[1]["loss"] *= 1 + 1e-4
    (path, leaf), *_ = jax.tree_util.tree_flatten_with_path(changed.params)[0]
    leaf += 1e-3 * np.linalg.norm(leaf) / np.sqrt(leaf.size)
    equivalence.assert_same(reference, copy.deepcopy(reference))
    with pytest.raises(AssertionError) as failure:
        equivalence.assert_same(changed, reference)
    message = str(failure.value)
    assert "step 2 loss" in message and f"params{jax.tree_util.keystr(path)}" in message
    assert "in 2 place(s)" in message
