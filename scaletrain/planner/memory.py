"""Memory per device: what XLA's compiled step says it needs, and what the planner predicts from the config.

The prediction (`predict`) counts the training state - parameters, gradients, optimizer state - as the bytes of
the trainer's own arrays placed by its own rule tables on an abstract mesh of the planned shape (layout.py), the
activations the remat policy keeps for the backward pass (remat.py) - a mixture of experts' routed rows among
them -, and the float32 logits and their gradient, which dominate small models. docs/planner.md states every rule.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import AbstractMesh

from scaletrain import models as model_lib
from scaletrain import remat
from scaletrain.config import moe_d_ff
from scaletrain.errors import ConfigError
from scaletrain.models.mixtral import moe
from scaletrain.parallel import pipeline_1f1b, pipeline_zb, sharding
from scaletrain.parallel.checks import microbatches, shards_kv_heads
from scaletrain.planner import residuals
from scaletrain.train import layout as layout_lib
from scaletrain.train import objective
from scaletrain.train.runner import Runner

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# Outputs of matmuls without batch dims (remat.policy save_dots): every projection; the attention einsums have
# batch dims and are recomputed.
SAVE_DOTS = ("query_proj", "key_proj", "value_proj", "out_proj", "mlp_gate", "mlp_up", "mlp_out")
# The peak of one layer's backward pass under a remat policy, recomputed from its input: scaling.md's "about
# 2 * 20 * B*T*D bytes per layer" - 20 tensors of [tokens, d_model], of which this many lie on the residual stream
# (split over `tensor` only with sequence parallelism), the rest inside attention and the MLP. Fewer than the layer
# saves for its backward pass in all (residuals.per_token: 38.6 on Llama-3.1-8B): XLA frees a recomputed
# layer's residuals as its backward pass consumes them, and the compiled full-remat steps hold less than the sum.
NONE_TENSORS, RESIDUAL_TENSORS = 20, 6


@dataclass(frozen=True)
class State:
    """The training state on a planned mesh, as the trainer lays it out (layout.py): per-device bytes of one
    copy of each kind of array, wherever it lives."""

    layout: layout_lib.StateLayout
    mesh: AbstractMesh
    params: int  # every parameter, a frozen base (LoRA's) in lora.base_dtype
    optimizer: int
    gradients: int  # of the trained parameters
    refused: str | None  # why the trainer could not place these arrays on this mesh (a dim it does not divide)
    trained: int = 0  # of `params`, the trained ones' (all but LoRA's base)
    reference: int = 0  # DPO's frozen copy of the model (dpo.reference copy), in the dtypes its forward reads

    def weights(self, table: sharding.RuleTable, gathered: Sequence[str] = (),
                experts: bool | None = None, dtypes: Any = None, trained: bool = False) -> tuple[float, float]:
        """Bytes one device holds of the parameters placed by `table`, gathered over the mesh axes `gathered`
        (sharded over none of them): (one layer's - the stack's over its layers -, those outside the layers).
        `experts`: of the arrays with an `experts` dim only (True), of the others only (False), or of all.
        `dtypes`: each parameter's dtype (a tree like the parameters', models.operand_dtypes), else as stored.
        `trained`: of the trained parameters only (what has gradients and optimizer state)."""
        table = {k: tuple(a for a in sharding.mesh_axes(v) if a not in gathered) for k, v in table.items()}
        lay = self.layout
        params = lay.params if dtypes is None else jax.tree.map(
            lambda x, d: jax.ShapeDtypeStruct(x.shape, d), lay.params, dtypes)
        logical = lay.logical
        if trained:
            params, logical = lay.parts.trainable(params), lay.parts.trainable(logical)

        def part(inside: bool) -> int:
            pairs = [(x, names) for k in params if (k == "layers") == inside
                     for x, names in zip(jax.tree.leaves(params[k]),
                                         jax.tree.leaves(logical[k], is_leaf=sharding.is_logical))
                     if experts is None or ("experts" in names) == experts]
            return layout_lib.device_bytes([x for x, _ in pairs], [names for _, names in pairs], table, self.mesh)

        return part(True) / lay.model_cfg.num_layers, part(False)


def state(cfg, axes: Mapping[str, int]) -> State:
    """The trainer's own layout of the state (its model's parameters, its optimizer's state, their rule tables)
    applied on an abstract mesh of these axis sizes. Where the mesh does not divide an array the bytes are
    rounded up (XLA pads) and `refused` says what the trainer would."""
    lay = layout_lib.of(cfg, axes)
    mesh = layout_lib.abstract_mesh(axes)
    try:
        lay.shardings(mesh)  # the trainer's own placement, and its divisibility checks
        refused = None
    except ConfigError as e:
        refused = str(e)
    trained, trained_logical = lay.parts.trainable(lay.params), lay.parts.trainable(lay.logical)
    reference = 0
    if objective.reference_kind(cfg) == "copy":  # laid out as the trainer lays it (trainer.build)
        copy = jax.tree.map(lambda x, d: jax.ShapeDtypeStruct(x.shape, d), lay.params,
                            model_lib.operand_dtypes(lay.model_cfg, quantized=False))
        reference = layout_lib.device_bytes(copy, lay.logical, lay.rules.params, mesh)
    return State(layout=lay, mesh=mesh, refused=refused,
                 params=layout_lib.device_bytes(lay.params, lay.logical, lay.rules.params, mesh),
                 optimizer=layout_lib.device_bytes(lay.opt_state, lay.opt_logical, lay.rules.opt_state, mesh),
                 gradients=layout_lib.device_bytes(trained, trained_logical, lay.rules.grads, mesh),
                 trained=layout_lib.device_bytes(trained, trained_logical, lay.rules.params, mesh),
                 reference=reference)


def kept(policy: str, custom: Mapping[str, str]) -> dict[str, str]:
    """The named activations a remat policy (other than none) keeps per layer, and where: 'device' or 'offload'
    (to pinned host memory). The layer input is left out: every policy keeps it on the device (the scan carry)."""
    if policy == "full":
        return {}
    if policy == "save_dots":
        return dict.fromkeys(SAVE_DOTS, "device")
    modes = custom if policy == "custom" else remat.NAMED[policy]
    return {n: mode for n, mode in modes.items() if mode != "remat" and n != "decoder_layer_input"}


def moe_share(m) -> float:
    """The share of the stack's layers that are mixtures of experts (model.moe_every: every k-th)."""
    return model_lib.ModelConfig.from_config(m).moe_layers / m.num_layers


def activation_rules(cfg, axes: Mapping[str, int], sequence_parallel: bool) -> sharding.RuleTable:
    """The activation rule table the trainer uses for this config on a mesh of these axis sizes, with or without
    sequence parallelism (the roofline's matmul and attention passes read the unsplit stream)."""
    shard_kv = shards_kv_heads(cfg.model.num_kv_heads, axes["tensor"])
    return sharding.rules_for(cfg.sharding.preset, sequence_parallel, shard_kv).activations


def tensor_elements(m, activations: sharding.RuleTable, axes: Mapping[str, int],
                    received_rows: float = 0.0) -> dict[str, float]:
    """Elements per token and layer one device holds of each named activation (docs/memory.md's table), split as
    the activation rule table `activations` splits their logical axes on a mesh of these axis sizes: the residual
    stream along `residual_seq` (over `tensor` with sequence parallelism), heads, kv heads (where `tensor` divides
    them), mlp and the experts' hidden dim. Averaged over the stack: the dense MLP's gate and up exist in its dense
    layers, the experts' in its MoE layers, for the `received_rows` rows per token a MoE layer's experts receive
    (`expert_rows`)."""
    def split(logical: str, size: float) -> float:
        return size / sharding.split_ways(logical, activations, axes)

    residual = split("residual_seq", m.d_model)
    heads, kv = split("heads", m.num_heads * m.head_dim), split("kv_heads", m.num_kv_heads * m.head_dim)
    # latent attention's values (and so its attention output) are v_head_dim wide, unlike its queries and keys
    v_dim = m.v_head_dim or m.head_dim
    values, out = split("kv_heads", m.num_kv_heads * v_dim), split("heads", m.num_heads * v_dim)
    moe = moe_share(m)
    mlp, experts = (1 - moe) * split("mlp", m.d_ff), moe * received_rows * split("moe_mlp", moe_d_ff(m))
    return {"decoder_layer_input": residual, "query_proj": heads, "key_proj": kv, "value_proj": values,
            "attention_out": out, "out_proj": residual, "mlp_gate": mlp, "mlp_up": mlp, "mlp_out": residual,
            "moe_gate": experts, "moe_up": experts}


def expert_rows(cfg, axes: Mapping[str, int], ragged: bool = True) -> tuple[float, float]:
    """moe.rows_per_token for this config and mesh: the rows per token a MoE layer sends and receives."""
    m = cfg.model
    return moe.rows_per_token(m.experts_per_token, m.num_experts, axes["expert"], m.capacity_factor,
                              cfg.data.seq_len, ragged)


# The peak of a routed layer's backward pass, in the compiled TPU steps' live buffers (DeepSeek-V3 671B on
# v5p:8x16x16 and a DeepSeek-shaped model of width 1024 on v5p:2x2x2, both 64 rows received per token): six
# d_model-wide arrays of the rows the experts receive - the rows received (recomputed), sorted by expert for the
# forward pass and again for the backward's, the gate's and up's input gradients and their sum -, one of the rows
# sent, and three of the experts' hidden (the gate's, up's and their product's gradients).
RECEIVED_COPIES, SENT_COPIES, HIDDEN_COPIES = 6, 1, 3


def routed_layer(cfg, axes: Mapping[str, int], dtype_bytes: int, ragged: bool, peak: bool = False) -> float:
    """Bytes per token a MoE layer holds beyond its per-token tensors (those of the router and the combination:
    residuals.per_token or NONE_TENSORS). Saved for its backward pass: the rows it sends and those that return,
    the rows its experts receive and compute (the dispatch buffers), and the experts' hidden - gate, up and their
    product - for those. At the `peak` of its backward pass (a rematerialised layer's): the rows received, their
    permutations and gradients, the rows sent and the hidden's gradients (RECEIVED_COPIES...)."""
    sent, received = expert_rows(cfg, axes, ragged)
    hidden = moe_d_ff(cfg.model) / axes["tensor"]
    if peak:
        rows, hiddens = RECEIVED_COPIES * received + SENT_COPIES * sent, HIDDEN_COPIES * received
    else:
        rows, hiddens = 2 * (sent + received), 3 * received
    return (rows * cfg.model.d_model + hiddens * hidden) * dtype_bytes


def blocked_attention(cfg) -> bool:
    """model.attention_block splits the queries of XLA's attention (models/attention.py): scores are
    rematerialised per block."""
    block, seq = cfg.model.attention_block, cfg.data.seq_len
    return cfg.model.attention == "xla" and 0 < block < seq and seq % block == 0


def ring_attention(cfg, axes: Mapping[str, int]) -> bool:
    """Context parallelism's ring schedule runs attention (kernels/ring_attention.py): its scores a tile of
    queries against one device's keys at a time, rematerialised in its own backward pass."""
    return cfg.model.context_attention == "ring" and sharding.seq_ways(axes) > 1


def logits_blocked(cfg) -> bool:
    """model.logits_block splits the output projection and the loss."""
    return 0 < cfg.model.logits_block < cfg.data.seq_len


def logits_share(cfg, axes: Mapping[str, int]) -> float:
    """The share of a device's positions whose float32 logits exist at a time: model.logits_block of each context
    shard's (train/loss.py), or all."""
    block, shard = cfg.model.logits_block, cfg.data.seq_len // sharding.seq_ways(axes)
    return block / shard if 0 < block < shard else 1.0


def _scores(cfg, tensor: int, ring: bool) -> float:
    """XLA's attention scores per token when no query blocking bounds them (the float32 softmax output its VJP
    reads and the probabilities cast for the values matmul: N T elements), else none (`ring`: ring_attention)."""
    m = cfg.model
    whole = m.attention == "xla" and not blocked_attention(cfg) and not ring  # flash keeps scores on-chip
    return m.num_heads / tensor * cfg.data.seq_len * (4 + DTYPE_BYTES[m.dtype]) if whole else 0.0


def _saved_layer(cfg, model_cfg, tensor: int, ring: bool) -> float:
    """Bytes per token one layer keeps for its backward pass with nothing rematerialised: the residuals the
    model's own layer body saves (residuals.per_token: the stream's split over `tensor` only with sequence
    parallelism, the rest always), and the scores."""
    stream, inner = residuals.per_token(model_cfg)
    return stream / (tensor if cfg.sharding.sequence_parallel else 1) + inner / tensor + _scores(cfg, tensor, ring)


def _zero_bubble_kept(cfg, model_cfg, tensor: int, ring: bool, runner: Runner) -> float:
    """Bytes per token and layer a zero-bubble stage keeps over its buffers: each buffer's share of the layer
    (residuals.zero_bubble_per_token, split over `tensor` as `_saved_layer`'s) times the most microbatches it
    holds (pipeline_zb.depths). XLA attention's scores go to the input slot - whole, query blocks or not: the
    cut keeps what a blocked attention's loop hands its backward pass, every block's."""
    depth = pipeline_zb.depths(runner.stages, runner.microbatches)
    split = tensor if cfg.sharding.sequence_parallel else 1
    buffers, scores = residuals.zero_bubble_per_token(model_cfg)
    per = {k: stream / split + inner / tensor for k, (stream, inner) in buffers.items()}
    if cfg.model.attention == "xla" and not ring:
        per["to_input"] += scores * cfg.data.seq_len / tensor
    return sum(per[k] * depth[k] for k in per)


def _rematerialised_layer(cfg, model_cfg, elements: Mapping[str, float], tensor: int, dtype_bytes: int,
                          ring: bool) -> float:
    """Bytes per token at the peak of one rematerialised layer's backward pass. Under full remat the whole layer
    is computed again before any of its backward pass runs - every residual the layer saves under policy none at
    once (`_saved_layer`) - and the MLP's backward pass then adds the gradients of gate and up (one fusion writes
    both from the down projection's input gradient) before it frees what it has read: the compiled 8B step holds
    eight bf16[T, F] buffers of the MLP beside the recomputed layer's others (docs/planner.md). Under the other
    policies XLA interleaves the recomputation with the backward pass: NONE_TENSORS of d_model, and the scores."""
    if cfg.remat.policy == "full":
        hidden = elements["mlp_gate"] + elements["mlp_up"]  # the experts': routed_layer's peak
        return _saved_layer(cfg, model_cfg, tensor, ring) + hidden * dtype_bytes
    d, sp = cfg.model.d_model, cfg.sharding.sequence_parallel
    residual = RESIDUAL_TENSORS * d / (tensor if sp else 1)
    inner = (NONE_TENSORS - RESIDUAL_TENSORS) * d / tensor
    return (residual + inner) * dtype_bytes + _scores(cfg, tensor, ring)


# Copies of the whole batch's residual stream a pipelined step holds beside its microbatches' (measured on the
# CPU's compiled steps: tests/test_pipeline.py).
PIPELINE_STREAM_COPIES = 3

# Live copies of one query block's attention scores while its backward pass runs, from the compiled 8B step's
# buffer assignment (docs/planner.md): four float32 (scores, probabilities, their gradients) and the
# probabilities in the compute dtype for the values matmul.
BLOCK_SCORE_F32_COPIES = 4


def _attention_block_working(cfg, tokens: float, tensor: int, dtype_bytes: int, context: int = 1) -> float:
    """Bytes of one query block's scores, for the device's sequences (`tokens` of them, each 1/`context` of its
    sequence under context parallelism): zero without query blocking (the scores are then part of every layer's
    activations). The ring schedule's tile (model.attention_block queries, or the device's whole shard) meets one
    device's keys at a time; through the flash kernel (kernels/ring_splash.py) its scores stay on-chip."""
    m, seq = cfg.model, cfg.data.seq_len
    ring = m.context_attention == "ring" and context > 1 and m.attention == "xla"
    if not (blocked_attention(cfg) or ring):
        return 0.0
    keys = seq // context if ring else seq  # a tile meets at a time
    queries = m.attention_block if 0 < m.attention_block < keys else keys
    elements = tokens * context / seq * m.num_heads / tensor * queries * keys
    return elements * (BLOCK_SCORE_F32_COPIES * 4 + dtype_bytes)


@dataclass(frozen=True)
class Prediction:
    """Bytes per device: device memory by role (the CONTRACT's keys), the activations' parts, and host memory."""

    params: float
    optimizer: float
    gradients: float
    activations: float
    saved_activations: float  # what the remat policy keeps for every layer on the device
    layer_working_set: float  # one layer rematerialised in the backward pass
    logits: float  # float32 logits and their gradient
    host_params: float
    host_optimizer: float
    host_gradients: float
    host_activations: float

    @property
    def total(self) -> float:
        return self.params + self.optimizer + self.gradients + self.activations

    @property
    def host_total(self) -> float:
        return self.host_params + self.host_optimizer + self.host_gradients + self.host_activations

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total, "host_total": self.host_total}


def unscattered_gradients(cfg, s: State) -> float:
    """Bytes of the gradients the backward pass forms whole before they are scattered (ZeRO-2: the gradient rule
    shards what the parameter rule does not, and train/step.py places them after the backward pass): laid out as
    the parameters, in the compute dtype the weights were cast to (their gradients are cast back per array as they
    are placed). None where gradients and parameters are split alike."""
    if s.gradients >= s.trained:
        return 0.0
    return s.trained * DTYPE_BYTES[cfg.model.dtype] / DTYPE_BYTES[cfg.model.param_dtype]


def gathered_layer(s: State, dtypes: Any = None, trained: bool = False) -> float:
    """Bytes (in the parameters' dtype, or in `dtypes`: State.weights') of one layer's weights as its matmuls use
    them - gathered over the batch axes that shard them (FSDP; an expert's weights stay on their `expert`
    devices) -, or 0 where no batch axis shards them (they are used where they lie). `trained`: of the trained
    weights only (those whose gradients the layer forms)."""
    batch = sharding.mesh_axes(s.layout.rules.activations["batch"])
    table = s.layout.rules.params
    held, _ = s.weights(table, trained=trained)
    whole = (s.weights(table, batch, experts=False, dtypes=dtypes, trained=trained)[0]
             + s.weights(table, tuple(a for a in batch if a != "expert"), experts=True, dtypes=dtypes,
                         trained=trained)[0])
    stages = s.mesh.shape["pipeline"]  # State.weights averages a stage's layers over the whole stack
    return whole * stages if whole > held else 0.0


def hoisted_experts(s: State) -> float:
    """The device's shard of every stacked layer's experts in the dtype their matmuls read, where it is not the one
    they are kept in: XLA hoists the cast out of the layer loop and keeps it through the step (docs/planner.md)."""
    table, dtypes = s.layout.rules.params, model_lib.operand_dtypes(s.layout.model_cfg)
    kept, read = s.weights(table, experts=True)[0], s.weights(table, experts=True, dtypes=dtypes)[0]
    return read * s.layout.model_cfg.num_layers if read != kept else 0.0


def replica_tokens(cfg, axes: Mapping[str, int]) -> float:
    """Tokens of one microbatch that one device's matmuls see: its data-parallel replica's share of the batch
    (data x fsdp x expert ways: the expert axis's devices each route their own share, models/mixtral/moe.py) and
    its `context` shard's of each sequence (context parallelism; the zig-zag layout gives each shard the same
    attention work). Tensor devices share them."""
    ways = sharding.batch_ways(axes) * sharding.seq_ways(axes)
    return cfg.train.global_batch * cfg.data.seq_len / (microbatches(cfg, axes) * ways)


def sequence_kv(elements: Mapping[str, float], axes: Mapping[str, int]) -> float:
    """Elements per token a device holds of the keys and values of the whole sequences its tokens belong to:
    what context parallelism gathers for one layer's attention (models/attention.py), `elements` being
    tensor_elements'."""
    return (elements["key_proj"] + elements["value_proj"]) * sharding.seq_ways(axes)


def gathered_kv(elements: Mapping[str, float], axes: Mapping[str, int]) -> float:
    """`sequence_kv` less the device's own keys and values: what the gather brings (zero without context
    parallelism)."""
    return sequence_kv(elements, axes) - elements["key_proj"] - elements["value_proj"]


def held_microbatches(runner: Runner) -> int:
    """Microbatches whose activations one device holds at the peak under the trainer's stack runner: one
    without pipelining; with it, every one under GPipe (a stage keeps each until its backward pass) - once per
    repeat under a circular schedule -, at most 2 P - 1 under 1F1B, 2 R P - 1 interleaved (pipeline_1f1b.depth),
    those awaiting their weight slot under zero-bubble (pipeline_zb.depths)."""
    if runner.stages == 1:
        return 1
    if runner.schedule == pipeline_zb.SCHEDULE:
        return pipeline_zb.depths(runner.stages, runner.microbatches)["to_weight"]
    if runner.schedule in pipeline_1f1b.SCHEDULES:
        return pipeline_1f1b.depth(runner.stages, runner.microbatches, runner.repeats)
    return runner.microbatches * runner.repeats


def predict(cfg, axes: Mapping[str, int], state_: State | None = None, ragged: bool = True) -> Prediction:
    """Bytes per device of a train step for config `cfg` on a mesh whose axis sizes (ICI x DCN) are `axes`.

    State: the bytes of the trainer's own arrays on that mesh (`state`): parameters in model.param_dtype (the
    master copy: no other is kept; LoRA's frozen base in lora.base_dtype), Adam's two moments in
    optim.moment_dtype and gradients in the parameters' dtype, of the trained parameters only (LoRA's adapters) -
    the gradients twice over with gradient accumulation or a pipeline (the running sum and a microbatch's) -, DPO's
    reference copy in `params` (in the dtypes its forward pass reads: State.reference), and under
    ZeRO-2 the whole gradient the backward pass forms before scattering it (`unscattered_gradients`). With
    pipeline.gather_weights=once, each device also holds its stage's weights gathered and two whole gradients
    (the sum, a backward slot's). optim.offload moves the moments to host memory, params.offload parameters,
    moments and gradients (a pipeline's stage still holds its parameters and gradients on the device for the
    step, fetched whole).
    Activations (for the device's share of the tokens: `replica_tokens`): the remat policy's saved tensors for every
    layer of the device's stage (policy none: the residuals the layer body saves, residuals.per_token), the peak of
    one layer's backward pass while it rematerialises it (every other policy: NONE_TENSORS), and the float32 logits
    and their gradient - of one block of model.logits_block positions per sequence when that is set. A GPipe stage
    keeps them for every microbatch; under a remat policy it keeps each microbatch's stage input rather than every
    layer's input (pipeline.py rematerialises an iteration from it), and recomputing one iteration holds its layers'
    inputs. A 1F1B stage keeps each layer's input for `held_microbatches` microbatches whatever the policy, and
    in its backward slot holds one layer's residuals for one microbatch, every one (pipeline_1f1b.py takes each
    layer's vjp, unrematerialised, from its kept input) - with pipeline.keep=stage_inputs only its stage input
    kept, and one microbatch's layer inputs again in the backward slot; it runs the head, logits and all, on one
    microbatch at a time. A mixture-of-experts layer holds its routed rows besides (`routed_layer`; `ragged`: the
    TPU's transport, `expert_rows`), and keeps the experts' gate and up where the policy keeps `moe_gate` and
    `moe_up`. Context parallelism adds one layer's gathered keys and values and their gradient (`gathered_kv`).
    """
    m = cfg.model
    t, stage_layers = axes["tensor"], m.num_layers / axes["pipeline"]
    ab = DTYPE_BYTES[m.dtype]
    s = state_ or state(cfg, axes)
    params, moments = s.params, s.optimizer
    runner = s.layout.runner
    pipelined = runner.stages > 1
    sums = cfg.train.grad_accum_steps > 1 or pipelined  # gradients summed over microbatches
    grads = s.gradients * (2 if sums else 1) + unscattered_gradients(cfg, s)
    one_f_one_b = runner.recomputes_every_layer
    micro = replica_tokens(cfg, axes)  # one microbatch: what one layer (or iteration) recomputes
    tokens = micro * held_microbatches(runner)
    elements = tensor_elements(m, s.layout.rules.activations, axes, expert_rows(cfg, axes, ragged)[1])
    # 1F1B's layers run unrematerialised in its backward slot, one at a time: policy none's residuals, one layer's.
    zero_bubble = runner.schedule == pipeline_zb.SCHEDULE
    policy = "none" if runner.forms_gradients else cfg.remat.policy
    ring = ring_attention(cfg, axes)
    # A 1F1B stage keeps each of a block's layers' inputs (a stage's, one block interleaved) for every microbatch
    # it holds - or only the block's input (pipeline.keep=stage_inputs), and the block's layers' inputs again for
    # the microbatch its backward slot is at.
    block_layers = stage_layers / runner.repeats
    kept_inputs = elements["decoder_layer_input"] * ab * tokens * (1 if runner.keep_stage_inputs else block_layers)
    again = elements["decoder_layer_input"] * ab * micro * block_layers if runner.keep_stage_inputs else 0.0
    moe = moe_share(m)
    # Bytes per token of a layer with nothing rematerialised: a MoE layer's routed rows on top.
    routed = routed_layer(cfg, axes, ab, ragged) if moe else 0.0
    if policy == "none":
        layer = _saved_layer(cfg, s.layout.model_cfg, t, ring) + moe * routed
        if zero_bubble:
            saved, working = stage_layers * micro * _zero_bubble_kept(cfg, s.layout.model_cfg, t, ring, runner), 0.0
        elif one_f_one_b:
            saved, working = kept_inputs, layer * micro + again
        else:
            saved, working = layer * stage_layers * tokens, 0.0
        ahead = layer  # what a multi-token prediction module's block keeps per token
        offloaded = 0.0
        working += _attention_block_working(cfg, micro if runner.forms_gradients else tokens, t, ab,
                                            sharding.seq_ways(axes))
    else:
        where = kept(policy, cfg.remat.custom)
        named = sum(elements[n] for n, w in where.items() if w == "device")
        host = sum(elements[n] for n, w in where.items() if w == "offload")
        peak = routed_layer(cfg, axes, ab, ragged, peak=True) if moe else 0.0
        working = ((_rematerialised_layer(cfg, s.layout.model_cfg, elements, t, ab, ring) + peak) * micro
                   + _attention_block_working(cfg, micro, t, ab, sharding.seq_ways(axes)))
        # The plain scan's saved layer inputs - the carries jax stacks for the backward pass - are held whole
        # along the sequence, sequence parallelism or not: XLA gathers them once in the forward pass, as the
        # recomputation reads them whole (Llama-3.1-70B on fsdp 8 x tensor 8 under save_dots: the compiled
        # buffer bf16[80, 32768, 8192], 40 GiB, where the split stream would take 5).
        inputs = elements["decoder_layer_input"] if pipelined else m.d_model * stage_layers
        saved, offloaded = (inputs + named * stage_layers) * ab * tokens, host * ab * tokens * stage_layers
        ahead = (m.d_model + named) * ab
        if pipelined:
            working += elements["decoder_layer_input"] * ab * micro * stage_layers
    if pipelined:  # the whole batch's stream: embedded, leaving the stack (GPipe) or its gradient (1F1B), and that
        # gradient's gradient through the embedding; not a microbatch at a time
        working += PIPELINE_STREAM_COPIES * elements["decoder_layer_input"] * ab * micro * microbatches(cfg, axes)
    logits_tokens = micro * (microbatches(cfg, axes) if pipelined and not runner.forms_gradients else 1)
    # Whole logits: XLA writes their gradient over them (same shape, dead once it is formed) - one float32 copy; the
    # Llama 3.2 1B's compiled step at 4096 tokens per chip has 4.3 GiB of temporaries, two copies would be 3.9.
    # Blocked (model.logits_block): a block's logits and its gradient, formed in the forward pass (loss.py).
    copies = 2 if logits_share(cfg, axes) < 1 else 1
    # The multi-token prediction modules (models/mtp.py) run after the stack on what leaves it: each keeps a
    # block's activations and its head's logits, all alive when the backward pass starts, and the first gradient
    # of logits is formed beside them rather than over them (a DeepSeek-shaped model at 4096 tokens and 32768 ids
    # a chip compiled to 1.57 GiB more with one module: about three logits' worth, one its block's).
    saved += m.mtp_depth * ahead * logits_tokens
    logits = ((1 + m.mtp_depth) * copies + (m.mtp_depth > 0)) * logits_tokens * logits_share(cfg, axes) \
        * m.vocab_size / t * 4
    # FSDP's layer at a time: the layer's weights gathered as its matmuls take them (weight matrices in the
    # compute dtype, int8 or fp8 where quantized, norm gains as they are: models.operand_dtypes), and the next
    # layer's gathered while it runs; its weight gradient formed whole before it is scattered (the 70B's
    # full-remat compile holds them beside the recomputed layer: 41.6 GiB compiled, 32.7 planned without them).
    if not runner.gather_once:
        working += 2 * gathered_layer(s, model_lib.operand_dtypes(s.layout.model_cfg)) + gathered_layer(s, trained=True)
        working += hoisted_experts(s)
    # Context parallelism: one layer's keys and values gathered whole, and their gradient formed whole before it
    # is scattered back; or the ring's blocks: the one worked on and the one in flight, each with its float32
    # gradient backward.
    own_kv = elements["key_proj"] + elements["value_proj"]
    working += (2 * (ab + 4) * own_kv if ring else 2 * gathered_kv(elements, axes) * ab) * micro
    if runner.gather_once:  # a whole stage's weights and gradient sums on every device
        batch = sharding.mesh_axes(s.layout.rules.activations["batch"])
        for table, role in ((s.layout.rules.params, "params"), (s.layout.rules.grads, "grads")):
            layer, rest = s.weights(table, batch, trained=role == "grads")
            whole = layer * m.num_layers + rest
            params, grads = (params + whole, grads) if role == "params" else (params, grads + 2 * whole)
    on_host = s.layout.params_home is not None
    # A pipeline fetches its stage's weights whole for the step (runner.Runner.fetches_layers): the device holds
    # them and their gradients, as without params.offload.
    on_device = not on_host or not runner.fetches_layers
    moments_on_host = s.layout.opt_home is not None
    params += s.reference  # DPO's reference copy: always on the device
    return Prediction(
        params=params if on_device else s.reference, optimizer=0.0 if moments_on_host else moments,
        gradients=grads if on_device else 0.0, activations=saved + working + logits, saved_activations=saved,
        layer_working_set=working, logits=logits, host_params=params - s.reference if on_host else 0.0,
        host_optimizer=moments if moments_on_host else 0.0, host_gradients=grads if on_host else 0.0,
        host_activations=offloaded)
