"""Which parameters a run trains: all of them, or - with LoRA (`lora.rank` > 0, models/lora.py) - the adapters
alone, the rest a frozen base.

The training state keeps one parameter tree, base and adapters together, so every reader of the model (the step,
the runners, evaluation, inference, Hugging Face export) sees the model whole. The step differentiates the
trainable part alone: the base gets no gradient, no optimizer state and no update. The base is kept in
`lora.base_dtype` (the adapters in model.param_dtype), and a checkpoint leaves it out where the run starts from
checkpoint.init_from, which holds it already.

A `Partition` splits a parameter tree (or any tree shaped like it: shapes, logical axes, shardings) into its
trainable and frozen parts, as nested dicts holding only their own leaves, and joins them back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from scaletrain.models import lora


def _flat(tree: Any) -> dict:
    return traverse_util.flatten_dict(tree) if tree else {}


@dataclasses.dataclass(frozen=True)
class Partition:
    """The parameters' split by path: `frozen` holds the paths (key tuples) of the frozen leaves; none when the
    whole model trains."""

    frozen: frozenset = frozenset()

    @classmethod
    def of(cls, params: Any, adapters_only: bool) -> Partition:
        """With `adapters_only`, every parameter but the adapters' frozen; else none."""
        if not adapters_only:
            return cls()
        return cls(frozenset(path for path in _flat(params) if not lora.is_adapter(path)))

    @property
    def everything(self) -> bool:
        """Whether every parameter trains (full fine-tuning, pretraining)."""
        return not self.frozen

    def split(self, tree: Any) -> tuple[Any, Any]:
        """(trainable part, frozen part) of a tree shaped like the parameters; ({} for the frozen part when
        everything trains)."""
        if self.everything:
            return tree, {}
        flat = _flat(tree)
        trainable = {p: x for p, x in flat.items() if p not in self.frozen}
        frozen = {p: x for p, x in flat.items() if p in self.frozen}
        return traverse_util.unflatten_dict(trainable), traverse_util.unflatten_dict(frozen)

    def trainable(self, tree: Any) -> Any:
        return self.split(tree)[0]

    def join(self, trainable: Any, frozen: Any) -> Any:
        """The whole tree from its two parts."""
        if self.everything:
            return trainable
        return traverse_util.unflatten_dict(_flat(trainable) | _flat(frozen))

    def store(self, params: Any, base_dtype: Any) -> Any:
        """The parameters (arrays or ShapeDtypeStructs, all of them or the frozen ones) with every frozen floating
        leaf in `base_dtype`: how the state keeps them. int8: the layer stack's projections rounded to int8 beside
        their float32 scales (lora.quantized), every other frozen leaf in bfloat16."""
        int8 = base_dtype == jnp.int8
        floats = jnp.dtype(jnp.bfloat16) if int8 else base_dtype

        def cast(path, x):
            name = str(getattr(path[-1], "key", ""))
            if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == floats or (int8 and name.endswith(lora.SCALE)):
                return x
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(x.shape, floats, sharding=x.sharding)
            return x.astype(floats)

        trainable, frozen = self.split(lora.quantized(params) if int8 else params)
        return self.join(trainable, jax.tree_util.tree_map_with_path(cast, frozen))
