"""Every parallel layout trains exactly like one device (fp32, 3 updates): every step's loss and gradient norm, and the
final parameters and Adam moments, within 1e-5 relative (tests/equivalence.py, the harness: a new parallelism joins
by adding its meshes to MATRIX).
"""

import itertools

import jax
import numpy as np
import pytest

from scaletrain import config
from scaletrain.train import trainer
from tests import equivalence
from tests.conftest import tiny_overrides

STEPS = 3


@pytest.fixture(scope="module")
@equivalence.computed_once
def reference(batches):
    return equivalence.reference(batches)


def _spec(array):
    return tuple(array.sharding.spec)


REPLICATED = (None, None, None)
# layout: (overrides, expected spec of a [layers, embed, mlp] weight, expected spec of its Adam moment)
LAYOUTS = {  # beyond the matrix below
    # ZeRO-2 with its data axis across two slices (DCN): the moments sharded over both levels' ways.
    "zero2 dcn_data=2 x fsdp=4": (["mesh.dcn_data=2", "mesh.fsdp=4", "sharding.preset=zero2"], REPLICATED,
                                  (None, ("data", "fsdp"), None)),
    "dp fsdp=8": (["mesh.fsdp=8", "sharding.preset=dp"], REPLICATED, REPLICATED),
}


# Every mesh over 8 devices among data, fsdp and tensor (degrees 1, 2, 4, 8), with ZeRO-1 and ZeRO-3, on a model
# whose 8 heads and 384-token vocabulary split 8 ways; its 2 kv heads are sharded at tensor=2 and replicated
# at tensor=4 and 8. Sequence parallelism is on (the default).
MATRIX_MODEL = ["model.num_heads=8", "model.head_dim=8"]
# Every factorisation of 8 devices with the fsdp preset; ZeRO-1 (which differs in where the moments live) on
# the meshes where it shards them differently: over data (data=4, with tensor) and over data x fsdp (with tensor).
_ZERO1_MESHES = ((2, 2, 2), (4, 1, 2))
MATRIX = {
    f"{preset} data={d} fsdp={f} tensor={t}": (preset, d, f, t)
    for preset in ("fsdp", "zero1")
    for d, f, t in itertools.product((1, 2, 4, 8), repeat=3)
    if d * f * t == 8 and (preset == "fsdp" or (d, f, t) in _ZERO1_MESHES)
}
# Features a matrix mesh trains beside its layout, against the same one-device run: logits a block of 8 positions
# at a time, on a sequence-parallel mesh with a vocab-parallel projection; four accumulated microbatches of 2 rows
# (like the whole batch at once) split over fsdp=2, beside tensor=4, with the parameters in host memory (their
# gradients' running sum made there and added to a layer at a time: the pairing docs/parallelism.md lists as
# params.offload with accum).
MATRIX_EXTRA = {"fsdp data=1 fsdp=4 tensor=2": ["model.logits_block=8"],
                "fsdp data=1 fsdp=2 tensor=4": ["train.grad_accum_steps=4", "params.offload=true"]}


def _expected_specs(preset, data, fsdp, tensor):
    """Specs of a [layers, embed, mlp] weight and its Adam moment: ZeRO-3 shards both over fsdp, ZeRO-1 only
    the moment, over data x fsdp; both shard mlp over tensor. Size-1 axes are left out of specs."""
    def axes(*names):
        kept = tuple(n for n, size in zip(names, (data, fsdp)[-len(names):]) if size > 1)
        return None if not kept else kept[0] if len(kept) == 1 else kept
    mlp = "tensor" if tensor > 1 else None
    if preset == "fsdp":
        return (None, axes("fsdp"), mlp), (None, axes("fsdp"), mlp)
    return (None, None, mlp), (None, axes("data", "fsdp"), mlp)


@pytest.fixture(scope="module")
@equivalence.computed_once
def matrix_reference(batches):
    return equivalence.reference(batches, *MATRIX_MODEL)


def _assert_layout(run, param_spec, moment_spec):
    """The layout really is the one asked for: parameters and Adam moments sharded as the preset says."""
    assert _spec(run.state.params["layers"]["mlp"]["w_gate"]) == param_spec
    assert _spec(equivalence.adam_mu(run.state.opt_state)["layers"]["mlp"]["w_gate"]) == moment_spec


@pytest.mark.parametrize("mesh", MATRIX)
def test_mesh_matrix_equals_single_device(mesh, batches, matrix_reference):
    preset, data, fsdp, tensor = MATRIX[mesh]
    run = equivalence.run(batches, *MATRIX_MODEL, f"sharding.preset={preset}", f"mesh.data={data}",
                          f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}", *MATRIX_EXTRA.get(mesh, []))
    equivalence.assert_same(run, matrix_reference)
    _assert_layout(run, *_expected_specs(preset, data, fsdp, tensor))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_equals_single_device(layout, batches, reference):
    overrides, param_spec, moment_spec = LAYOUTS[layout]
    run = equivalence.run(batches, *overrides)
    equivalence.assert_same(run, reference)
    assert run.losses[-1] < run.losses[0]
    _assert_layout(run, param_spec, moment_spec)


# Init, compiled for a mesh, makes the values it makes on one device: the equivalence tests start from those
# (tests/equivalence.py), placed like a restored checkpoint, rather than compile init for each mesh.
INIT_MESHES = {
    "zero1 data=2 x fsdp=2 x tensor=2": [*MATRIX_MODEL, "sharding.preset=zero1", "mesh.data=2", "mesh.fsdp=2",
                                         "mesh.tensor=2"],
    "circular pipeline=2 x repeats=2, fsdp=2": ["model.num_layers=4", "mesh.pipeline=2", "mesh.fsdp=2",
                                                "pipeline.schedule=circular", "pipeline.repeats=2"],
    "experts: expert=4 x tensor=2, offloaded": ["model.num_experts=8", "model.experts_per_token=2",
                                                "model.moe_d_ff=64", "mesh.expert=4", "mesh.tensor=2",
                                                "params.offload=true", "optim.offload=true"],
}


@pytest.mark.parametrize("mesh", INIT_MESHES)
def test_init_is_the_same_on_every_mesh(mesh):
    overrides = INIT_MESHES[mesh]
    cfg = equivalence.load_config(1, *overrides)
    setup = trainer.build(cfg, jax.devices()[:equivalence.mesh_devices(cfg)])
    got = jax.device_get(setup.to_disk(setup.init(jax.random.PRNGKey(0))))
    want = equivalence.initial_state(*overrides)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_batch_is_sharded_over_data_and_fsdp():
    cfg = config.load(None, tiny_overrides("unused", **{"mesh.data": 2, "mesh.fsdp": 4}))
    setup = trainer.build(cfg, jax.devices())
    assert tuple(setup.batch_sharding.spec) == (("data", "fsdp"), None)


def test_accumulated_microbatches_equal_the_large_batch(batches, reference):
    """Four microbatches of 2 rows on one device: like the whole batch on one (the reference). Split over fsdp=2
    (beside tensor=4): the matrix's "fsdp data=1 fsdp=2 tensor=4" (MATRIX_EXTRA)."""
    equivalence.assert_same(equivalence.run(batches, "train.grad_accum_steps=4"), reference)


def test_a_nonfinite_update_is_dropped(batches):
    cfg = config.load(None, tiny_overrides("unused", steps=STEPS, **{"mesh.fsdp": 8}))
    setup = trainer.build(cfg, jax.devices())
    start, step = equivalence.start(setup), equivalence.compiled_step(setup)  # as tests/equivalence.py's run
    before = jax.device_get((start.params, start.opt_state))
    poisoned = dict(batches[0], loss_mask=batches[0]["loss_mask"].copy())
    poisoned["loss_mask"][3, 5] = np.nan
    state, metrics = step(start, setup.put_batch(poisoned), setup.loss_ceiling())
    assert np.isnan(metrics["loss"]) and float(metrics["update_skipped"]) == 1.0
    after = jax.device_get((state.params, state.opt_state))
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)
    assert int(state.step) == 1
    state, metrics = step(state, setup.put_batch(batches[1]), setup.loss_ceiling())
    assert np.isfinite(metrics["loss"]) and float(metrics["update_skipped"]) == 0.0


@pytest.mark.parametrize("overrides, message", [
    (["model.num_heads=6", "model.num_kv_heads=3", "mesh.fsdp=4", "mesh.tensor=2"],
     "model.num_kv_heads=3 and mesh.tensor=2"),
    (["data.seq_len=30", "mesh.fsdp=2", "mesh.tensor=4"], "data.seq_len=30 is not divisible by mesh.tensor=4"),
])
def test_tensor_parallel_refusals_name_the_keys(overrides, message):
    from scaletrain.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        trainer.build(config.load(None, tiny_overrides("unused") + overrides), jax.devices())
