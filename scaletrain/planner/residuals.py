"""The bytes per token that one layer's backward pass reads under remat policy none, from the model's own code:
the layer body the trainer scans, traced with abstract weights (no compile, nothing allocated), and the residuals
JAX saves for its VJP counted (jax's saved_residuals, what `jax.ad_checkpoint.print_saved_residuals` prints).

A hand count of tensors ("about 20 of [tokens, d_model]") misses what the code keeps besides the named
projections: the float32 copies RMSNorm computes in, SiLU's intermediates, RoPE's tables, the attention kernel's
own residuals (its output and log-sum-exp). On Llama-3.1-8B they come to 32 [tokens, d_model] bf16 tensors per
layer, not 20 (docs/tune.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals  # public as print_saved_residuals, which only prints

# The traced sequence, a length no model axis has: residuals with it once are per-token bytes, those with it twice
# (XLA attention's scores) are left to the caller, which knows whether attention blocks bound them. Multiples of
# 128, which the flash kernels take unpadded.
TOKENS = (640, 896, 1152)


def _tokens(cfg) -> int:
    dims = {cfg.d_model, cfg.d_ff, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.vocab_size,
            cfg.moe_d_ff}
    return next(t for t in TOKENS if t not in dims)


def _traced_layer(model_cfg, remat_layers: bool = True):
    """(The family's layer unit as `layer(x, all_params) -> x` under policy none, an abstract x [1, n, d], the
    abstract parameters, n, the layers in the unit)."""
    from scaletrain import models

    cfg = dataclasses.replace(model_cfg, remat="none", unroll_loops=False, attention_block=0)
    graphdef, params, _ = models.abstract(cfg)
    n = _tokens(cfg)
    tokens = jnp.zeros((1, n), jnp.int32)
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    x = jax.ShapeDtypeStruct((1, n, cfg.d_model), cfg.dtype)

    def layer(x_btd, all_params):
        decoder = nnx.merge(graphdef, all_params)
        _, body, stacked, extras = decoder.stack_inputs(tokens, positions, jnp.ones_like(tokens),
                                                        remat_layers=remat_layers)
        return body(x_btd, jax.tree.map(lambda a: a[0], stacked), *extras)[0]

    return layer, x, params, n, models.family_of(cfg).decoder.unit_layers(cfg)


def _split_by_stream(avals, n: int, d_model: int) -> tuple[float, float]:
    """(Bytes per token of the arrays whose last axis is d_model, of the others), of those with the traced
    sequence once (not weights, per-layer constants or attention scores)."""
    stream = inner = 0.0
    for aval in avals:
        if aval.shape.count(n) != 1:
            continue
        size = math.prod(aval.shape) * aval.dtype.itemsize / n
        if aval.shape[-1] == d_model:
            stream += size
        else:
            inner += size
    return stream, inner


@functools.lru_cache(maxsize=32)
def per_token(model_cfg) -> tuple[float, float]:
    """(bytes on the residual stream - arrays whose last axis is d_model -, all other bytes) per token and layer
    of the family's layer unit under policy none, for a `models.ModelConfig`, at tensor parallelism 1."""
    layer, x, params, n, layers = _traced_layer(model_cfg)
    stream, inner = _split_by_stream([aval for aval, _ in saved_residuals(layer, x, params)], n, model_cfg.d_model)
    return stream / layers, inner / layers


@functools.lru_cache(maxsize=32)
def zero_bubble_per_token(model_cfg) -> tuple[dict[str, tuple[float, float]], float]:
    """What a zero-bubble stage keeps of a layer (backward_split's cut of the same traced layer unit, as
    pipeline_zb runs it): per buffer - to_input, to_weight, on_weight - (stream bytes, other bytes) per token
    and layer, as `per_token`; and the bytes of XLA attention's scores it keeps (to the input slot) per token,
    layer and position of the sequence."""
    from scaletrain.parallel import backward_split

    layer, x, params, n, layers = _traced_layer(model_cfg, remat_layers=False)
    cut = backward_split.split(lambda x, p: (layer(x, p), {}), params, x, (), {})
    scores = sum(math.prod(a.shape) * a.dtype.itemsize for a in cut.shapes("to_input") if a.shape.count(n) == 2)
    return ({which: tuple(b / layers for b in _split_by_stream(cut.shapes(which), n, model_cfg.d_model))
             for which in ("to_input", "to_weight", "on_weight")}, scores / n / n / layers)
