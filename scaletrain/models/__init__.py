"""Model families in Flax NNX (docs/design.md, "Adding a model family"). Parameters and activations carry
logical axis names only. The shared building blocks live here (transformer.py's ModelConfig and decoder skeleton,
layers, attention, mlp, rope); each family in its folder (models/<name>/: its decoder, Hugging Face tables and
matmul inventory, behind models/family.py's interface), registered below by one line."""

from __future__ import annotations

import functools
import importlib

import jax
from flax import nnx

from scaletrain.errors import ConfigError
from scaletrain.models.family import Architecture, Family, Matmul
from scaletrain.models.transformer import Decoder, ModelConfig

FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Adds a family under its name (model.family names it); returns it."""
    FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    FAMILIES.pop(name, None)
    _split.cache_clear()


def family_name(m) -> str:
    """The family a model config (the `model` section or a ModelConfig) names: model.family, where auto is
    mixtral for a mixture of experts (model.num_experts > 0), else llama."""
    name = getattr(m, "family", "auto")
    return name if name != "auto" else ("mixtral" if m.num_experts else "llama")


def family_of(m) -> Family:
    """The config's family. Raises ConfigError for a model.family that is not registered, or whose models route
    tokens to experts where model.num_experts says otherwise (checked here, where the registry is: the config
    sits below the models and cannot list them)."""
    name = family_name(m)
    family = FAMILIES.get(name)
    if family is None:
        raise ConfigError(f"model.family must be auto or one of {', '.join(FAMILIES)}; got '{name}'")
    if family.experts != bool(m.num_experts):
        raise ConfigError(f"model.family={name} {'needs' if family.experts else 'has no'} mixture of experts: "
                          f"model.num_experts={m.num_experts} (auto picks the family from it)")
    return family


def architectures() -> dict[str, tuple[Family, Architecture]]:
    """Every registered family's Hugging Face architectures, by name."""
    return {name: (f, a) for f in FAMILIES.values() for name, a in f.architectures.items()}


@functools.cache
def _split(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """The config's family's decoder, built abstractly (nothing allocated). Cached: the planner asks for the same
    model on every slice it tries."""
    return nnx.split(nnx.eval_shape(lambda: family_of(cfg).decoder(cfg, nnx.Rngs(0))))


def _variables(cfg: ModelConfig, what) -> dict:
    """`what(variable)` of every parameter, as a plain nested dict."""
    return nnx.to_pure_dict(jax.tree.map(what, _split(cfg)[1], is_leaf=lambda x: isinstance(x, nnx.Variable)))


@functools.cache
def abstract(cfg: ModelConfig) -> tuple[nnx.GraphDef, dict, dict]:
    """(graphdef, parameter shapes, logical axes) of the config's family's decoder, as plain nested dicts, without
    allocating anything. Cached; the dicts are shared, never to be changed."""
    graphdef, state = _split(cfg)
    return graphdef, nnx.to_pure_dict(state), _variables(cfg, lambda v: tuple(v.out_sharding))


_OPERANDS = {"int8": jax.numpy.int8, "fp8": jax.numpy.float8_e4m3fn}


def operand_dtypes(cfg: ModelConfig, quantized: bool = True) -> dict:
    """The dtype each parameter enters its matmuls in, as FSDP gathers it (layers.param's `operand`): a weight
    matrix in its matmuls' low-precision dtype where `quantized` and they are (the rounding runs on each device's
    shard, so XLA gathers the int8 or fp8 weight: docs/quantization.md), else in the compute dtype (cast before
    the gather, parallel/sharding.py's constrain_param); a norm's gain in the parameter dtype. With `quantized`
    false: the dtype of its gradient inside the step (a quantized matmul writes its weight gradient in the compute
    dtype), reduced across the batch per microbatch."""
    def dtype(v):
        operand = getattr(v, "operand", None)
        if operand is None:
            return jax.numpy.dtype(cfg.param_dtype)
        return jax.numpy.dtype(_OPERANDS[operand] if quantized and operand in _OPERANDS else cfg.dtype)

    return _variables(cfg, dtype)


def quantized(cfg: ModelConfig) -> dict:
    """Whether each parameter enters its matmuls rounded to int8 or fp8 (layers.param's `operand`)."""
    return _variables(cfg, lambda v: getattr(v, "operand", None) in _OPERANDS)


def added(cfg: ModelConfig) -> dict:
    """Whether each parameter is a vector added to activations (layers.added: a bias, an attention sink)."""
    return _variables(cfg, lambda v: getattr(v, "added", False))


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    return nnx.to_pure_dict(nnx.state(family_of(cfg).decoder(cfg, nnx.Rngs(key))))


# The families, one line each (imported after the shared modules above, which a family imports).
register(importlib.import_module("scaletrain.models.llama").FAMILY)
register(importlib.import_module("scaletrain.models.mixtral").FAMILY)
register(importlib.import_module("scaletrain.models.gpt_oss").FAMILY)
register(importlib.import_module("scaletrain.models.deepseek").FAMILY)
register(importlib.import_module("scaletrain.models.gemma").FAMILY)

Llama = FAMILIES["llama"].decoder

__all__ = [
    "FAMILIES",
    "Architecture",
    "Decoder",
    "Family",
    "Llama",
    "Matmul",
    "ModelConfig",
    "abstract",
    "added",
    "architectures",
    "family_name",
    "family_of",
    "init_params",
    "operand_dtypes",
    "quantized",
    "register",
    "unregister",
]
