"""The decoder skeleton every family builds on: embedding, a scanned stack of identical units (a block, or a
family's group of blocks), final norm, output projection. The llama family's decoder is this skeleton as it is
(models/llama/); others change the unit the stack repeats and what their blocks' auxiliary sums add
(models/mixtral/). The model config (ModelConfig) and `abstract` / `init_params` serve them all."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from scaletrain import config, remat
from scaletrain.models import lora, quantize, rope, window
from scaletrain.models.attention import Attention
from scaletrain.models.layers import Embed, RMSNorm, param, project
from scaletrain.models.mlp import MLP
from scaletrain.parallel import pipeline
from scaletrain.parallel.sharding import constrain, constrain_param


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The `model` config section as the model reads it (its defaults are config.defaults()'s, nowhere else),
    plus what the trainer derives from other sections. How the layer stack is run (a pipeline's stages and
    schedule) is not the model's business: runner.py's."""

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    d_ff: int
    norm_eps: float
    rope_theta: float
    rope_scaling: str
    rope_scaling_factor: float
    rope_low_freq_factor: float
    rope_high_freq_factor: float
    rope_original_max_position: int
    tie_embeddings: bool
    init_std: float
    param_dtype: Any
    dtype: Any
    attention: str  # config.ATTENTIONS: blocked attention in XLA, or a flash kernel
    attention_block: int
    logits_block: int  # sequence positions per block of the output projection + loss; 0: all at once
    norm: str  # how RMSNorm meets the following matmul: config.NORMS
    norm_weights: str  # config.NORM_WEIGHTS
    qk_norm: bool  # per-head RMSNorm of Q and K before RoPE (Qwen3, Gemma 3)
    qk_norm_eps: float
    norm_cancellation: bool  # drop the input norm's 1/rms for Q and K (their norms undo it)
    num_experts: int  # > 0: every moe_every-th layer's feed-forward is a mixture of experts (mixtral/moe.py)
    experts_per_token: int
    moe_d_ff: int  # the experts' hidden width; 0: d_ff
    moe_every: int
    capacity_factor: float  # 0: dropless
    router_aux_loss: float  # the loss's coefficients of the router's load-balancing and z losses
    router_z_loss: float
    family: str = "auto"  # a registered family's name (models/__init__.py); auto: mixtral with experts, else llama
    quantization: str = "none"  # config.QUANTIZATIONS: the chosen matmuls' operand dtype (models/quantize.py)
    quantization_scale: str = "channel"  # config.QUANTIZATION_SCALES
    quantized_matmuls: str = config.DEFAULT_QUANTIZED  # which config.MATMUL_GROUPS, comma-separated
    context_attention: str = "allgather"  # config.CONTEXT_ATTENTIONS: with the sequence split over `context`
    moe_matmul: str = "auto"  # config_moe.MOE_MATMULS: the experts' grouped matmul (kernels/grouped_matmul.py)
    # GPT-OSS's pieces (config_gpt_oss.py): a learned logit per head in every softmax's denominator, biases on
    # Q/K/V/O, the router's logits and the experts' projections, the experts' activation.
    attention_sinks: bool = False
    attention_bias: bool = False
    router_logit_bias: bool = False
    expert_bias: bool = False
    expert_activation: str = "swiglu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # Derived by the trainer from other sections.
    lora_rank: int = 0  # lora.rank: 0, no adapters (models/lora.py)
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ()  # the projections adapted (lora.targets resolved)
    lora_dropout: float = 0.0
    lora_int8_base: bool = False  # lora.base_dtype int8: the stack's frozen projections in int8 (models/lora.py)
    remat: str = "none"  # a remat.POLICIES name
    remat_custom: tuple[tuple[str, str], ...] = ()  # (checkpoint name, remat|device|offload) for "custom"
    fuse_qkv: bool = True  # False where kv heads are replicated over `tensor`
    # Unroll the layer scan and the attention block loop. Only for XLA's cost estimate, which counts a loop's
    # body once (planner/aot.py); never for training (compile time and code size grow with the depth).
    unroll_loops: bool = False
    # Local/global attention layers (models/window.py)
    sliding_window: int = 0  # keys a sliding layer's query sees, itself included; 0: none
    layer_types: str = ""  # sliding|full, comma-separated, cycled over the layers; empty: every layer full
    # YaRN RoPE (rope_scaling yarn): rope.Yarn's settings
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    rope_attention_factor: float = 0.0
    rope_softmax_mscale: bool = False  # YaRN's magnitude mscale(factor, mscale_all_dim)^2 in the softmax scale
    # DeepSeek-V3 (models/deepseek/): latent attention (kv_lora_rank > 0), dense first layers, routing
    q_lora_rank: int = 0  # 0: Q projected directly
    kv_lora_rank: int = 0  # > 0: multi-head latent attention
    rope_head_dim: int = 0  # latent attention: the dims of each q/k head (of head_dim) RoPE rotates, K's shared
    v_head_dim: int = 0  # latent attention: the value heads' size
    rope_interleave: bool = False  # Hugging Face's RoPE pairs interleaved: permuted at import/export only
    first_dense_layers: int = 0  # dense blocks before the stack of mixtures of experts
    router_score: str = "softmax"  # softmax | sigmoid
    router_groups: int = 1  # experts in groups; a token picks from its router_topk_groups best groups
    router_topk_groups: int = 1
    router_scale: float = 1.0  # the routed experts' weights multiplied by this
    router_norm_topk: bool = True  # the k weights renormalised to sum to 1
    router_correction_bias: bool = False  # a per-expert bias added to the scores for selection only
    router_bias_update_rate: float = 0.0  # aux-loss-free balancing: the bias' step per update
    shared_experts: int = 0  # always-on experts, one SwiGLU of shared_experts x the experts' width
    mtp_depth: int = 0  # multi-token prediction modules after the stack (models/mtp.py)
    mtp_loss_weight: float = 0.1  # their losses' mean, times this, joins the objective
    # Gemma's pieces (config_gemma.py)
    rope_local_theta: float = 0.0  # > 0: the sliding layers' own RoPE base, unscaled
    norm_plus_one: bool = False  # norm gains (1 + w), w from zero
    embed_scale: bool = False  # embeddings times sqrt(d_model), rounded to the compute dtype
    query_pre_attn_scalar: int = 0  # queries scaled by its -1/2; 0: head_dim's
    mlp_activation: str = "silu"  # config_gemma.MLP_ACTIVATIONS: the gate's
    attn_logit_softcap: float = 0.0  # > 0: attention scores capped to c tanh(s / c)
    final_logit_softcap: float = 0.0  # > 0: output logits capped so

    @classmethod
    def from_config(cls, model_cfg: Mapping[str, Any] | None = None, **derived) -> "ModelConfig":
        """From the `model` config section (or a mapping of some of its keys: the rest take the schema's
        defaults); `derived` sets the fields that come from elsewhere (the remat section, fuse_qkv from the mesh)
        or overrides section keys."""
        section = config.defaults().model.to_dict() | dict(model_cfg or {})
        values = {f.name: section[f.name] for f in dataclasses.fields(cls)
                  if f.name not in derived and f.name in section} | derived
        values["param_dtype"] = jnp.dtype(values["param_dtype"])
        values["dtype"] = jnp.dtype(values["dtype"])
        return cls(**values)

    @property
    def expert_d_ff(self) -> int:
        return self.moe_d_ff or self.d_ff

    @property
    def moe_layers(self) -> int:
        return self.stack_layers // self.moe_every if self.num_experts else 0

    @property
    def out_std(self) -> float:
        """Output projections start smaller so the residual stream's variance does not grow with depth."""
        return self.init_std / math.sqrt(2 * self.num_layers)

    @property
    def rope_dim(self) -> int:
        """The dims of a head RoPE rotates: all of it, or latent attention's rope_head_dim."""
        return self.rope_head_dim or self.head_dim

    @property
    def stack_layers(self) -> int:
        """The layers of the scanned stack (`layers`): all but the dense first layers, which run before it."""
        return self.num_layers - self.first_dense_layers

    @property
    def yarn(self) -> rope.Yarn:
        return rope.Yarn(self.rope_beta_fast, self.rope_beta_slow, self.rope_truncate, self.rope_mscale,
                         self.rope_mscale_all_dim, self.rope_attention_factor)

    def inverse_frequencies(self):
        return rope.inverse_frequencies(self.rope_dim, self.rope_theta, self.rope_scaling, self.rope_scaling_factor,
                                        self.rope_low_freq_factor, self.rope_high_freq_factor,
                                        self.rope_original_max_position, self.yarn)

    @property
    def rope_scale(self) -> float:
        """What cos and sin are multiplied by: YaRN's attention factor, else 1."""
        return rope.yarn_attention_factor(self.rope_scaling_factor, self.yarn) if self.rope_scaling == "yarn" else 1.0

    @property
    def softmax_scale(self) -> float:
        """What q is multiplied by before q k^T: head_dim**-0.5 (model.query_pre_attn_scalar**-0.5 where set),
        times YaRN's mscale(factor, mscale_all_dim)**2 where it goes there (model.rope_softmax_mscale: DeepSeek's)."""
        scale = (self.query_pre_attn_scalar or self.head_dim) ** -0.5
        if self.rope_scaling == "yarn" and self.rope_softmax_mscale and self.rope_mscale_all_dim:
            scale *= rope.yarn_mscale(self.rope_scaling_factor, self.rope_mscale_all_dim) ** 2
        return scale


class Block(nnx.Module):
    """Attention (`attention`) then a feed-forward (`feed_forward`: the SwiGLU MLP here; a family's own of either
    in a subclass). A call returns the stream and the block's auxiliary sums ({} here; a family's block may return
    its own, which the decoder's `penalty` and `aux_metrics` read)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        weightless = cfg.norm_weights != "standard"
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype, cfg.norm, weightless,
                                 plus_one=cfg.norm_plus_one)
        self.attn = self.attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype, cfg.norm, weightless,
                                plus_one=cfg.norm_plus_one)
        self.mlp = self.feed_forward(cfg, rngs)

    @staticmethod
    def attention(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return Attention(cfg, rngs)

    @staticmethod
    def feed_forward(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return MLP(cfg, rngs)

    def __call__(self, x_btd, sin_bth, cos_bth, segment_ids_bt) -> tuple[jax.Array, dict]:
        x_btd = x_btd + self.attn(x_btd, self.attn_norm, sin_bth, cos_bth, segment_ids_bt)
        return self._feed_forward(x_btd)

    def _feed_forward(self, x_btd, one_matmul: bool = True) -> tuple[jax.Array, dict]:
        return x_btd + self.mlp(x_btd, self.mlp_norm, one_matmul), {}

    def decode(self, x_btd, sin_bth, cos_bth, start, cache):
        """The block for positions [start, start + t) against this layer's KV cache (Attention.decode). Q, K, V
        and gate, up are separate matmuls here: joining their weights into one (for the backward pass) would
        copy them at every token."""
        attn_btd, cache = self.attn.decode(x_btd, self.attn_norm, sin_bth, cos_bth, start, cache)
        return self._feed_forward(x_btd + attn_btd, one_matmul=False)[0], cache


# The logical axes a stack of layers adds to its parameters: the scanned stack, the dense layers of a group
# (model.moe_every > 1), DeepSeek's dense first layers, the multi-token prediction modules (models/mtp.py).
STACKS = ("layers", "sublayers", "dense_layers", "mtp_layers")


class Decoder(nnx.Module):
    """The skeleton. A family's decoder may override `unit` (the module the layer scan repeats, from the config:
    a Block here), `unit_layers` (how many layers one unit holds: 1 here), `penalty` and `aux_metrics`."""

    @staticmethod
    def unit(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return Block(cfg, rngs)

    @staticmethod
    def unit_layers(cfg: ModelConfig) -> int:
        return 1

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embed(cfg.vocab_size, cfg.d_model, rngs, cfg.param_dtype, cfg.init_std, cfg.embed_scale)
        unit = type(self).unit  # not self: the vmapped function must close over no module

        @nnx.split_rngs(splits=cfg.stack_layers // self.unit_layers(cfg))
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(rngs):
            return unit(cfg, rngs)

        self.layers = make_layers(rngs)
        # With tied embeddings the final norm's gain cannot be folded: the table also embeds the input.
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype, cfg.norm,
                                  cfg.norm_weights != "standard" and not cfg.tie_embeddings,
                                  plus_one=cfg.norm_plus_one)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.param_dtype,
                                 cfg.init_std, quantize.for_group(cfg, "output"))

    def __call__(self, tokens_bt: jax.Array, positions_bt: jax.Array, segment_ids_bt: jax.Array) -> jax.Array:
        """float32 logits [b, t, vocab] for int32 tokens; positions and segment ids come from packing."""
        return self.logits(self.hidden(tokens_bt, positions_bt, segment_ids_bt))

    def _norm_first(self) -> bool:
        return self.cfg.tie_embeddings or self.cfg.norm == "standard"

    def hidden(self, tokens_bt: jax.Array, positions_bt: jax.Array, segment_ids_bt: jax.Array) -> jax.Array:
        """The stream [b, t, d] that `logits` projects, whole along the sequence: after the final norm where
        that is a standard RMSNorm, before it where the norm is deferred or fused into the projection. The layer
        stack as a plain scan (inference's; training's runner is runner.py's)."""
        x_btd, body, stacked, extras = self.stack_inputs(tokens_bt, positions_bt, segment_ids_bt)
        return self.final_stream(pipeline.scan(body, x_btd, stacked, extras, self.cfg.unroll_loops)[0])

    def stack_inputs(self, tokens_bt: jax.Array, positions_bt: jax.Array, segment_ids_bt: jax.Array,
                     remat_layers: bool = True, dropout_seeds: jax.Array | None = None,
                     layer_ids: np.ndarray | None = None):
        """The model's pieces as a runner of the layer stack (runner.py) takes them: the embedded stream
        [b, t, d], the layer body `body(x, layer_params, *extras) -> (x, aux)` (`aux` the layer's auxiliary sums,
        Block's), the stacked layer weights [layers, ...] and the per-row arrays every layer reads (RoPE's tables,
        the segment ids). The body has the config's remat policy applied, unless `remat_layers` is False: for a
        runner that takes each layer's vjp itself, where the layer's forward runs again anyway (1F1B).
        `dropout_seeds` [b, t] (a training step's, lora.token_seeds) turn LoRA's dropout on: they join the per-row
        arrays, and each layer's canonical index (`layer_ids`, in the order the stack is kept: default in order)
        joins its weights, so that each layer drops its own elements (models/lora.py)."""
        cfg = self.cfg
        x_btd = self.embed(tokens_bt, cfg.dtype)
        sin_bth, cos_bth = window.rope_tables(cfg, positions_bt)
        graphdef, stacked = nnx.split(self.layers)
        placed = functools.partial(_placed, cfg)
        extras = (sin_bth, cos_bth, segment_ids_bt)

        dropping = dropout_seeds is not None and cfg.lora_dropout
        # Each layer's canonical index rides with its weights where it drops its own elements or where the stack
        # mixes sliding and full layers (models/window.py).
        indexed = dropping or window.mixed(cfg)

        def layer(x_btd, layer_params, sin_bth, cos_bth, segment_ids_bt, seeds=None):
            x_btd = checkpoint_name(constrain(x_btd, ("batch", "residual_seq", "embed")), "decoder_layer_input")
            dropout, index = None, None
            if indexed:
                layer_params, index = layer_params
            if seeds is not None:
                dropout = lora.Dropout(seeds, index, cfg.lora_dropout)
            with lora.dropping(dropout), window.at_layer(cfg, index):
                return nnx.merge(graphdef, placed(layer_params))(x_btd, sin_bth, cos_bth, segment_ids_bt)

        if indexed:
            units = cfg.stack_layers // self.unit_layers(cfg)
            ids = np.arange(units) if layer_ids is None else layer_ids
            stacked = (stacked, jnp.asarray(ids, jnp.uint32))
        if dropping:
            extras = (*extras, dropout_seeds)
        body = remat.apply(layer, cfg.remat, cfg.remat_custom, cfg.unroll_loops) if remat_layers else layer
        return x_btd, body, stacked, extras

    def final_stream(self, x_btd: jax.Array) -> jax.Array:
        # Gathered along the sequence for the vocab-parallel output projection. The standard norm runs before
        # the gather, on the sequence-split stream, so that the backward pass reduce-scatters its input
        # gradient rather than all-reducing it; deferred and fused norms need whole rows, so run after it.
        if self._norm_first():
            x_btd = constrain(self.final_norm(x_btd), ("batch", "residual_seq", "embed"))
        return constrain(x_btd, ("batch", "seq", "embed"))

    def ahead(self, graphdef: nnx.GraphDef, params: Any, x_btd: jax.Array, batch: dict, head_loss) -> dict:
        """Auxiliary sums the model computes from the stack's output stream `x_btd` (before the final norm) beside
        the head, which `penalty` weighs: none here; DeepSeek's multi-token prediction (models/mtp.py), through
        `head_loss` (train/loss.py's)."""
        return {}

    def penalty(self, aux: dict) -> jax.Array:
        """What the objective adds for the layer stack's auxiliary sums (the runner's: [layers, ...], summed
        over the batch): none here; a mixture of experts' router losses (mixtral's). Linear in `aux`."""
        return jnp.zeros((), jnp.float32)

    def aux_metrics(self, aux: dict) -> dict:
        """What metrics.jsonl logs of the auxiliary sums: nothing here; a mixture of experts' router metrics."""
        return {}

    def after_update(self, params, aux: dict, keep: jax.Array, order: np.ndarray | None = None):
        """The parameters after the optimizer's update, with what the model moves itself outside the gradient
        from the step's auxiliary sums (`aux`, the layers in canonical order; `order`: the canonical index of each
        layer of the stack as the parameters keep it, None in order) where the update was kept (`keep`): nothing
        here; DeepSeek's router bias (models/deepseek)."""
        return params

    def init_cache(self, batch: int, max_len: int) -> tuple[jax.Array, jax.Array]:
        """An empty KV cache for `decode`: keys and values [layers, batch, max_len, kv_heads, head_dim]
        ([layers / k, k, ...] where the stack repeats groups of k layers, `unit_layers`)."""
        cfg = self.cfg
        k = self.unit_layers(cfg)
        grouped = (cfg.num_layers // k, k) if k > 1 else (cfg.num_layers,)
        shape = (*grouped, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        return jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype)

    def decode(self, tokens_bt: jax.Array, start: jax.Array, cache) -> tuple[jax.Array, tuple]:
        """float32 logits of tokens at positions [start, start + t), one sequence per row, attending to the
        positions before them through `cache` (init_cache's); returns the cache with theirs added. The same
        layers as `__call__`, so prefilling a prompt then feeding one token at a time computes its logits."""
        x_btd, sin_bth, cos_bth = self.decode_inputs(tokens_bt, start)
        x_btd, cache = decode_scan(self.cfg, self.layers, x_btd, sin_bth, cos_bth, start, cache)
        return self.logits(self.final_stream(x_btd)), cache

    def decode_inputs(self, tokens_bt: jax.Array, start: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The embedded tokens at positions [start, start + t) and their RoPE tables, for `decode`."""
        cfg = self.cfg
        x_btd = self.embed(tokens_bt, cfg.dtype)
        positions_bt = jnp.broadcast_to(start + jnp.arange(tokens_bt.shape[1], dtype=jnp.int32), tokens_bt.shape)
        return x_btd, *window.rope_tables(cfg, positions_bt)

    def logits(self, x_btd: jax.Array) -> jax.Array:
        """float32 logits [b, t, vocab] of `hidden`'s stream, or of any block of its positions."""
        quant = quantize.for_group(self.cfg, "output")
        if not self._norm_first():
            logits = self.final_norm.project(x_btd, self.lm_head[...], ("embed", "vocab"), out_dtype=jnp.float32,
                                             quant=quant)
        elif self.cfg.tie_embeddings:
            logits = self.embed.attend(x_btd, quant)
        else:
            logits = project(x_btd, self.lm_head[...], out_dtype=jnp.float32, quant=quant)
        if self.cfg.final_logit_softcap:  # Gemma 2's, in float32
            cap = self.cfg.final_logit_softcap
            logits = cap * jnp.tanh(logits / cap)
        return constrain(logits, ("batch", "seq", "vocab"))


def decode_scan(cfg: ModelConfig, layers: nnx.Module, x_btd, sin_bth, cos_bth, start, cache):
    """A stack of blocks (`layers`, stacked along their first axis) decoding x through its slice of the KV cache
    (Block.decode); returns the stream and the cache with these positions written."""
    graphdef, stacked = nnx.split(layers)

    def layer(x_btd, xs):
        layer_params, index, *layer_cache = xs
        block = nnx.merge(graphdef, _placed(cfg, layer_params))
        with window.at_layer(cfg, index):  # each layer's kind, where sliding and full layers mix
            return block.decode(x_btd, sin_bth, cos_bth, start, tuple(layer_cache))

    ids = jnp.arange(jax.tree.leaves(stacked)[0].shape[0], dtype=jnp.uint32)
    return jax.lax.scan(layer, x_btd, (stacked, ids, *cache), unroll=cfg.unroll_loops)


def layer_body(cfg: ModelConfig, graphdef: nnx.GraphDef, unrolled: bool | None = None):
    """body(x, layer_params, *extras) -> (x, aux): a block of this graphdef (one layer of a stack, its weights
    placed) under the config's remat policy, for a stack without per-layer indices (DeepSeek's dense first layers,
    the multi-token prediction modules). `unrolled` (default model.unroll_loops): run outside a loop (remat.apply)."""
    def layer(x_btd, layer_params, *extras):
        x_btd = constrain(x_btd, ("batch", "residual_seq", "embed"))
        return nnx.merge(graphdef, _placed(cfg, layer_params))(x_btd, *extras)

    return remat.apply(layer, cfg.remat, cfg.remat_custom, cfg.unroll_loops if unrolled is None else unrolled)


def _placed(cfg: ModelConfig, layer_params):
    """One layer's parameters, placed; matmul weights in the compute dtype from here on (norm gains stay in
    float32: the norms compute in it). An int8 base weight (lora.base_dtype int8) is gathered as it is stored, a
    byte a weight, and dequantized after. A function of the config alone: pipeline runners call the layer body
    inside their own transformations, where it must close over no traced value."""
    def place(v):
        cast = v[...].ndim > 1 and v[...].dtype != jnp.int8
        return v.replace(constrain_param(v[...], v.out_sharding[1:], cfg.dtype if cast else None))

    placed = jax.tree.map(place, layer_params, is_leaf=lambda v: isinstance(v, nnx.Variable))
    if cfg.lora_int8_base:
        nnx.replace_by_pure_dict(placed, lora.dequantized(nnx.to_pure_dict(placed), cfg.dtype))
    return placed
