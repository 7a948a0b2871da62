"""Fingerprints of the training state: what a checkpoint's arrays held when they were saved.

Orbax checks that a checkpoint is complete, not that its bytes are the ones written: a file garbled in place
(a bad disk, a truncated copy, a stray `dd`) can restore into an array of the right shape with wrong values, and
training from it would poison every later checkpoint. So every save records a fingerprint of each array, and a
restore recomputes it on the restored arrays and compares.

The fingerprint is computed where the arrays are, on the devices, inside one jitted function: each device mixes each
element's bits with its global position (a per-axis salt, then MurmurHash3's finaliser) and sums the mixed words of
its own blocks modulo 2^32 in two lanes (64 bits): the words, and the words times themselves. Addition modulo 2^32
is exact and order-free, so the result does not depend on the sharding: a checkpoint saved on one mesh verifies on
any other, and the all-reduce that combines the shards moves 8 bytes per array. The finaliser is a bijection, so one
changed element always changes the first lane; changes to many elements escape both lanes with a probability of the
order of 2^-64. Elements moved to other positions (a shard restored in the wrong place) change the salt, so they are
caught too.

Arrays in host memory (`optim.offload`, `params.offload`) are fingerprinted a slice of their leading axis at a
time, so the device never holds more of them than the streamed update does.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Odd multipliers (from the golden ratio and MurmurHash3's finaliser): each position gets a distinct salt, and the
# finaliser spreads a one-bit change of the input over the whole word.
_AXIS_SALTS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1, 0xD3A2646C, 0xFD7046C5, 0xB55A4F09)
# Recorded with every checkpoint's fingerprints: a restore compares only fingerprints computed the same way.
VERSION = 1
_UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _fmix32(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The array's bits as uint32, one word per element."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return jax.lax.bitcast_convert_type(x, _UINT_OF_WIDTH[x.dtype.itemsize]).astype(jnp.uint32)


def _partial(x: jax.Array, offsets: Sequence[jax.Array | int] = ()) -> jax.Array:
    """uint32[2]: the two lanes' sums over the elements of `x`, a block of a larger array whose index along each
    axis starts at `offsets` (zeros when not given)."""
    words = _words(x)
    salt = jnp.zeros(words.shape, jnp.uint32)
    for axis in range(words.ndim):
        index = jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
        if axis < len(offsets):
            index = index + jnp.asarray(offsets[axis], jnp.uint32)
        salt = salt + index * jnp.uint32(_AXIS_SALTS[axis % len(_AXIS_SALTS)])
    mixed = _fmix32(words ^ salt)
    # fmix32 is a bijection, so the first lane changes whenever exactly one element does; the second, a square,
    # makes changes that cancel in the first (several elements at once) unlikely to cancel in both.
    return jnp.stack([jnp.sum(mixed, dtype=jnp.uint32), jnp.sum(mixed * (mixed | jnp.uint32(1)), dtype=jnp.uint32)])


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _shard_partial(x: jax.Array, spec: PartitionSpec, mesh: Mesh) -> jax.Array:
    """Inside shard_map: this device's block's sums, counted once - by the replica at index 0 of every mesh axis
    the array is not split over."""
    offsets = []
    for size, entry in zip(x.shape, tuple(spec) + (None,) * (x.ndim - len(spec))):
        block = 0
        for name in _axes(entry):
            block = block * mesh.shape[name] + jax.lax.axis_index(name)
        offsets.append(block * size)
    split = {name for entry in spec for name in _axes(entry)}
    owner = jnp.array(True)
    for name in mesh.axis_names:
        if name not in split:
            owner = owner & (jax.lax.axis_index(name) == 0)
    return _partial(x, offsets) * owner.astype(jnp.uint32)


def _sharded(leaves: list[jax.Array], shardings: list[NamedSharding]) -> jax.Array:
    """uint32[leaves, 2] of arrays on one mesh's devices: each device sums its own blocks (no collective), then
    one all-reduce of 8 bytes per array. Far cheaper than a sharded reduction per array, which XLA partitions
    into a collective each."""
    mesh, specs = shardings[0].mesh, tuple(s.spec for s in shardings)
    per_device = jax.shard_map(
        lambda *xs: jnp.stack([_shard_partial(x, spec, mesh) for x, spec in zip(xs, specs)])[None],
        mesh=mesh, in_specs=specs, out_specs=PartitionSpec(mesh.axis_names), check_vma=False)(*leaves)
    return jnp.sum(per_device, axis=0, dtype=jnp.uint32)


def _in_host_memory(sharding) -> bool:
    return getattr(sharding, "memory_kind", None) == "pinned_host"


def _streamed(x: jax.Array) -> jax.Array:
    """An array in host memory, brought to the device a slice of its leading axis at a time."""
    if x.ndim == 0:
        return _partial(jax.device_put(x, jax.memory.Space.Device))

    def body(i, total):
        part = jax.device_put(jax.lax.dynamic_index_in_dim(x, i, keepdims=True), jax.memory.Space.Device)
        return total + _partial(part, (i,))

    return jax.lax.fori_loop(0, x.shape[0], body, jnp.zeros(2, jnp.uint32))


def make(abstract_tree: Any) -> Callable[[Any], jax.Array]:
    """A jitted function: a tree shaped like `abstract_tree` -> uint32[leaves, 2], replicated."""
    return _jitted(tuple(getattr(x, "sharding", None) for x in jax.tree.leaves(abstract_tree)))


@functools.cache  # one function per placement: jit then compiles it once
def _jitted(shardings: tuple) -> Callable[[Any], jax.Array]:
    mesh = next((s.mesh for s in shardings if isinstance(s, NamedSharding)), None)
    on_mesh = [i for i, s in enumerate(shardings) if isinstance(s, NamedSharding) and s.mesh == mesh
               and not _in_host_memory(s)]

    def fingerprint(tree):
        leaves = jax.tree.leaves(tree)
        sums = [None] * len(leaves)
        if on_mesh:
            for i, row in zip(on_mesh, _sharded([leaves[i] for i in on_mesh], [shardings[i] for i in on_mesh])):
                sums[i] = row
        for i, x in enumerate(leaves):
            if sums[i] is None:  # in host memory, or not placed on the mesh (a numpy array, one device)
                sums[i] = _streamed(x) if _in_host_memory(shardings[i]) else _partial(x)
        return jnp.stack(sums)

    return jax.jit(fingerprint)


def by_path(tree: Any, sums: jax.Array) -> dict[str, str]:
    """{keystr of each leaf: 16 hex digits}, for a checkpoint's JSON metadata."""
    values = np.asarray(jax.device_get(sums), np.uint64)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return {p: f"{int(hi) << 32 | int(lo):016x}" for p, (hi, lo) in zip(paths, values)}


def of_json(value: Any) -> str:
    """A fingerprint of a JSON-able value (the data position, the metadata itself)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def mismatches(saved: dict[str, str], restored: dict[str, str]) -> list[str]:
    """The paths whose fingerprints differ, or that one side lacks."""
    return sorted(p for p in saved.keys() | restored.keys() if saved.get(p) != restored.get(p))
