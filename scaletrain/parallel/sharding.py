"""Logical axis names, sharding rule presets, and their resolution to NamedShardings.

Model code annotates parameters and activations with the logical names below; a preset maps each name to
mesh axes, separately for parameters at rest, gradients, optimizer state and activations. Data parallel,
FSDP (ZeRO-3), ZeRO-1 and ZeRO-2 are rule tables, not model changes. docs/sharding.md is the table in prose.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from scaletrain.errors import ConfigError
from scaletrain.parallel import context

LOGICAL_AXES = ("batch", "seq", "residual_seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers",
                "experts", "moe_mlp", "sublayers", "stage", "latent", "latent_in")

# The config key that sets each logical dim: named in divisibility errors.
SIZE_KEY = {
    "batch": "train.global_batch / train.grad_accum_steps",
    "seq": "data.seq_len",
    "residual_seq": "data.seq_len",
    "embed": "model.d_model",
    "heads": "model.num_heads",
    "kv_heads": "model.num_kv_heads",
    "head_dim": "model.head_dim",
    "mlp": "model.d_ff",
    "vocab": "model.vocab_size",
    "layers": "model.num_layers",
    "experts": "model.num_experts",
    "moe_mlp": "model.moe_d_ff",
    "latent_in": "model.q_lora_rank and model.kv_lora_rank",
}

RuleTable = Mapping[str, Any]

# Activations: batch over every data-parallel axis and the expert axis (whose devices each take a share of the
# batch and send each token to its experts: models/mixtral/moe.py), the sequence over `context` (context
# parallelism: context.py lays it out, attention gathers the keys and values), Megatron-style tensor axes (a no-op
# at tensor=1).
_ACTIVATIONS: RuleTable = {"batch": ("data", "fsdp", "expert"), "seq": "context", "residual_seq": "context",
                           "heads": "tensor", "kv_heads": "tensor",
                           "mlp": "tensor", "moe_mlp": "tensor", "vocab": "tensor", "experts": "expert",
                           "stage": "pipeline"}
# Stacked layers are split over the pipeline stages along `layers`, each stage's devices holding a contiguous
# block of them (pipeline.py): one layout whatever the stage count.
_TENSOR_ONLY: RuleTable = {"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "moe_mlp": "tensor",
                           "vocab": "tensor", "experts": "expert", "stage": "pipeline", "layers": "pipeline"}
# The `context` axis's devices hold other tokens of the same sequences: for the state they are data-parallel
# devices, so FSDP and ZeRO shard over them too (as MaxText does), and their gradients are reduce-scattered.
# Latent attention's expansions (models/deepseek/mla.py) contract the latent (`latent_in`), no `embed` dim to
# shard: their latent is split like `embed`, else every device would keep them whole (DeepSeek-V3 671B: 3.3 G
# parameters, 12 GiB a chip in float32). The compressions' latent (`latent`) is an output beside `embed`: whole.
_FSDP: RuleTable = {**_TENSOR_ONLY, "embed": ("fsdp", "context"), "latent_in": ("fsdp", "context")}
_ZERO: RuleTable = {**_TENSOR_ONLY, "embed": ("data", "fsdp", "context"),
                    "latent_in": ("data", "fsdp", "context")}


@dataclass(frozen=True)
class Rules:
    """Where each logical axis lives, for each kind of array."""

    params: RuleTable
    grads: RuleTable
    opt_state: RuleTable
    activations: RuleTable
    seq_layout: str = "zigzag"  # config.CONTEXT_LAYOUTS: how a sequence split over `context` is laid out


PRESETS: dict[str, Rules] = {
    # Parameters, gradients and optimizer state replicated over data and fsdp; gradients all-reduced.
    "dp": Rules(params=_TENSOR_ONLY, grads=_TENSOR_ONLY, opt_state=_TENSOR_ONLY, activations=_ACTIVATIONS),
    # ZeRO-3: everything sharded over fsdp (data stays a replica axis: hybrid sharding when both are > 1).
    "fsdp": Rules(params=_FSDP, grads=_FSDP, opt_state=_FSDP, activations=_ACTIVATIONS),
    # ZeRO-1: optimizer state sharded over every data-parallel axis; gradients all-reduced, params replicated.
    "zero1": Rules(params=_TENSOR_ONLY, grads=_TENSOR_ONLY, opt_state=_ZERO, activations=_ACTIVATIONS),
    # ZeRO-2: gradients reduce-scattered into the optimizer state's layout too.
    "zero2": Rules(params=_TENSOR_ONLY, grads=_ZERO, opt_state=_ZERO, activations=_ACTIVATIONS),
}


def rules_for(preset_name: str, sequence_parallel: bool, shard_kv_heads: bool, seq_layout: str = "zigzag") -> Rules:
    """A preset, adapted: with sequence parallelism the residual stream (norms, residual adds) is split along
    the sequence over `tensor` too (within each `context` shard), turning each tensor-parallel all-reduce into a
    reduce-scatter + all-gather; with fewer key/value heads than `tensor` ways, K/V projections are replicated
    over `tensor` (each device keeps every K/V head and uses the ones its query heads share)."""
    rules = PRESETS[preset_name]

    def adapt(table: RuleTable) -> RuleTable:
        return {**table, **({} if shard_kv_heads else {"kv_heads": None})}

    activations = {**adapt(rules.activations),
                   **({"residual_seq": ("context", "tensor")} if sequence_parallel else {})}
    return Rules(params=adapt(rules.params), grads=adapt(rules.grads), opt_state=adapt(rules.opt_state),
                 activations=activations, seq_layout=seq_layout)


def mesh_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def split_ways(logical: str, table: RuleTable, axis_sizes: Mapping[str, int]) -> int:
    """Into how many shards rule table `table` splits a logical axis on a mesh of these axis sizes (ICI x DCN):
    what the trainer's placement gives, for the checks and the planner to read rather than restate."""
    return math.prod(axis_sizes[a] for a in mesh_axes(table.get(logical)))


def batch_ways(axis_sizes: Mapping[str, int]) -> int:
    """The batch's shards: every preset's activation rules split it alike (data x fsdp x expert today)."""
    return split_ways("batch", _ACTIVATIONS, axis_sizes)


def seq_ways(axis_sizes: Mapping[str, int]) -> int:
    """Each sequence's shards (context parallelism): every preset's activation rules split it alike."""
    return split_ways("seq", _ACTIVATIONS, axis_sizes)


def spec(logical: tuple[str | None, ...], table: RuleTable, mesh: Mesh) -> P:
    """Logical names -> PartitionSpec; mesh axes of size 1 are dropped so specs stay readable, and so are the
    axes traced code sees as manual (inside shard_map: each device holds its own shard along them)."""
    out = []
    for name in logical:
        axes = tuple(a for a in mesh_axes(table.get(name)) if mesh.shape[a] > 1 and a not in mesh.manual_axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def check_divisible(what: str, shape: tuple[int, ...], logical: tuple[str | None, ...], table: RuleTable,
                    mesh: Mesh) -> None:
    for dim, name in zip(shape, logical):
        axes = [a for a in mesh_axes(table.get(name)) if mesh.shape[a] > 1]
        ways = math.prod(mesh.shape[a] for a in axes)
        if dim % ways:
            degrees = " x ".join(f"mesh.{a}={mesh.shape[a]}" for a in axes)
            key = SIZE_KEY.get(name, f"the '{name}' dim of {what}")
            raise ConfigError(f"{key}={dim} is not divisible by {degrees} which shards it "
                              f"(logical axis '{name}' of {what}); choose sizes or degrees that divide")


def is_logical(x: Any) -> bool:
    """A tuple of logical names (a scalar's is empty); NamedTuples are optimizer-state nodes, not names."""
    return type(x) is tuple and all(isinstance(n, (str, type(None))) for n in x)


def tree_shardings(abstract: Any, logical: Any, table: RuleTable, mesh: Mesh, memory_kind: str | None = None) -> Any:
    """NamedShardings for a tree of arrays given the same tree of logical-name tuples; checks divisibility.
    `memory_kind` "pinned_host" keeps the arrays in host memory (offload.py)."""

    def one(path, names, x):
        check_divisible(jax.tree_util.keystr(path), x.shape, names, table, mesh)
        return NamedSharding(mesh, spec(names, table, mesh), memory_kind=memory_kind)

    return jax.tree_util.tree_map_with_path(one, logical, abstract, is_leaf=is_logical)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# Constraints inside the step: the step function enters this context while it is traced, so model code can
# say constrain(x, ("batch", "seq", "embed")) without knowing the mesh.
_ACTIVE: list[tuple[Mesh, Rules]] = []


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: Rules) -> Iterator[None]:
    _ACTIVE.append((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.pop()


def constrain(x: jax.Array, logical: tuple[str | None, ...], kind: str = "activations") -> jax.Array:
    """An activation (or, with kind="grads", a gradient), placed per the active rules (unchanged outside a
    step)."""
    if not _ACTIVE:
        return x
    mesh, rules = _traced_mesh(), _ACTIVE[-1][1]
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(logical, getattr(rules, kind), mesh)))


def _traced_mesh() -> Mesh | AbstractMesh:
    """The active mesh as the code being traced sees it: inside shard_map over some of its axes (a 1F1B pipeline
    stage, pipeline_1f1b.py) with those axes manual - shardings there must be on that view."""
    within = jax.sharding.get_abstract_mesh()
    return within if not within.empty and within.manual_axes else _ACTIVE[-1][0]


def local(fn, in_logical: tuple[tuple[str | None, ...], ...], out_logical):
    """`fn` run per device on its shards (jax.shard_map) with the active activation rules, for code the SPMD
    partitioner cannot split (Pallas kernels, a mixture of experts' routing); XLA gathers the inputs into these
    layouts first. `out_logical` names the output's axes, or is a tuple of such names for several outputs. `fn`
    itself outside a step. An `in_logical` entry that is not a tuple of names is a shard_map spec already (a
    pytree prefix of its argument's specs: `placement`)."""
    if not _ACTIVE:
        return fn
    mesh, rules = _traced_mesh(), _ACTIVE[-1][1]
    out_specs = jax.tree.map(lambda n: spec(n, rules.activations, mesh), out_logical, is_leaf=is_logical)
    in_specs = tuple(spec(n, rules.activations, mesh) if is_logical(n) else n for n in in_logical)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def placement(logical: tuple[str | None, ...]) -> NamedSharding:
    """Where the active activation rules put an array with these logical axes, on the mesh being traced: for a
    library object that says its own shard_map specs (splash's kernel) and is passed to `local` with them."""
    mesh = _traced_mesh()
    return NamedSharding(mesh, spec(logical, _ACTIVE[-1][1].activations, mesh))


def active_axes(logical: str) -> tuple[str, ...]:
    """The mesh axes (of size > 1) the active activation rules split a logical axis over; none outside a step."""
    if not _ACTIVE:
        return ()
    mesh, rules = _ACTIVE[-1]
    return tuple(a for a in mesh_axes(rules.activations.get(logical)) if mesh.shape[a] > 1)


def replica_axes() -> tuple[str, ...]:
    """The batch's mesh axes that the active parameter rules split nothing over: axes whose devices hold the
    same weights, so that gradients can be summed on each device and reduced across them at the end."""
    _, rules = _ACTIVE[-1]
    split = {a for entry in rules.params.values() for a in mesh_axes(entry)}
    return tuple(a for a in active_axes("batch") if a not in split)


def ways(logical: str) -> int:
    """Into how many shards the active activation rules split a logical axis (1 outside a step)."""
    return math.prod(_ACTIVE[-1][0].shape[a] for a in active_axes(logical)) if _ACTIVE else 1


def sequence_order(seq_len: int) -> np.ndarray | None:
    """The sequence position at each slot of a sequence laid out for the active rules (context.order), or None
    where it is in order (no context parallelism, or outside a step)."""
    return context.order(seq_len, ways("seq"), _ACTIVE[-1][1].seq_layout) if _ACTIVE else None


def sequence_layout() -> str:
    """The active rules' layout of a sequence split over the context axes (config.CONTEXT_LAYOUTS)."""
    return _ACTIVE[-1][1].seq_layout if _ACTIVE else "contiguous"


def active_mesh() -> Mesh:
    """The mesh of the step being traced (use_rules')."""
    return _ACTIVE[-1][0]


def active_device() -> jax.Device:
    """A device of the active mesh (a TPU topology's, in an ahead-of-time compile), else the first local one."""
    return _ACTIVE[-1][0].devices.flat[0] if _ACTIVE else jax.devices()[0]


def constrain_param(x: jax.Array, logical: tuple[str | None, ...], dtype=None) -> jax.Array:
    """One layer's weight inside the layer scan: placed per the parameter rules, and its gradient per the
    gradient rules. The scan slices layer i out of the stacked weights; left to itself, sharding propagation
    may all-reduce each layer's gradient whole and slice it afterwards. Pinned here, FSDP's gradients are
    reduce-scattered layer by layer (ZeRO-2's too, its parameters being replicated). With parameters in host
    memory (params.offload) the weight is copied to the device here, and its gradient goes back there.

    `dtype` (the compute dtype) casts the weight after it is placed, and pins its gradient before the cast
    back: XLA then gathers the weight and reduce-scatters its gradient in the compute dtype. Pinned after the
    cast back instead, the gradient's reduction and its slicing are separated by a convert, and XLA all-reduces
    the whole gradient (twice the bytes) before slicing it."""
    if not _ACTIVE:
        return x if dtype is None else x.astype(dtype)
    mesh, rules = _traced_mesh(), _ACTIVE[-1][1]
    if jax.typeof(x).memory_space == jax.memory.Space.Host:  # differentiated as a copy
        x = jax.device_put(x, jax.memory.Space.Device)
    return _place(x, NamedSharding(mesh, spec(logical, rules.params, mesh)),
                  NamedSharding(mesh, spec(logical, rules.grads, mesh)),
                  None if dtype is None else jax.numpy.dtype(dtype), x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _place(x, forward: NamedSharding, backward: NamedSharding, dtype, x_dtype):
    x = jax.lax.with_sharding_constraint(x, forward)
    return x if dtype is None else x.astype(dtype)


def _place_forward(x, forward, backward, dtype, x_dtype):
    return _place(x, forward, backward, dtype, x_dtype), None


def _place_backward(forward, backward, dtype, x_dtype, _, g):
    return (jax.lax.with_sharding_constraint(g, backward).astype(x_dtype),)


_place.defvjp(_place_forward, _place_backward)
