"""One truth: the planner's per-device bytes of parameters, gradients and optimizer state are those of the arrays
the trainer creates, exactly, for every sharding preset on every 8-device mesh of the equivalence matrix
(test_parallel.py) and on 8-device meshes that split a mixture of experts over `expert` - and a parallelism check
the trainer makes is a warning the planner gives."""

import itertools

import jax
import numpy as np
import pytest

from scaletrain import config
from scaletrain.errors import ConfigError
from scaletrain.parallel import checks
from scaletrain.planner import memory, roofline
from scaletrain.train import trainer
from tests.conftest import tiny_overrides
from tests.test_parallel import MATRIX_MODEL

MESHES = [(d, f, t) for d, f, t in itertools.product((1, 2, 4, 8), repeat=3) if d * f * t == 8]
PRESETS = ("fsdp", "dp", "zero1", "zero2")
MOE = ["model.num_experts=8", "model.experts_per_token=2", "model.moe_d_ff=64"]
# (data, fsdp, expert, tensor, moe_every): the experts over expert alone and beside each other axis; and a stack of
# groups, a dense layer then a MoE layer (params["layers"]["dense"] and ["moe"]).
MOE_MESHES = [(1, 1, 8, 1, 1), (1, 2, 4, 1, 1), (2, 1, 4, 1, 1), (1, 1, 4, 2, 1), (2, 2, 2, 1, 1), (1, 2, 2, 2, 1),
              (1, 2, 4, 1, 2)]


def _device_bytes(arrays) -> int:
    """Bytes of each tree's arrays on one device (the first), where they are: every device holds as much."""
    device = jax.devices()[0]
    return sum(shard.data.nbytes for x in jax.tree.leaves(arrays) for shard in x.addressable_shards
               if shard.device == device)


def _placed(abstract):
    """Arrays of the shapes, dtypes and shardings of a tree of ShapeDtypeStructs (zeros: bytes are what count)."""
    return jax.tree.map(lambda x: jax.device_put(np.zeros(x.shape, x.dtype), x.sharding), abstract)


def _setup(preset, data, fsdp, tensor, *overrides):
    cfg = config.load(None, tiny_overrides("unused") + MATRIX_MODEL + [
        f"sharding.preset={preset}", f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}", *overrides])
    return trainer.build(cfg, jax.devices()[:8])


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("data, fsdp, tensor", MESHES)
def test_planned_state_bytes_are_the_trainers(preset, data, fsdp, tensor):
    _assert_planned_state_is_the_trainers(_setup(preset, data, fsdp, tensor))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("data, fsdp, expert, tensor, every", MOE_MESHES)
def test_planned_expert_state_bytes_are_the_trainers(preset, data, fsdp, expert, tensor, every):
    """The experts split over `expert` (and their width over `tensor`, their d_model as each preset places it)."""
    setup = _setup(preset, data, fsdp, tensor, f"mesh.expert={expert}", f"model.moe_every={every}", *MOE)
    _assert_planned_state_is_the_trainers(setup)


def _assert_planned_state_is_the_trainers(setup):
    """The state as the trainer's init returns it (its abstract_state: init's shapes and dtypes with the state
    shardings, which init's out_shardings and a restore both use), and the gradients as the step places them."""
    state = _placed(setup.abstract_state)
    grads = _placed(jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                 setup.abstract_state.params, setup.grad_shardings))
    planned = memory.state(setup.cfg, dict(setup.mesh.shape))
    assert (planned.params, planned.optimizer, planned.gradients) == (
        _device_bytes(state.params), _device_bytes(state.opt_state), _device_bytes(grads))


def test_init_creates_the_abstract_state():
    """What the test above counts is what init makes: one mesh, compiled."""
    setup = _setup("zero1", 2, 2, 2)
    state = setup.init(jax.random.PRNGKey(0))
    assert jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), state) == jax.tree.map(
        lambda x: (x.shape, x.dtype, x.sharding), setup.abstract_state)


def test_a_mesh_the_trainer_refuses_is_planned_with_its_reason():
    cfg = config.load(None, tiny_overrides("unused") + ["mesh.tensor=8", "mesh.fsdp=1"])  # 4 heads over 8
    with pytest.raises(ConfigError) as refused:
        trainer.build(cfg, jax.devices()[:8])
    warnings = roofline.plan(cfg, "v5p:2x2x2")["warnings"]
    assert f"the trainer refuses this mesh: {refused.value}" in warnings
    sizes = {**dict.fromkeys(config.MESH_AXES, 1), "tensor": 8}
    assert checks.problems(cfg, sizes)[0] == str(refused.value)


def test_an_array_the_mesh_does_not_divide_is_refused_by_both():
    cfg = config.load(None, tiny_overrides("unused") + ["model.d_model=68", "mesh.fsdp=8"])
    with pytest.raises(ConfigError) as refused:
        trainer.build(cfg, jax.devices()[:8])
    assert "model.d_model=68 is not divisible by mesh.fsdp=8" in str(refused.value)
    assert f"the trainer refuses this mesh: {refused.value}" in roofline.plan(cfg, "v5p:2x2x2")["warnings"]
