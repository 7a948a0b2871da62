"""Rule tables resolve logical names to mesh axes; divisibility errors name the config key."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from scaletrain import config
from scaletrain.errors import ConfigError
from scaletrain.parallel import mesh, sharding


@pytest.fixture(scope="module")
def m():
    return mesh.make_mesh(config.load(None, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]).mesh)


def test_presets_place_parameters_and_optimizer_state(m):
    w = ("layers", "embed", "mlp")
    fsdp, zero1, zero2, dp = (sharding.PRESETS[n] for n in ("fsdp", "zero1", "zero2", "dp"))
    assert sharding.spec(w, fsdp.params, m) == P(None, "fsdp", "tensor")
    assert sharding.spec(w, zero1.params, m) == P(None, None, "tensor")
    assert sharding.spec(w, zero1.opt_state, m) == P(None, ("data", "fsdp"), "tensor")
    assert sharding.spec(w, zero1.grads, m) == P(None, None, "tensor")
    assert sharding.spec(w, zero2.grads, m) == P(None, ("data", "fsdp"), "tensor")
    assert sharding.spec(w, dp.opt_state, m) == P(None, None, "tensor")
    assert sharding.spec(("batch", "seq", "embed"), fsdp.activations, m) == P(("data", "fsdp"), None, None)


def test_axes_of_size_one_are_dropped():
    m1 = mesh.make_mesh(config.load(None, ["mesh.fsdp=8"]).mesh)
    assert sharding.spec(("batch", "seq", "heads"), sharding.PRESETS["fsdp"].activations, m1) == P("fsdp", None, None)


def test_divisibility_error_names_the_config_key(m):
    with pytest.raises(ConfigError, match=r"model.d_ff=7 is not divisible by mesh.tensor=2"):
        sharding.check_divisible("w_up", (4, 7), ("embed", "mlp"), sharding.PRESETS["fsdp"].params, m)


def test_constrain_is_a_no_op_outside_a_step_and_binds_inside(m):
    x = jax.numpy.zeros((4, 8))
    assert sharding.constrain(x, ("batch", "embed")) is x

    @jax.jit
    def f(x):
        with sharding.use_rules(m, sharding.PRESETS["fsdp"]):
            return sharding.constrain(x * 2, ("batch", "embed"))

    assert f(x).sharding.spec[0] == ("data", "fsdp")


def test_rules_for_adds_sequence_parallelism_and_replicated_kv_heads():
    plain = sharding.rules_for("fsdp", sequence_parallel=False, shard_kv_heads=True)
    assert plain == sharding.PRESETS["fsdp"]
    adapted = sharding.rules_for("zero1", sequence_parallel=True, shard_kv_heads=False)
    assert adapted.activations["residual_seq"] == ("context", "tensor")
    assert plain.activations["residual_seq"] == plain.activations["seq"] == "context"
    for table in (adapted.params, adapted.grads, adapted.opt_state, adapted.activations):
        assert table["kv_heads"] is None and table["heads"] == "tensor"
