"""The device mesh: axes data, fsdp, expert, pipeline, tensor from ICI (`mesh.X`) and DCN (`mesh.dcn_X`) degrees.

One code path for real devices, simulated CPU devices and the devices of an ahead-of-time TPU topology.
Axes are `Auto` (GSPMD propagation): sharding is decided by rule tables (sharding.py), and XLA inserts the
collectives; model code never names these axes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from scaletrain.config import MESH_AXES
from scaletrain.errors import ConfigError


@dataclass(frozen=True)
class MeshShape:
    ici: dict[str, int]
    dcn: dict[str, int]




def _fill(degrees: dict[str, int], total: int, what: str, prefix: str) -> dict[str, int]:
    """Replace the one -1 by whatever makes the product equal `total`."""
    fills = [a for a, d in degrees.items() if d == -1]
    if len(fills) > 1:
        raise ConfigError(f"at most one {what} mesh degree may be -1, got {', '.join(prefix + a for a in fills)}")
    known = math.prod(d for d in degrees.values() if d != -1)
    product = " x ".join(f"{prefix}{a}={d}" for a, d in degrees.items() if d != 1)
    if fills:
        if total % known:
            raise ConfigError(f"{what} mesh degrees {product} cannot fill {total} devices: "
                              f"{total} is not divisible by {known}")
        return {a: (total // known if d == -1 else d) for a, d in degrees.items()}
    if known != total:
        raise ConfigError(f"{what} mesh degrees multiply to {known} ({product or 'all 1'}) but there are {total} "
                          f"{'slices' if what == 'DCN' else 'devices per slice'}; the product must equal it "
                          f"(set one degree to -1 to fill)")
    return dict(degrees)


def num_slices(devices: Sequence[jax.Device]) -> int:
    return len({getattr(d, "slice_index", 0) for d in devices})


def resolve(mesh_cfg, devices: Sequence[jax.Device]) -> MeshShape:
    """Resolve -1s and check the degrees against the devices. Raises ConfigError."""
    dcn = {a: int(mesh_cfg[f"dcn_{a}"]) for a in MESH_AXES}
    slices = num_slices(devices)
    if slices == 1 and -1 not in dcn.values():
        slices = math.prod(dcn.values())  # simulated multislice (CPU): split the devices evenly
    if len(devices) % slices:
        raise ConfigError(f"{len(devices)} devices cannot be split into {slices} slices")
    dcn = _fill(dcn, slices, "DCN", "mesh.dcn_")
    ici = _fill({a: int(mesh_cfg[a]) for a in MESH_AXES}, len(devices) // slices, "ICI", "mesh.")
    return MeshShape(ici=ici, dcn=dcn)


def build(shape: MeshShape, devices: Sequence[jax.Device]) -> Mesh:
    ici = [shape.ici[a] for a in MESH_AXES]
    dcn = [shape.dcn[a] for a in MESH_AXES]
    if math.prod(dcn) == 1:
        arr = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
    elif num_slices(devices) > 1:
        arr = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
    else:
        arr = _simulated_hybrid(ici, dcn, devices)
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _simulated_hybrid(ici: list[int], dcn: list[int], devices: Sequence[jax.Device]) -> np.ndarray:
    """Consecutive blocks of devices play slices; each axis is DCN-major, as in create_hybrid_device_mesh."""
    n = len(ici)
    arr = np.asarray(devices, dtype=object).reshape(dcn + ici)
    arr = arr.transpose([i for pair in zip(range(n), range(n, 2 * n)) for i in pair])
    return arr.reshape([d * i for d, i in zip(dcn, ici)])


def describe(axis_sizes: Mapping[str, int]) -> str:
    """'data=2 x fsdp=4': the axes of size > 1 of a mesh's shape (or of one saved in checkpoint metadata)."""
    return " x ".join(f"{a}={n}" for a, n in axis_sizes.items() if n > 1) or "1 device"


def make_mesh(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    return build(resolve(mesh_cfg, devices), devices)
