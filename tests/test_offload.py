"""State offload: Adam's moments (optim.offload) and the parameters (params.offload) in host memory, updated a
layer at a time, train exactly like the on-device update, and their bytes leave the device."""

import jax
import numpy as np
import pytest

from scaletrain import config
from scaletrain.facts import fit
from scaletrain.train import trainer
from tests import equivalence
from tests.conftest import tiny_overrides

STEPS = 3
# Clipping that acts on every step (the tiny model's gradient norm is ~1-3), and decay on everything, so that
# every part of the update is exercised.
OPTIM = ["optim.grad_clip_norm=0.5", "optim.decay_norms=true", "optim.decay_embeddings=true"]


def _setup(devices, *overrides):
    return trainer.build(config.load(None, tiny_overrides("unused", steps=STEPS) + OPTIM + list(overrides)), devices)


MESH = ["mesh.fsdp=4", "mesh.tensor=2"]


def _train(batches, *overrides):
    run = equivalence.run(batches, *OPTIM, *MESH, *overrides)
    return run, jax.device_get(run.state)


@pytest.fixture(scope="module")
def reference(batches):
    return _train(batches)


def test_streamed_update_equals_the_update_on_device(batches, reference):
    """With params.offload: moments and parameters both streamed (optim.offload alone streams the moments
    through the same code; its memory is checked below). Every step's loss and gradient norm within 1e-6, and
    every array of the state (parameters, both moments, step, RNG) element by element (1e-6, atol 1e-7)."""
    run, state = _train(batches, "params.offload=true")
    want_run, want = reference
    equivalence.assert_same(run, want_run, loss=1e-6, grad_norm=1e-6)
    for got, expected in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    setup = run.setup
    kinds = {s.memory_kind for s in jax.tree.leaves(setup.state_shardings.opt_state)}
    assert kinds == {"pinned_host"}
    assert setup.state_shardings.params["embed"]["table"].memory_kind == "pinned_host"


def test_offloaded_state_leaves_the_device():
    """On a TPU topology, ahead of time (the CPU backend compiles memory-kind moves away): the moments' bytes
    move from device arguments to host arguments, and the streamed update needs only a few layers' worth of
    them on the device, not all of them. With parameters offloaded too, no state is left on the device."""
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(topology_name="v5p:2x2x2", platform="tpu").devices
    shape = ["mesh.fsdp=8", "model.num_layers=16", "model.d_model=256", "model.d_ff=1024", "remat.policy=full"]

    def compiled(*overrides):
        setup = _setup(devices, *shape, *overrides)
        params_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(setup.abstract_state.params)) // 8
        step = equivalence.compiled_step(setup)
        return fit.compiled(step.memory_analysis()), params_bytes

    on_device, params_bytes = compiled()
    moments = 2 * params_bytes
    optim_host, _ = compiled("optim.offload=true")
    params_host, _ = compiled("params.offload=true")
    assert on_device["host_total"] == 0
    assert optim_host["host_arguments"] >= moments
    assert optim_host["device_arguments"] <= on_device["device_arguments"] - moments
    # One layer's moments are moments / 16; the streamed update holds a few at a time (and tiles pad them).
    assert optim_host["device_total"] <= on_device["device_total"] - moments / 2, (optim_host, on_device)
    assert params_host["host_arguments"] >= moments + params_bytes
    assert params_host["device_arguments"] < params_bytes / 100


def test_a_nonfinite_step_changes_no_offloaded_state(batches):
    setup = _setup(jax.devices(), "mesh.fsdp=8", "params.offload=true")
    start = equivalence.start(setup, *OPTIM)  # compiled and started as tests/equivalence.py's run
    before = jax.device_get((start.params, start.opt_state))
    poisoned = {k: v.copy() for k, v in batches[0].items()}
    poisoned["loss_mask"][3, 5] = np.nan
    state, metrics = equivalence.compiled_step(setup)(start, setup.put_batch(poisoned), setup.loss_ceiling())
    assert float(metrics["update_skipped"]) == 1.0
    for a, b in zip(jax.tree.leaves(jax.device_get((state.params, state.opt_state))), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)


def test_jax_still_mistypes_a_host_memory_gradient_in_two_nested_scans():
    """Why a pipeline fetches its stage's weights whole under params.offload (runner.Runner.fetches_layers): the
    pipeline's iterations and a stage's layers are two nested scans, and JAX (0.10.2 and 0.12.0.1) types the
    gradient of a weight fetched from host memory inside both in the wrong memory space (one scan works: the
    plain layer stack). When this fails, JAX is fixed: let pipelines fetch a layer at a time too."""
    mesh = jax.make_mesh((1,), ("x",))
    host = jax.NamedSharding(mesh, jax.P(), memory_kind="pinned_host")
    weights = jax.device_put(np.full((4, 8, 8), 0.1, np.float32), host)

    def layer(h, w):
        return jax.numpy.tanh(h @ jax.device_put(w, jax.memory.Space.Device)), None  # constrain_param's fetch

    def loss(weights, x):
        def iteration(total, x):
            return total + jax.lax.scan(layer, x, weights)[0].sum(), None
        return jax.lax.scan(iteration, 0.0, x)[0]

    grad = jax.jit(jax.grad(loss), out_shardings=host)
    with pytest.raises(ValueError, match=r"Expected cotangent type float32\[8,8\] but got float32<host>\[8,8\]"):
        grad(weights, np.ones((3, 2, 8), np.float32))
