"""What a run reads from outside its own checkpoints: the parameters checkpoint.init_from starts it from, the frozen
base a LoRA run keeps there (and reads back on every resume), DPO's reference copy - and a run directory's
parameters as the tools read them (`restore_run_params`). A LoRA run's adapters are folded into the weights a run
starts from (lora.merged), and an int8 base is rounded from the weights read, as `init` rounds it (lora.quantized).
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from scaletrain.models import lora
from scaletrain.parallel import sharding
from scaletrain.store.checkpoint import joined, params_source, restore_params

if TYPE_CHECKING:
    from scaletrain.train.trainer import Setup


def wanted(cfg, setup: Setup) -> Any:
    """What the run takes from checkpoint.init_from, as shapes: every parameter, or with LoRA the frozen base
    (the adapters start afresh)."""
    frozen = setup.parts.split(setup.abstract_state.params)[1]
    return frozen if frozen else setup.abstract_state.params


def _source_adapters(source: str, setup: Setup) -> tuple[Any, float]:
    """The adapters a run directory's checkpoint holds (checkpoint.init_from's), as shapes (replicated: they are
    small), and their scale: (None, 0) where it has none (not a LoRA run)."""
    _, _, _, meta, saved = params_source(source, {})
    names = [name for name in saved if lora.SUFFIX in name]
    if not names:
        return None, 0.0
    tree: dict = {}
    for name in names:
        *parents, leaf = re.findall(r"\['([^']*)'\]", name)
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = jax.ShapeDtypeStruct(tuple(saved[name]["shape"]), saved[name]["dtype"],
                                          sharding=sharding.replicated(setup.mesh))
    section = meta["config"]["lora"]
    return tree, section["alpha"] / section["rank"]


def params(cfg, setup: Setup, shapes: Any = None) -> tuple[int, Any]:
    """(step, parameters) the run starts from, read from checkpoint.init_from in checkpoint order: every
    parameter, or with LoRA the frozen base (or those of `shapes`)."""
    return read_base(cfg.checkpoint.init_from, setup, wanted(cfg, setup) if shapes is None else shapes)


def read_base(source: str, setup: Setup, wanted: Any, what: str = "checkpoint.init_from") -> tuple[int, Any]:
    """(step, parameters of `wanted`, shapes) from the run directory `source`, as a run started from it takes
    them: a LoRA run's adapters folded into their weights (lora.merged) where `source` is one, and an int8 base
    (lora.base_dtype int8) rounded from what is read (lora.quantized), as `init` rounds it."""
    int8 = setup.model_cfg.lora_int8_base and lora.scales(wanted)
    read = lora.as_read(wanted) if int8 else wanted
    adapters, scale = _source_adapters(source, setup)
    if adapters is None:
        step, params = restore_params(source, read, what)
    else:
        step, params = restore_params(source, joined(read, adapters), what)
        params = lora.merged(params, scale)
    if int8:
        params = setup.parts.store(joined(params, lora.scales(wanted)), jnp.dtype(jnp.int8))
    return step, params


def restore_run_params(run_dir: str, setup: Setup, what: str, step: int | None = None) -> tuple[int, Any]:
    """(step, parameters) of a run directory's checkpoint for `setup` (the run's own config's): restore_params, but
    an int8 base its checkpoints leave out (metadata `base`) is read from where they keep it and rounded as the run
    rounded it (read_base) - `logits`, `generate` and `convert to-hf` read a run's parameters so."""
    abstract = setup.abstract_state.params
    if not setup.model_cfg.lora_int8_base:
        return restore_params(run_dir, abstract, what, step)
    _, _, step, meta, _ = params_source(run_dir, {}, what, step)
    if not meta.get("base"):  # the base saved with the adapters, int8 and scales
        return restore_params(run_dir, abstract, what, step)
    adapters, frozen = setup.parts.split(abstract)
    step, adapters = restore_params(run_dir, adapters, what, step)
    return step, setup.parts.join(adapters, read_base(meta["base"], setup, frozen, what)[1])


def reference(cfg, setup: Setup) -> Any:
    """DPO's frozen reference copy (dpo.reference copy): checkpoint.init_from's parameters, in checkpoint order and
    the copy's dtypes; None for a run without one."""
    if setup.abstract_state.reference is None:
        return None
    return params(cfg, setup, setup.abstract_state.reference)[1]


def kept_base(cfg, setup: Setup) -> Setup:
    """The setup, with checkpoints leaving the frozen base out where it is checkpoint.init_from's parameters as
    they are (not where a LoRA run's adapters were folded into them: that base is this run's own)."""
    if setup.parts.everything or not cfg.checkpoint.init_from or (
            _source_adapters(cfg.checkpoint.init_from, setup)[0] is not None):
        return setup
    return dataclasses.replace(setup, base_from=cfg.checkpoint.init_from)


