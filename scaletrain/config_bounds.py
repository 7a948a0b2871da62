"""The config's upper bounds (config.validate): every size and count fits the device's int32 and float32, and no
array of a training step holds more elements than XLA can count bytes of - so that nothing computed from a config
overflows into a traceback."""

from __future__ import annotations

import math

import ml_collections

from scaletrain.errors import ConfigError

# Token ids, positions and the step counter are int32 on the device, and JAX refuses a Python int beyond int32 in
# int32 arithmetic: no integer key (the seed aside: a uint32) may exceed int32. The model's and optimizer's float keys
# become float32 there: beyond its largest, inf.
_INT32_MAX = 2**31 - 1
_FLOAT32_MAX = 3.4028234663852886e38
# No array of a step may hold more than 2**52 elements: 16 PiB as float32, 20 times the HBM of a whole v5p pod,
# so no model that could be trained is refused. XLA counts bytes in int64; below this bound an array's bytes, and
# their sums over a step's arrays (parameters, gradients, two Adam moments, activations), stay below 2**63.
_MAX_ELEMENTS = 2**52
# A step's tokens are the rows of a [batch x seq] matrix, which the fused norm's kernel indexes in int32 (all of
# them on one device). 2**31 tokens is over 100 times the largest batches trained (Llama 3: 16M).
_MAX_TOKENS = _INT32_MAX


def check(cfg: ml_collections.ConfigDict, flat: dict) -> None:
    """ConfigError where a value (`flat`: every key's), or an array of the step it sizes, is beyond what the device
    can hold."""
    for key, value in flat.items():
        if type(value) is int and key != "seed" and value > _INT32_MAX:
            raise ConfigError(f"{key} must be <= 2**31 - 1 = {_INT32_MAX} (the largest int32: sizes and counts "
                              f"are int32 on the device), got {value}")
        if type(value) is float and key.startswith(("model.", "optim.")) and value > _FLOAT32_MAX:
            raise ConfigError(f"{key} must be <= {_FLOAT32_MAX:.4g} (the largest float32: it is float32 on the "
                              f"device), got {value:g}")
    tokens = cfg.train.global_batch * cfg.data.seq_len
    if tokens > _MAX_TOKENS:
        raise ConfigError(f"train.global_batch x data.seq_len = {cfg.train.global_batch} x {cfg.data.seq_len} = "
                          f"{tokens} tokens a step, over 2**31 - 1 (the largest int32: a step's tokens are indexed "
                          f"in int32)")
    for what, keys in _largest_arrays(cfg).items():
        elements = math.prod(flat[key] for key in keys)
        if elements > _MAX_ELEMENTS:
            raise ConfigError(f"{' x '.join(keys)} = {' x '.join(str(flat[key]) for key in keys)} = "
                              f"{elements:.3g} elements in {what}, over the 2**52 any array may hold (16 PiB as "
                              f"float32)")


def _largest_arrays(cfg: ml_collections.ConfigDict) -> dict[str, tuple[str, ...]]:
    """The largest arrays of a training step (global shapes, every microbatch at once: an upper bound), each as
    the keys whose product is its number of elements."""
    batch = ("train.global_batch", "data.seq_len")
    queries = "model.attention_block" if cfg.model.attention_block else "data.seq_len"
    logits = "model.logits_block" if cfg.model.logits_block else "data.seq_len"
    scores = {} if cfg.model.attention == "flash" else {
        "a layer's attention scores": ("train.global_batch", "model.num_heads", queries, "data.seq_len")}
    return {
        **scores,
        "the embedding table": ("model.vocab_size", "model.d_model"),
        "the attention weights": ("model.num_layers", "model.d_model", "model.num_heads", "model.head_dim"),
        "the MLP weights": ("model.num_layers", "model.d_model", "model.d_ff"),
        **({"the experts' weights": ("model.num_layers", "model.num_experts", "model.d_model", "model.moe_d_ff")}
           if cfg.model.num_experts and cfg.model.moe_d_ff else {}),
        "the residual stream of every layer": ("model.num_layers", *batch, "model.d_model"),
        "the MLP activations of every layer": ("model.num_layers", *batch, "model.d_ff"),
        "the logits": ("train.global_batch", logits, "model.vocab_size"),
    }
