"""Which meshes the trainer accepts for a config: one set of checks, for the trainer (an error before anything is
built), the launcher (before a slice is rented) and the planner (a warning: it plans a refused mesh all the
same). `sharding.tree_shardings` checks every array's divisibility on top of these."""

from __future__ import annotations

from typing import Mapping

from scaletrain.config import moe_d_ff
from scaletrain.config_window import sliding_layers
from scaletrain.errors import ConfigError
from scaletrain.parallel import context, pipeline, pipeline_1f1b
from scaletrain.parallel.sharding import batch_ways

# The flash kernel's query blocks are multiples of the TPU's 128 lanes (kernels/flash_attention.py's _LANES,
# which takes it from here: checking a config does not import the kernels).
FLASH_BLOCK = 128


def shards_kv_heads(num_kv_heads: int, tensor: int) -> bool:
    """Key/value heads are split over `tensor` where it divides them, and replicated over it otherwise (each
    device keeps every K/V head and uses those its query heads share)."""
    return num_kv_heads % tensor == 0


def microbatches(cfg, axis_sizes: Mapping[str, int]) -> int:
    """Microbatches a step splits its batch into: the pipeline's where there are stages (pipeline.microbatches,
    0: one per stage), else gradient accumulation's."""
    stages = axis_sizes["pipeline"]
    if stages > 1:
        return cfg.pipeline.microbatches or stages
    return cfg.train.grad_accum_steps


def problems(cfg, axis_sizes: Mapping[str, int]) -> list[str]:
    """What the trainer would refuse about a mesh of these axis sizes (ICI x DCN), said plainly: the divisibility
    users trip over most, and the pairings that do not compose (docs/parallelism.md's table says why). Empty when
    it would train."""
    out = []
    m, tensor = cfg.model, axis_sizes["tensor"]
    for key in ("num_heads", "d_ff", "vocab_size"):
        if m[key] % tensor:
            out.append(f"model.{key}={m[key]} is not divisible by mesh.tensor={tensor}")
    kv = m.num_kv_heads
    if kv % tensor and tensor % kv:
        out.append(f"model.num_kv_heads={kv} and mesh.tensor={tensor}: key/value heads are sharded over tensor "
                   f"when it divides them and replicated when they divide it; neither holds")
    if cfg.sharding.sequence_parallel and tensor > 1 and cfg.data.seq_len % tensor:
        out.append(f"data.seq_len={cfg.data.seq_len} is not divisible by mesh.tensor={tensor}, which splits the "
                   f"sequence with sharding.sequence_parallel=true")
    stages, repeats, schedule = axis_sizes["pipeline"], cfg.pipeline.repeats, cfg.pipeline.schedule
    # The pipeline splits the scanned stack: the dense first layers (model.first_dense_layers) run before it.
    layers, what = m.num_layers - m.first_dense_layers, "model.num_layers - model.first_dense_layers"
    if not m.first_dense_layers:
        what = "model.num_layers"
    if layers % stages:
        out.append(f"{what}={layers} is not divisible by mesh.pipeline={stages}")
    if stages > 1:
        if repeats > 1 and schedule not in pipeline.BLOCKED:
            out.append(f"pipeline.repeats={repeats} needs pipeline.schedule=circular or interleaved_1f1b (got "
                       f"{schedule})")
        if schedule in pipeline.BLOCKED and layers % (stages * repeats):
            out.append(f"{what}={layers} is not divisible by mesh.pipeline x pipeline.repeats = "
                       f"{stages * repeats}, the {schedule} schedule's blocks of layers")
        if schedule == "interleaved_1f1b" and repeats == 1:
            out.append("pipeline.schedule=interleaved_1f1b needs pipeline.repeats >= 2 (each stage's blocks of "
                       "layers); with one block it is pipeline.schedule=1f1b")
        if schedule == "interleaved_1f1b" and repeats > 1 and microbatches(cfg, axis_sizes) % stages:
            out.append(f"pipeline.microbatches={microbatches(cfg, axis_sizes)} is not a multiple of mesh.pipeline="
                       f"{stages}: interleaved 1F1B sends microbatches round the stages in groups of {stages}")
        if schedule == "circular" and repeats > 1 and microbatches(cfg, axis_sizes) < stages:
            out.append(f"pipeline.microbatches={microbatches(cfg, axis_sizes)} is fewer than mesh.pipeline={stages}: "
                       f"a circular schedule sends a microbatch round again only after the last stage has done it")
        if cfg.pipeline.gather_weights == "once" and schedule not in pipeline_1f1b.OWN_GRADIENTS:
            out.append(f"pipeline.gather_weights=once needs pipeline.schedule=1f1b, interleaved_1f1b or "
                       f"zero_bubble (got {schedule}), whose loop runs per device and can sum the gradients before "
                       f"reducing them")
        if cfg.pipeline.keep == "stage_inputs" and schedule not in pipeline_1f1b.SCHEDULES:
            out.append(f"pipeline.keep=stage_inputs needs pipeline.schedule=1f1b or interleaved_1f1b (got "
                       f"{schedule}): GPipe and circular keep what their remat policy says, zero_bubble its "
                       f"layers' residuals")
        if cfg.train.grad_accum_steps > 1:
            out.append("with mesh.pipeline > 1 the pipeline's microbatches replace gradient accumulation: set "
                       "pipeline.microbatches and train.grad_accum_steps=1")
        if cfg.lora.rank and schedule == "zero_bubble":
            out.append("lora.rank > 0 with pipeline.schedule=zero_bubble: zero-bubble fills its bubble with the "
                       "weights' gradients, which LoRA's frozen base has none of; use pipeline.schedule=1f1b")
        if cfg.lora.rank and cfg.lora.dropout and schedule in pipeline_1f1b.OWN_GRADIENTS:
            out.append(f"lora.dropout={cfg.lora.dropout} with pipeline.schedule={schedule}: its program takes each "
                       f"layer's vjp itself and does not carry the layers' dropout seeds; use pipeline.schedule=gpipe "
                       f"or circular, or lora.dropout=0")
        if m.mtp_depth and schedule in pipeline_1f1b.OWN_GRADIENTS:
            out.append(f"model.mtp_depth={m.mtp_depth} with pipeline.schedule={schedule}: its program runs the head "
                       f"on each microbatch inside its loop, where the multi-token prediction modules do not run; "
                       f"use pipeline.schedule=gpipe or circular")
        if cfg.train.objective == "dpo" and schedule in pipeline_1f1b.OWN_GRADIENTS:
            out.append(f"train.objective=dpo with pipeline.schedule={schedule}: its program returns summed losses, "
                       f"not the per-token log-probs of the reference's forward pass nor the rewards DPO logs; use "
                       f"pipeline.schedule=gpipe or circular")
    context_ways = axis_sizes["context"]
    if context_ways > 1:
        pieces = context.chunks(context_ways, cfg.sharding.context_layout)
        if cfg.data.seq_len % pieces:
            out.append(f"data.seq_len={cfg.data.seq_len} is not divisible by the {pieces} chunks that "
                       f"mesh.context={context_ways} with sharding.context_layout={cfg.sharding.context_layout} "
                       f"cuts a sequence into")
        elif cfg.sharding.sequence_parallel and (cfg.data.seq_len // context_ways) % tensor:
            out.append(f"data.seq_len / mesh.context = {cfg.data.seq_len // context_ways} is not divisible by "
                       f"mesh.tensor={tensor}, which splits each context shard's sequence with "
                       f"sharding.sequence_parallel=true")
        if m.attention == "flash" and (cfg.data.seq_len // context_ways) % FLASH_BLOCK:
            out.append(f"data.seq_len / mesh.context = {cfg.data.seq_len / context_ways:g} is not a multiple of "
                       f"{FLASH_BLOCK}: with model.attention=flash each context shard's queries are whole blocks "
                       f"of the kernel's {FLASH_BLOCK} lanes")
        shard = cfg.data.seq_len // context_ways
        if 0 < m.logits_block < shard and shard % m.logits_block:
            out.append(f"model.logits_block={m.logits_block} does not divide data.seq_len / mesh.context = {shard}, "
                       f"each context shard's positions")
        if m.attention == "flash" and m.context_attention == "ring" and cfg.sharding.context_layout != "zigzag":
            out.append(f"model.context_attention=ring with model.attention=flash needs sharding.context_layout=zigzag "
                       f"(got {cfg.sharding.context_layout}): with contiguous shards a device meets only earlier "
                       f"devices' keys, so half of its passes see none, which splash's kernel grid cannot express")
        if m.attention_block and (cfg.data.seq_len // context_ways) % m.attention_block:
            out.append(f"model.attention_block={m.attention_block} does not divide data.seq_len / mesh.context = "
                       f"{cfg.data.seq_len / context_ways:g}, each context shard's queries")
        if m.context_attention == "ring" and stages > 1 and schedule == "zero_bubble":
            out.append("model.context_attention=ring with pipeline.schedule=zero_bubble: XLA runs the ring's sends "
                       "wrong inside zero-bubble's per-slot conditionals (the loss is off from the first step); use "
                       "model.context_attention=allgather or another schedule")
        if m.num_experts and m.capacity_factor > 0:
            out.append("mesh.context > 1 with model.capacity_factor > 0: capacity ranks a sequence's tokens by "
                       "position, which the context layout reorders; use the dropless routing (capacity_factor 0)")
    experts = m.num_experts
    if axis_sizes["expert"] > 1 and not experts:
        out.append(f"mesh.expert={axis_sizes['expert']} needs a mixture-of-experts model (model.num_experts > 0): "
                   f"the expert axis splits the experts")
    if experts and experts % axis_sizes["expert"]:
        out.append(f"model.num_experts={experts} is not divisible by mesh.expert={axis_sizes['expert']} (with DCN "
                   f"degrees), which splits the experts")
    if experts and moe_d_ff(m) % tensor:
        out.append(f"the experts' hidden width {moe_d_ff(m)} (model.moe_d_ff, else model.d_ff) is not divisible by "
                   f"mesh.tensor={tensor}")
    n = microbatches(cfg, axis_sizes)
    ways = batch_ways(axis_sizes)
    if cfg.train.global_batch % n or (cfg.train.global_batch // n) % ways:
        what = "pipeline.microbatches" if stages > 1 else "train.grad_accum_steps"
        axes = "mesh.data x mesh.fsdp" + " x mesh.expert" * (axis_sizes["expert"] > 1)
        out.append(f"the microbatch train.global_batch / {what} = {cfg.train.global_batch / n:g} is not divisible "
                   f"by {axes} = {ways} (with DCN degrees), which shard the batch")
    return out + _window_problems(cfg, axis_sizes)


def _window_problems(cfg, axis_sizes: Mapping[str, int]) -> list[str]:
    """Sliding-window layers (models/window.py): the runners that do not carry each layer's index, and the splash
    ring, whose passes' masks know no window; soft-capped scores, which no ring caps."""
    m, out = cfg.model, []
    slides = sliding_layers(m.layer_types, m.num_layers)
    schedule = cfg.pipeline.schedule
    if slides.any() and not slides.all() and axis_sizes["pipeline"] > 1 and schedule in pipeline_1f1b.OWN_GRADIENTS:
        out.append(f"model.layer_types='{m.layer_types}' mixes sliding and full layers, with pipeline.schedule="
                   f"{schedule}: its program takes each layer's vjp itself and does not carry the layers' indices "
                   f"(their kinds); use pipeline.schedule=gpipe or circular")
    if axis_sizes["context"] > 1 and m.context_attention == "ring":
        if m.sliding_window and m.attention == "flash":
            out.append("model.sliding_window with model.context_attention=ring and model.attention=flash: the "
                       "splash ring's pass masks know no window; use model.attention=xla (its ring takes the "
                       "window) or model.context_attention=allgather")
        if m.attn_logit_softcap:
            out.append("model.attn_logit_softcap with model.context_attention=ring: the ring's passes do not cap "
                       "their scores; use model.context_attention=allgather")
    return out


def check(cfg, axis_sizes: Mapping[str, int]) -> None:
    """Raises ConfigError with the first of `problems`."""
    found = problems(cfg, axis_sizes)
    if found:
        raise ConfigError(found[0])
