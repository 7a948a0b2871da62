"""The training state as the trainer lays it out, for a mesh of given axis sizes: the model's and the optimizer's
abstract arrays, their logical axes, the rule tables that place each kind of array, where each lives (device
or pinned host memory), and the stack runner that runs the model on that mesh (runner.choose).

One derivation for both of its readers: `trainer.build` turns it into shardings on the devices it trains on, and
the planner counts the bytes each device of a planned slice would hold by applying the same tables on an
abstract mesh of that slice's shape - so a new parallelism is taught here once.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import optax
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh

from scaletrain import models as model_lib
from scaletrain.config import MESH_AXES
from scaletrain.errors import ConfigError
from scaletrain.models import lora
from scaletrain.parallel import sharding
from scaletrain.parallel.checks import shards_kv_heads
from scaletrain.train import optim, runner
from scaletrain.train.trainable import Partition

HOST = "pinned_host"


@dataclasses.dataclass(frozen=True)
class StateLayout:
    model_cfg: model_lib.ModelConfig
    runner: runner.Runner
    graphdef: nnx.GraphDef
    rules: sharding.Rules
    tx: optax.GradientTransformation
    lr: optax.Schedule
    params: Any  # ShapeDtypeStructs, the frozen ones (LoRA's base) in lora.base_dtype
    logical: Any  # the same tree of logical axis names
    opt_state: Any  # the trainable parameters'
    opt_logical: Any
    params_home: str | None  # memory kind: None (the device) or HOST
    opt_home: str | None
    parts: Partition = Partition()  # the trainable parameters and the frozen (train/trainable.py)

    def shardings(self, mesh: Mesh | AbstractMesh) -> tuple[Any, Any, Any]:
        """(parameters', optimizer state's, gradients') NamedShardings on `mesh` (the gradients' of the trainable
        parameters alone). Raises ConfigError for a dim its mesh axes do not divide."""
        trainable, logical = self.parts.trainable(self.params), self.parts.trainable(self.logical)
        return (sharding.tree_shardings(self.params, self.logical, self.rules.params, mesh, self.params_home),
                sharding.tree_shardings(self.opt_state, self.opt_logical, self.rules.opt_state, mesh, self.opt_home),
                sharding.tree_shardings(trainable, logical, self.rules.grads, mesh))


def of(cfg, axis_sizes: Mapping[str, int], unroll_loops: bool = False) -> StateLayout:
    """The state of config `cfg` on a mesh of these axis sizes. Builds shapes only; nothing is allocated."""
    shard_kv = shards_kv_heads(cfg.model.num_kv_heads, axis_sizes["tensor"])
    rules = sharding.rules_for(cfg.sharding.preset, cfg.sharding.sequence_parallel, shard_kv,
                               cfg.sharding.context_layout)
    model_cfg = model_lib.ModelConfig.from_config(
        cfg.model, fuse_qkv=shard_kv, remat=cfg.remat.policy, remat_custom=tuple(cfg.remat.custom.items()),
        unroll_loops=unroll_loops, **lora_keys(cfg))
    graphdef, params, logical = model_lib.abstract(model_cfg)
    parts = Partition.of(params, bool(cfg.lora.rank))
    params = parts.store(params, jax.numpy.dtype(cfg.lora.base_dtype))
    trainable_logical = parts.trainable(logical)
    tx, lr = optim.make(cfg.optim, cfg.steps, trainable_logical)
    opt_state = jax.eval_shape(tx.init, parts.trainable(params))
    # Optimizer leaves shaped like a parameter (Adam's moments) carry that parameter's logical axes.
    opt_logical = optax.tree_utils.tree_map_params(
        tx, lambda _, names: names, opt_state, trainable_logical,
        transform_non_params=lambda x: (None,) * x.ndim, is_leaf=sharding.is_logical)
    return StateLayout(model_cfg=model_cfg, runner=runner.choose(cfg, axis_sizes), graphdef=graphdef, rules=rules,
                       tx=tx, lr=lr, params=params,
                       logical=logical, opt_state=opt_state, opt_logical=opt_logical,
                       params_home=HOST if cfg.params.offload else None,
                       opt_home=HOST if cfg.optim.offload or cfg.params.offload else None, parts=parts)


def lora_keys(cfg) -> dict:
    """The model config's lora fields from the config's lora section (targets checked against the family's)."""
    if not cfg.lora.rank:
        return {}
    known = model_lib.family_of(cfg.model).adapters
    targets = lora.targets(cfg.lora.targets, known)
    experts = [t for t in targets if t in lora.MLP] if cfg.model.num_experts else []
    if cfg.lora.dropout and experts:
        named = ", ".join(experts)
        raise ConfigError(f"lora.dropout={cfg.lora.dropout} with adapters on a mixture's experts ({named}): their "
                          f"rows are routed, and dropping an expert's input is not supported; set lora.dropout=0 or "
                          f"leave {named} out of lora.targets")
    return {"lora_rank": cfg.lora.rank, "lora_alpha": cfg.lora.alpha, "lora_dropout": cfg.lora.dropout,
            "lora_targets": targets, "lora_int8_base": cfg.lora.base_dtype == "int8"}


def abstract_mesh(axis_sizes: Mapping[str, int]) -> AbstractMesh:
    """A mesh of these axis sizes (ICI x DCN) with no devices behind it: a planned slice's."""
    return AbstractMesh(tuple(axis_sizes[a] for a in MESH_AXES), MESH_AXES,
                        axis_types=(AxisType.Auto,) * len(MESH_AXES))


def device_bytes(abstract: Any, logical: Any, table: sharding.RuleTable, mesh: Mesh | AbstractMesh) -> int:
    """Bytes one device holds of a tree of arrays placed by rule table `table` on `mesh`: what
    NamedSharding.shard_shape gives where the mesh axes divide each dim, rounded up (XLA pads) where they do not,
    for a mesh the trainer refuses but the planner plans all the same."""
    total = 0
    for x, names in zip(jax.tree.leaves(abstract), jax.tree.leaves(logical, is_leaf=sharding.is_logical)):
        ways = [math.prod(mesh.shape[a] for a in sharding.mesh_axes(entry))
                for entry in sharding.spec(names, table, mesh)]
        total += math.prod(-(-dim // w) for dim, w in zip(x.shape, ways)) * x.dtype.itemsize
    return total
