"""The step as the compiler will time it: the plan's estimate of XLA's loop-corrected figure with the flash
kernels added (what `compile` reports and `tune` ranks by), beside the roofline's lower bound.

The roofline (roofline.py) overlaps everything with everything at the chip's peak: a bound, 20-33% under the
compiled step on every candidate `tune` compiled. XLA's cost model instead times each operation at the longer of its
FLOPs and its bytes at what the chip attains (hardware.yaml's xla_*_efficiency), and sums them: the matmuls are
compute-bound and the elementwise passes between them memory-bound, so their times add. The estimate therefore
sums four parts, each counted from the model's code or the state's layout rather than fitted to a compile:
- the matmuls XLA runs (the step's FLOPs, recomputation included, without the flash kernels') at the attainable
  matmul rate;
- the flash kernels at the chip's roofline, as `compile` adds them (XLA counts a Pallas kernel as nothing);
- the memory-bound passes at the attainable bandwidth: per layer, the tensors its backward pass reads (the
  residuals the layer body saves: residuals.per_token) are written by the forward pass, read by the backward
  pass, and their gradients written and read there - four passes over them -, once more where a remat policy
  computes them again; each layer's weights gathered (forward and backward) and its weight gradient written and
  reduced, once per microbatch; a dropless mixture's transport of its routed rows (its gathers and ragged
  all-to-alls, as XLA counts them: transport_bytes); XLA's attention's scores; the float32 logits and their
  gradient; the optimizer's update;
- the collectives of the tensor and expert axes, which the next operation waits for (EXPOSED).
The other axes' collectives overlap all of it, as in the roofline. docs/planner.md has the measured accuracy.
"""

from __future__ import annotations

from typing import Mapping

from scaletrain.facts.hardware import Chip
from scaletrain.parallel.checks import microbatches
from scaletrain.planner import memory, residuals

# Passes over a layer's residuals per step: written forward, read backward, their gradients written and read.
RESIDUAL_PASSES = 4


def recomputed_bytes(cfg, elements: Mapping[str, float], residual: float) -> float:
    """Bytes per token of a layer's residuals the backward pass computes again: all of them under full remat,
    none under none, otherwise all but those the policy keeps (on the device or offloaded) and the layer input."""
    policy = cfg.remat.policy
    if policy == "none":
        return 0.0
    if policy == "full":
        return residual
    ab = memory.DTYPE_BYTES[cfg.model.dtype]
    kept = sum(elements[n] for n in memory.kept(policy, cfg.remat.custom)) + elements["decoder_layer_input"]
    return max(residual - kept * ab, 0.0)


def memory_bound_bytes(cfg, axes: Mapping[str, int], state: memory.State, score_bytes: float,
                       logits_passes: int, chip: Chip, experts_recomputed: bool) -> float:
    """HBM bytes per device and step of the passes no matmul hides (the module's third part). `score_bytes`: XLA
    attention's per step and device (roofline.hbm_bytes); `logits_passes`: the float32 logits' passes; `chip`'s
    transport for expert parallelism (memory.expert_rows) and XLA's counts of it (transport_bytes);
    `experts_recomputed`: whether the remat policy runs a mixture's layer forward again.
    A mixture-of-experts layer's routed rows - dispatched, computed by the grouped matmuls and combined - are
    residuals too (memory.routed_layer, as memory.predict holds them), and pay the same passes: a grouped matmul
    is a kernel XLA fuses nothing into, so the SwiGLU between the experts' matmuls writes and reads its whole
    hidden rows (benchmarks/moe_dispatch.py: Mixtral's block takes 9 ms more than one plain matmul of its rows)."""
    m = cfg.model
    t, ab = axes["tensor"], memory.DTYPE_BYTES[m.dtype]
    ragged = chip.ragged_all_to_all
    stream, inner = residuals.per_token(state.layout.model_cfg)
    routed = memory.moe_share(m) * memory.routed_layer(cfg, axes, ab, ragged) if m.num_experts else 0.0
    residual = stream / (t if cfg.sharding.sequence_parallel else 1) + inner / t + routed
    received = memory.expert_rows(cfg, axes, ragged)[1]
    elements = memory.tensor_elements(m, state.layout.rules.activations, axes, received)
    tokens = memory.replica_tokens(cfg, axes) * microbatches(cfg, axes)
    layers = m.num_layers / axes["pipeline"]
    activations = tokens * layers * (RESIDUAL_PASSES * residual + recomputed_bytes(cfg, elements, residual))
    logits = logits_passes * 4 * tokens * m.vocab_size / t / axes["pipeline"]
    weights = microbatches(cfg, axes) * layers * weight_pass_bytes(cfg, state)
    transport = transport_bytes(cfg, axes, chip, experts_recomputed) * tokens
    return activations + weights + transport + score_bytes + logits + update_bytes(state, layers)


def transport_bytes(cfg, axes: Mapping[str, int], chip: Chip, experts_recomputed: bool) -> float:
    """HBM bytes per token of a device's share of the batch that XLA's cost model counts for moving a dropless
    mixture's routed rows (models/mixtral/moe.py), in every pass over its MoE layers - forward, backward, and the
    forward again where `experts_recomputed`. A pass sorts the rows a device sends by expert and puts them back (two
    gathers; the backward pass's are the permutations' transposes, gathers too); under expert parallelism it sends
    them (a ragged all-to-all into the receive buffer), sorts and unsorts the buffer's rows by local expert (two
    gathers of the buffer) and returns them (an all-to-all the other way). XLA counts a gather at
    `chip.xla_gather_passes` over its table and its rows and an all-to-all at `chip.xla_exchange_passes` over the
    rows sent and the buffer received (benchmarks/xla_cost_model.py): on a v5p 14 passes a gather - GPT-OSS-120B
    on expert 4 compiles to 163 GB of gathers per layer and chip, 28% of its bytes (docs/planner.md). The padded
    transport off a TPU counts its gathers alone."""
    m = cfg.model
    if not m.num_experts or m.capacity_factor:
        return 0.0
    sent, received = memory.expert_rows(cfg, axes, chip.ragged_all_to_all)
    gather = sum(chip.xla_gather_passes)
    rows = 2 * gather * sent
    if axes["expert"] > 1:
        rows += 2 * gather * received
        if chip.ragged_all_to_all:
            rows += sum(chip.xla_exchange_passes) * (sent + received)  # each way: sent rows in, buffer out
    layers = m.num_layers * memory.moe_share(m) / axes["pipeline"]
    return (2 + experts_recomputed) * layers * rows * m.d_model * memory.DTYPE_BYTES[m.dtype]


def update_bytes(state: memory.State, layers: float) -> float:
    """HBM bytes of the optimizer's update on one device, whose stage holds `layers` layers: it reads the
    parameters and gradients and writes the parameters on its shard of the optimizer state, and reads and writes
    both moments."""
    layer_params, outside = state.weights(state.layout.rules.opt_state, trained=True)
    return 3 * (layer_params * layers + outside) + 2 * state.optimizer


def weight_pass_bytes(cfg, state: memory.State) -> float:
    """HBM bytes per layer and microbatch that move a layer's weights outside its matmuls: the weights gathered
    over the batch axes, written by the forward pass's gather and the backward pass's in the compute dtype (where
    the batch axes shard them), and the weight gradient, written whole in the parameters' dtype and read by its
    reduction."""
    gathered = memory.gathered_layer(state)
    gradient = memory.gathered_layer(state, trained=True) or (
        state.weights(state.layout.rules.params, trained=True)[0] * state.mesh.shape["pipeline"])
    gathers = 2 * memory.DTYPE_BYTES[cfg.model.dtype] / memory.DTYPE_BYTES[cfg.model.param_dtype]
    return gradient * 2 + gathered * gathers


# Mesh axes whose collectives carry activations the next operation waits for - tensor parallelism's gathers and
# scatters around each matmul, expert parallelism's dispatch and return: on the step's critical path, not
# overlapped (the 70B at 8192 tokens on fsdp 8 x tensor 8 compiles 3.8 s above the overlapped estimate, its tensor
# collectives planned at 5.0 s). FSDP's and data parallelism's are prefetched or deferred, and overlap.
EXPOSED = ("tensor", "expert", "dcn_tensor", "dcn_expert")


def step(chip: Chip, matmul_flops: float, kernel_seconds: float, memory_bytes: float, bubble: float,
         exposed_seconds: float, comm_seconds: float) -> dict[str, float]:
    """The estimate's parts and total per device: matmuls, kernels, memory-bound passes and the exposed collectives
    (EXPOSED) add, stretched by the pipeline bubble; the busiest other link's collectives overlap them."""
    parts = {"matmul": matmul_flops / (chip.bf16_flops * chip.xla_matmul_efficiency) / (1 - bubble),
             "kernels": kernel_seconds / (1 - bubble),
             "memory": memory_bytes / (chip.hbm_bandwidth * chip.xla_hbm_efficiency) / (1 - bubble),
             "exposed_collectives": exposed_seconds}
    return {**parts, "total": max(sum(parts.values()), comm_seconds)}
