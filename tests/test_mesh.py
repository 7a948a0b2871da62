import jax
import numpy as np
import pytest

from scaletrain import config
from scaletrain.errors import ConfigError
from scaletrain.parallel import mesh


def _mesh_cfg(**degrees):
    return config.load(None, [f"mesh.{k}={v}" for k, v in degrees.items()]).mesh


def test_fill_and_axis_order():
    m = mesh.make_mesh(_mesh_cfg(data=2, fsdp=-1))
    assert m.axis_names == ("data", "fsdp", "expert", "pipeline", "context", "tensor")
    assert dict(m.shape) == {"data": 2, "fsdp": 4, "expert": 1, "pipeline": 1, "context": 1, "tensor": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in m.axis_types)


@pytest.mark.parametrize("degrees, message", [
    (dict(fsdp=4), "multiply to 4 .* there are 8 devices"),
    (dict(data=-1, fsdp=-1), "at most one ICI mesh degree may be -1"),
    (dict(data=3, fsdp=-1), "not divisible by 3"),
])
def test_degree_errors(degrees, message):
    with pytest.raises(ConfigError, match=message):
        mesh.make_mesh(_mesh_cfg(**degrees))


def test_simulated_multislice_is_dcn_major():
    # Two simulated slices of 4 devices: the data axis crosses slices, so each slice is one data row.
    m = mesh.make_mesh(_mesh_cfg(dcn_data=2, fsdp=4))
    ids = np.vectorize(lambda d: d.id)(m.devices).reshape(2, 4)
    assert dict(m.shape)["data"] == 2 and dict(m.shape)["fsdp"] == 4
    assert sorted(ids[0]) == [0, 1, 2, 3] and sorted(ids[1]) == [4, 5, 6, 7]


def test_single_device_subset():
    m = mesh.make_mesh(_mesh_cfg(), jax.devices()[:1])
    assert m.devices.size == 1


def test_same_code_path_for_an_aot_tpu_topology():
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(topology_name="v5p:2x2x2", platform="tpu").devices
    m = mesh.make_mesh(_mesh_cfg(fsdp=-1, tensor=2), devices)
    assert dict(m.shape)["fsdp"] == 4 and dict(m.shape)["tensor"] == 2
    assert m.devices.flat[0].platform == "tpu"
