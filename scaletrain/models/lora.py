"""Low-rank adapters (LoRA; `lora.*`, docs/post-training.md): a frozen weight W [in..., out...] gets a trainable
pair A [in..., rank] and B [rank, out...], and its projection of x becomes x W + (alpha / rank) (x A) B.

The adapters are computed as two thin matmuls beside the base one, never merged into W. So the base weight's
gradient is never formed: a LoRA step's backward pass does one matmul per projection where full fine-tuning does
two. And dropout (`lora.dropout`) can act on the adapters' input alone, as PEFT's does. A site that projects
(attention, the MLP, the experts) adds `delta` (or `grouped`, inside the experts' per-device block) to its output.
Every way of computing the base projection is left as it is: FlashNorm's kernels, quantized matmuls, the joined
Q/K/V.

A starts as PEFT's does (kaiming_uniform with a=sqrt(5): uniform in +-1/sqrt(fan_in)), and B at zero. So a fresh
adapter changes nothing, and a DPO run's first loss is log 2. A carries the base weight's input dims' logical axes
and B its output dims' (so A takes W's input-dim sharding and B its output-dim sharding), with the rank replicated:
Qwix's rule. Adapters are the Params of modules named `<weight>_lora` beside their weight (`is_adapter`), so the
base keeps its paths (checkpoints, Hugging Face tables) and the trainer tells the trainable parameters by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from scaletrain.errors import ConfigError
from scaletrain.models.layers import project

SUFFIX = "_lora"
# The projections lora.targets may name, as Hugging Face (and PEFT) name them; a family adapts those it has.
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")  # a mixture of experts' are its experts'
TARGETS = ATTENTION + MLP


def targets(spec: str, known: tuple[str, ...] = TARGETS) -> tuple[str, ...]:
    """The projections a lora.targets value names ("all": every one of `known`, the model family's; or a
    comma-separated list of them); ConfigError for a name that is none of them, or for a list that names none."""
    if spec.strip() == "all":
        return known
    names = tuple(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ConfigError(f"lora.targets names no matmul{' ' + ', '.join(map(repr, unknown)) if unknown else ''}: "
                          f"expected all, or a comma-separated list of {', '.join(known)}; got '{spec}'")
    return names


def is_adapter(path: tuple) -> bool:
    """Whether a parameter (its path in the parameter tree, as keys) belongs to an adapter."""
    return any(str(getattr(k, "key", k)).endswith(SUFFIX) for k in path)


class Adapter(nnx.Module):
    """The adapter of a weight W of shape `shape` with logical axes `logical`: `lead` group dims (a mixture's
    experts) that A and B keep as W does, then `in_dims` input dims, then the output dims."""

    def __init__(self, shape: tuple[int, ...], logical: tuple[str | None, ...], rank: int, alpha: float,
                 rngs: nnx.Rngs, dtype, in_dims: int = 1, lead: int = 0, site: int = 0):
        split = lead + in_dims
        bound = 1 / math.sqrt(math.prod(shape[lead:split]))
        a = jax.random.uniform(rngs.params(), (*shape[:split], rank), dtype, -bound, bound)
        self.a = nnx.Param(a, out_sharding=(*logical[:split], None))
        self.b = nnx.Param(jnp.zeros((*shape[:lead], rank, *shape[split:]), dtype),
                           out_sharding=(*logical[:lead], None, *logical[split:]))
        # site: which projection (its index in TARGETS), so that its dropout masks differ from the others'
        self.scale, self.in_dims, self.site = alpha / rank, in_dims, site


def adapter(cfg, name: str, shape: tuple[int, ...], logical: tuple[str | None, ...], rngs: nnx.Rngs,
            in_dims: int = 1, lead: int = 0) -> Adapter | None:
    """Projection `name`'s adapter where the model config's lora targets it, else None."""
    if not cfg.lora_rank or name not in cfg.lora_targets:
        return None
    return Adapter(shape, logical, cfg.lora_rank, cfg.lora_alpha, rngs, cfg.param_dtype, in_dims, lead,
                   TARGETS.index(name))


# lora.dropout: the adapters' input is dropped (PEFT's dropout(x) before A) in training steps, each element kept with
# probability 1 - rate and scaled by 1 / (1 - rate). The mask is a hash of the token's seed (`token_seeds`: the
# step's key, the token's row, segment and position), the layer, the projection and the feature: a pure function
# of them, so it is the same on every mesh, in a microbatch or a pipeline stage, and again where remat recomputes.
@dataclasses.dataclass(frozen=True)
class Dropout:
    seeds: jax.Array  # [b, t] uint32, each token's
    layer: jax.Array  # uint32: the layer's index in the stack (within a group of layers: times the group, plus its own)
    rate: float


_ACTIVE: list[Dropout] = []  # the dropout of the layer being traced (`dropping`), innermost last


@contextlib.contextmanager
def dropping(dropout: Dropout | None) -> Iterator[None]:
    """The adapters traced inside drop their input by `dropout` (None: they do not)."""
    if dropout is None:
        yield
        return
    _ACTIVE.append(dropout)
    try:
        yield
    finally:
        _ACTIVE.pop()


def within(group: int, index) -> contextlib.AbstractContextManager:
    """Inside a layer that holds a group of `group` layers (models.mixtral's MoEGroup), layer `index` of it: its
    own masks."""
    if not _ACTIVE:
        return contextlib.nullcontext()
    outer = _ACTIVE[-1]
    return dropping(dataclasses.replace(outer, layer=outer.layer * group + jnp.asarray(index, jnp.uint32)))


def _mix(x: jax.Array) -> jax.Array:
    """A bijective mix of uint32 values (lowbias32: every output bit depends on every input bit)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def token_seeds(key: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
    """Each token's dropout seed [b, t] uint32 for a step's batch: its row, segment and position under the step's
    `key` (uint32) - not its slot, which the context axis's layout moves."""
    rows = jax.lax.broadcasted_iota(jnp.uint32, segment_ids.shape, 0)
    token = _mix(rows * jnp.uint32(0x9E3779B1) ^ _mix(segment_ids.astype(jnp.uint32) * jnp.uint32(0x85EBCA77)
                                                       ^ positions.astype(jnp.uint32)))
    return _mix(token ^ key.astype(jnp.uint32))


def _dropped(x: jax.Array, site: int) -> jax.Array:
    """x [b, t, in...] with the active dropout applied (x itself outside a training step's layer)."""
    if not _ACTIVE:
        return x
    d = _ACTIVE[-1]
    features = jnp.arange(math.prod(x.shape[2:]), dtype=jnp.uint32).reshape(x.shape[2:])
    salt = _mix(d.layer.astype(jnp.uint32) * jnp.uint32(len(TARGETS)) + jnp.uint32(site))
    bits = _mix(d.seeds.reshape(*d.seeds.shape, *(1,) * (x.ndim - 2)) ^ _mix(features ^ salt))
    keep = bits >= jnp.uint32(min(int(d.rate * 2**32), 2**32 - 1))
    return jnp.where(keep, x / (1 - d.rate), 0).astype(x.dtype)


def delta(adapter: Adapter | None, x: jax.Array, like: jax.Array) -> jax.Array:
    """`like` (the base projection of x) plus the adapter's (alpha / rank) (dropout(x) A) B, in like's dtype; `like`
    itself without an adapter."""
    if adapter is None:
        return like
    x = _dropped(x, adapter.site)
    low = project(x, adapter.a[...], adapter.in_dims)
    return (like + project(low, adapter.b[...]) * jnp.asarray(adapter.scale, low.dtype)).astype(like.dtype)


class Grouped(NamedTuple):
    """An expert weight [experts, in, out] with its adapter's A [experts, in, rank] and B [experts, rank, out],
    as a mixture's per-device block takes them (models/mixtral/moe.py's `_swiglu`)."""

    w: jax.Array
    a: jax.Array
    b: jax.Array
    scale: float

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape


def grouped(matmul, plain, x: jax.Array, w) -> jax.Array:
    """matmul(x, w) for an expert weight `w`, plus (alpha / rank) plain(plain(x, A), B) where `w` is Grouped:
    `plain` is the grouped matmul in the compute dtype (the adapters are never quantized)."""
    if not isinstance(w, Grouped):
        return matmul(x, w)
    return matmul(x, w.w) + plain(plain(x, w.a), w.b) * jnp.asarray(w.scale, x.dtype)


def merged(params: dict, scale: float, dtype=None) -> dict:
    """Parameters (a nested dict, as checkpoints and the trainer keep them) with every adapter folded into its
    weight, W + scale A B computed in float32 and cast to `dtype` (default: W's), and the adapters left out: a
    model without adapters that computes the same (up to rounding). `convert to-hf` writes it; a run started from
    a LoRA run's checkpoint (checkpoint.init_from) takes it as its base."""
    out = {}
    for name, value in params.items():
        if name.endswith(SUFFIX):
            continue
        adapter = params.get(name + SUFFIX)
        if isinstance(value, dict):
            out[name] = merged(value, scale, dtype)
        elif adapter is None:
            out[name] = value
        else:
            out[name] = _fold(value, adapter["a"], adapter["b"], scale, dtype or value.dtype)
    return out


def _fold(w, a, b, scale: float, dtype):
    """w + scale (A B) for A [stack..., in..., rank], B [stack..., rank, out...] and w [stack..., in..., out...]
    (stack: the layers, a mixture's experts)."""
    stack = a.ndim + b.ndim - 2 - w.ndim
    lead, rank = w.shape[:stack], a.shape[-1]
    ab = jnp.matmul(jnp.asarray(a, jnp.float32).reshape(*lead, -1, rank),
                    jnp.asarray(b, jnp.float32).reshape(*lead, rank, -1))
    return (jnp.asarray(w, jnp.float32) + scale * ab.reshape(w.shape)).astype(dtype)


# lora.base_dtype int8 (QLoRA's idea, with this project's own rounding): each frozen projection weight of the layer
# stack is stored as int8 with one float32 scale per output column - absmax over its input dims / 127, the rounding
# model.quantization=int8 gives a weight - in a Param named `<weight>_scale` beside it, and dequantized per layer as
# the layer runs (transformer._placed), so the stack's base takes a byte a weight. The embedding, the output
# projection, the router and the norms stay in bfloat16.
SCALE = "_scale"


def base_scale(cfg, module, name: str, shape: tuple[int, ...], logical: tuple[str | None, ...], in_dims: int = 1,
               lead: int = 0) -> None:
    """With an int8 base (model config lora_int8_base): `module.<name>_scale`, weight `name`'s per-column scales
    [lead..., 1 per input dim, out...] (ones until the base is quantized: `quantized`)."""
    if not cfg.lora_int8_base:
        return
    split = lead + in_dims
    scale = nnx.Param(jnp.ones((*shape[:lead], *(1,) * in_dims, *shape[split:]), jnp.float32),
                      out_sharding=(*logical[:lead], *(None,) * in_dims, *logical[split:]))
    setattr(module, name + SCALE, scale)


def quantized(params: dict) -> dict:
    """Parameters (a nested dict of arrays, or of ShapeDtypeStructs) with every weight that has a `_scale` beside it
    rounded to int8 and the scale filled in: absmax over the dims the scale keeps at 1, over 127."""
    out = {}
    for name, value in params.items():
        if isinstance(value, dict):
            out[name] = quantized(value)
        elif name + SCALE in params:
            like = params[name + SCALE]
            if isinstance(value, jax.ShapeDtypeStruct):
                out[name] = jax.ShapeDtypeStruct(value.shape, jnp.int8, sharding=value.sharding)
                out[name + SCALE] = jax.ShapeDtypeStruct(like.shape, jnp.float32, sharding=like.sharding)
                continue
            axes = tuple(i for i, (w, k) in enumerate(zip(value.shape, like.shape)) if k == 1 and w != 1)
            w = jnp.asarray(value, jnp.float32)
            peak = jnp.max(jnp.abs(w), axis=axes, keepdims=True)
            scale = jnp.where(peak > 0, peak / 127.0, 1.0)
            out[name], out[name + SCALE] = jnp.round(w / scale).astype(jnp.int8), scale
        elif not name.endswith(SCALE) or name.removesuffix(SCALE) not in params:
            out[name] = value
    return out


def as_read(shapes: dict) -> dict:
    """An int8 base's shapes as a checkpoint without one holds them (checkpoint.init_from's, a converted model's):
    the scales left out, the int8 weights float32. `quantized` of what is read, with scales beside the weights again
    (`scales`), is the base."""
    return {name: as_read(value) if isinstance(value, dict) else
            jax.ShapeDtypeStruct(value.shape, jnp.float32, sharding=value.sharding) if name + SCALE in shapes else value
            for name, value in shapes.items() if not (name.endswith(SCALE) and name.removesuffix(SCALE) in shapes)}


def scales(shapes: dict) -> dict:
    """The scales of an int8 base's shapes, alone (ones: placeholders `quantized` fills in)."""
    out = {}
    for name, value in shapes.items():
        if isinstance(value, dict):
            if inner := scales(value):
                out[name] = inner
        elif name.endswith(SCALE) and name.removesuffix(SCALE) in shapes:
            out[name] = jnp.ones(value.shape, value.dtype)
    return out


def dequantized(params: dict, dtype) -> dict:
    """Parameters with every int8 weight that has a `_scale` beside it as weight x scale in `dtype` (computed in
    float32); the scales stay."""
    out = {}
    for name, value in params.items():
        if isinstance(value, dict):
            out[name] = dequantized(value, dtype)
        elif name + SCALE in params and value.dtype == jnp.int8:
            out[name] = (value.astype(jnp.float32) * params[name + SCALE].astype(jnp.float32)).astype(dtype)
        else:
            out[name] = value
    return out
