"""The analytic planner: a train step's FLOPs, memory, communication and roofline time for a config on a machine
that need not exist, with no compile - the scaling book's method ("How to Scale Your Model"; docs/planner.md).

`plan(cfg, "v5p:4x4x4")` returns the `plan` command's keys (docs/planner.md) and the terms behind them;
`format_table` prints it.
The step time is a lower bound: the longest of compute (model FLOPs plus remat recomputation, stretched by the
pipeline bubble), HBM traffic, and the busiest mesh axis's collectives on ICI and on DCN, each assumed to overlap
the others perfectly. The step estimate (estimate.py) is what the compiler will report: the matmuls, kernels and
memory-bound passes summed at what the chip attains. docs/planner.md states every formula and what is not
modelled.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from typing import Mapping, Sequence

from scaletrain import models
from scaletrain.config import MESH_AXES
from scaletrain.facts import flops
from scaletrain.facts import hardware as hw
from scaletrain.kernels import flash_attention
from scaletrain.models.family import Matmul
from scaletrain.parallel import checks, pipeline_zb, sharding
from scaletrain.parallel import mesh as mesh_lib
from scaletrain.parallel.checks import microbatches
from scaletrain.planner import comms, data_parallel, estimate, memory, precision, schedule
from scaletrain.planner.thresholds import critical_batches, fsdp_tensor_split
from scaletrain.train import objective as objective_lib
from scaletrain.train.loss import projects_the_stream
from scaletrain.train.runner import Runner, choose

GB = 1e9
TIMELINE_TICKS = 32  # the longest pipeline timeline the table prints
_QKV = {"query_proj", "key_proj", "value_proj"}


def resolve_mesh(mesh_cfg, topo: hw.Topology) -> mesh_lib.MeshShape:
    """mesh.resolve for a machine that is described rather than attached: DCN degrees fill the slices, ICI degrees
    one slice's chips (-1 fills, at most one of each). Raises ConfigError."""
    dcn = mesh_lib._fill({a: int(mesh_cfg[f"dcn_{a}"]) for a in MESH_AXES}, topo.slices, "DCN", "mesh.dcn_")
    ici = mesh_lib._fill({a: int(mesh_cfg[a]) for a in MESH_AXES}, topo.chips_per_slice, "ICI", "mesh.")
    return mesh_lib.MeshShape(ici=ici, dcn=dcn)


def matmuls(m, tensor: int = 1, expert: int = 1) -> dict[str, Matmul]:
    """A layer's projections on one device, by matmul group: the inventory of the config's model family
    (models/<family>/: Family.matmuls). Megatron splits Q/K/V and gate/up by their outputs, the output and down
    projections by their inputs; a mixture of experts' router and experts (mixtral's). Only the groups the stack
    has."""
    return models.family_of(m).matmuls(m, tensor, expert)


def forward_flops(m, seq_len: int, tensor: int = 1) -> dict[str, float]:
    """Forward FLOPs per token of one layer on one device, averaged over the stack, by matmul group (`matmuls`),
    and causal attention as flops.py counts it (its training FLOPs are 3x the forward's)."""
    out = {group: matmul.flops for group, matmul in matmuls(m, tensor).items()}
    out["attention"] = flops.attention_flops_per_token(m, seq_len) / (3 * m.num_layers * tensor)
    return out


# Attention's executed FLOPs as multiples of its causal forward (flops.py's two matmuls over the unmasked half),
# (forward, backward): XLA's attention, blocked or not, computes every key, masked or not, and its backward
# four matmuls; the flash kernels skip fully masked blocks (computing the diagonal ones whole) and their
# backward recomputes the scores, five matmuls.
ATTENTION_PASSES = {"xla": (2.0, 4.0), "flash": (1.0, 2.5)}


def attention_pass(cfg, chip: str | None = None) -> float:
    """One forward pass of attention as executed, in causal forwards: 2 for XLA (times the full layers' keys over
    those a sliding window leaves: XLA computes every key, masked or not); for flash 1 + (a key block)/T, the
    diagonal blocks computed whole (the kernel's blocks on `chip`, kernels/flash_attention.py) - with a sliding
    window the band's other edge adds about as much again, not counted."""
    if cfg.model.attention == "xla":
        m, seq = cfg.model, cfg.data.seq_len
        return ATTENTION_PASSES["xla"][0] * m.num_layers * seq / 2 / flops.attention_keys(m, seq)
    _, _, block_kv = flash_attention.splash_blocks(cfg.data.seq_len, flash_attention.splash_for(chip))
    return 1.0 + block_kv / cfg.data.seq_len


def attention_extra_flops(cfg, chip: str | None = None) -> float:
    """Training FLOPs per token of attention beyond its model FLOPs (3 causal forwards) and any remat: XLA's
    masked half; the flash backward's recomputed scores and the diagonal blocks."""
    fwd, bwd = ATTENTION_PASSES[cfg.model.attention]
    scale = attention_pass(cfg, chip) / fwd
    causal = forward_flops(cfg.model, cfg.data.seq_len)["attention"] * cfg.model.num_layers
    return ((fwd + bwd) * scale - 3) * causal


# The matmul groups of a mixture's routed experts (the families' `matmuls`).
EXPERT_GROUPS = ("expert_gate_up", "expert_down")


def buffer_flops(cfg, axes: Mapping[str, int], forward: Mapping[str, float], recompute: frozenset[str],
                 ragged: bool) -> float:
    """Training FLOPs per token that XLA's estimate counts for the experts' grouped matmuls beyond their routed
    rows': both grouped matmuls (XLA's ragged dot and megablox's kernels) declare their cost for their whole
    input, and under dropless expert parallelism that is the receive buffer (memory.expert_rows' received rows
    per token: 64 at k 8 on expert 8), of which the device's routed rows fill k (kernels/grouped_matmul.py). The
    forward pass (`forward`: forward_flops'), both backward matmuls and the recomputation where the policy
    recomputes them; the roofline counts the routed rows, what the chip computes where the kernel skips the empty
    ones."""
    m = cfg.model
    if not m.num_experts or m.capacity_factor:
        return 0.0
    beyond = memory.expert_rows(cfg, axes, ragged)[1] / m.experts_per_token - 1
    return beyond * m.num_layers * sum(forward[g] * (3 + (g in recompute)) for g in EXPERT_GROUPS if g in forward)


def flash_kernel_cost(cfg, axes: Mapping[str, int], chip: str) -> dict[str, float]:
    """FLOPs and HBM bytes per device and step of the flash kernels alone (the compile command adds them to XLA's
    estimate, which counts a Pallas kernel as nothing): every forward pass (the remat policy's recompute too) and
    the backward. Each reads Q once and K/V once per query block (the causal half of them), and writes its
    output; the backward reads the output gradient as well and writes three gradients."""
    m, seq = cfg.model, cfg.data.seq_len
    t = axes["tensor"]
    forwards = 1 + ("attention" in recomputed(cfg, choose(cfg, axes)))
    fwd, bwd = ATTENTION_PASSES["flash"]
    causal = forward_flops(m, seq, t)["attention"] * m.num_layers
    tokens = memory.replica_tokens(cfg, axes) * microbatches(cfg, axes) / axes["pipeline"]
    flops_ = tokens * causal * (forwards * fwd + bwd) * attention_pass(cfg, chip) / fwd
    padded, block_q, _ = flash_attention.splash_blocks(seq, flash_attention.splash_for(chip))
    q_blocks = padded / block_q
    e = memory.tensor_elements(m, memory.activation_rules(cfg, axes, sequence_parallel=False), axes)
    q, kv = e["query_proj"], e["key_proj"] + e["value_proj"]
    per_pass = q + kv * (q_blocks + 1) / 2 + q  # Q, K/V per query block, the output
    bytes_ = tokens * m.num_layers * memory.DTYPE_BYTES[m.dtype] * (forwards * per_pass + 2 * per_pass + 2 * q)
    return {"flops": flops_, "bytes": bytes_}


def recomputed(cfg, runner: Runner | None = None) -> frozenset[str]:
    """Matmul groups the backward pass computes a second time. Attention always - its probabilities are never
    kept - except under policy none without query blocking (blocked attention rematerialises each block
    itself); a projection when its output is not kept: Q/K/V (attention needs them again), the output projection
    (the feed-forward's weight gradients read the mid-block sum), gate/up (the MLP's backward); never the down
    projection, whose output nothing in the backward pass reads (jax leaves it out of the recomputation). A
    mixture of experts' layer is another matter: the gradients of its routing weights read the experts' outputs
    and the router's probabilities, neither of them named, so its experts' down projection and its router are
    computed again under every policy but none (save_dots keeps the router's logits, a dot without batch dims),
    and its experts' gate/up unless `moe_gate` and `moe_up` are kept (save_dots does not keep them: a grouped
    matmul is no dot). Only the groups the stack has, under the policy whose work the stack runner `runner` does
    (Runner.remat_policy: 1F1B full's, zero-bubble none's, whatever the config's)."""
    policy = runner.remat_policy(cfg.remat.policy) if runner is not None else cfg.remat.policy
    if policy == "none":
        return frozenset({"attention"} if memory.blocked_attention(cfg) else ())
    kept = memory.kept(policy, cfg.remat.custom).keys()
    groups = ({"attention", "expert_down"} | ({"qkv"} if not _QKV <= kept else set())
              | ({"out"} if "out_proj" not in kept else set())
              | ({"gate_up"} if not {"mlp_gate", "mlp_up"} <= kept else set())
              | ({"expert_gate_up"} if not {"moe_gate", "moe_up"} <= kept else set())
              | ({"router"} if policy != "save_dots" else set()))
    return frozenset(groups & {"attention", *matmuls(cfg.model)})


def recomputed_logits(cfg) -> bool:
    """model.logits_block: the backward pass runs the output projection of each block again - unless the loss
    forms each block's gradient in the forward pass (loss.projects_the_stream)."""
    return memory.logits_blocked(cfg) and not projects_the_stream(cfg.model)


# HBM bytes per attention score (one query, key and head, per layer and step) of XLA's attention, all passes: read
# off the compiled Llama-3.1-8B step on v5p:4x4x2 (full remat, 512-query blocks): 22.6 TB accessed per chip with
# `xla`, 2.4 TB with `flash` (the rest of the step), over 2.75e11 scores per chip. The flash kernels keep scores
# on-chip: none.
XLA_SCORE_BYTES = 73


def hbm_bytes(cfg, axes: Mapping[str, int], recompute: frozenset[str], state: memory.State) -> float:
    """HBM traffic of one device per step. Each projection reads its input and weights and writes its output
    (scaling.md: 2BD + 2DF + 2BF bytes in bf16; an expert projection reads every expert the device holds, for k
    rows per token: `matmuls`) once forward, twice backward (input and weight gradients) and
    once more when recomputed; attention reads Q, K, V and writes its output per pass, and XLA's attention moves
    its scores (XLA_SCORE_BYTES each); the output projection writes float32 logits (twice when model.logits_block
    recomputes them), the loss reads them and writes their gradient; the optimizer reads parameters and gradients
    and writes parameters, on its shard of the state, and reads and writes both moments (`state`'s bytes)."""
    m = cfg.model
    t, stages = axes["tensor"], axes["pipeline"]
    ab = memory.DTYPE_BYTES[m.dtype]
    tokens = memory.replica_tokens(cfg, axes)
    reference = objective_lib.runs_reference(cfg)
    passes = flops.passes(state.layout.model_cfg, reference)  # 3: forward and both gradients (flops.py)
    layer = sum((passes + (g in recompute)) * matmul.hbm_bytes(tokens, ab)
                for g, matmul in matmuls(m, t, axes["expert"]).items())
    elements = memory.tensor_elements(m, memory.activation_rules(cfg, axes, sequence_parallel=False), axes)
    qkvo = 2 * elements["query_proj"] + 2 * elements["key_proj"]
    layer += (3 + reference + ("attention" in recompute)) * ab * tokens * qkvo
    layer += xla_score_bytes(cfg, tokens, t) * (1 + reference / 3)
    vocab = m.vocab_size / t
    head = ((passes + recomputed_logits(cfg)) * ab * (tokens * m.d_model + m.d_model * vocab)
            + (logits_passes(cfg) + 2 * reference) * 4 * tokens * vocab)
    update = estimate.update_bytes(state, m.num_layers / stages)
    return microbatches(cfg, axes) * (layer * m.num_layers + head) / stages + update


def xla_score_bytes(cfg, tokens: float, tensor: int) -> float:
    """HBM bytes of XLA's attention scores per layer for `tokens` tokens (none with the flash kernels)."""
    m = cfg.model
    return XLA_SCORE_BYTES * tokens * m.num_heads / tensor * cfg.data.seq_len if m.attention == "xla" else 0.0


def logits_passes(cfg) -> int:
    """Passes over the float32 logits per step: written by the output projection (again where it is recomputed)
    and by the backward pass's, read by the loss, its gradient written and read."""
    return 3 + recomputed_logits(cfg) + 2


def step_transfers(cfg, axes: Mapping[str, int], links: Mapping[str, list[comms.Link]],
                   recompute: frozenset[str], state: memory.State, ragged: bool = True,
                   ring_pass: float = 0.0) -> list[comms.Transfer]:
    """Every collective of one train step: data parallelism as the rule tables shard the state
    (`data_parallel_transfers`), then tensor, context, pipeline and expert parallelism (comms.py). `ragged`: the MoE
    layers' rows travel by ragged all-to-all (TPU), else padded (memory.expert_rows). `ring_pass`: the seconds of
    one pass of context parallelism's ring (a device's queries against one device's keys)."""
    m = cfg.model
    ab, accum, t, shards = memory.DTYPE_BYTES[m.dtype], microbatches(cfg, axes), axes["tensor"], axes["expert"]
    layers = math.ceil(m.num_layers / axes["pipeline"])
    moe_layers = state.layout.model_cfg.moe_layers

    def levels(names: Sequence[str]) -> list[comms.Link]:
        return [links[a][0] for a in names] + [links[a][1] for a in names]

    activations = memory.replica_tokens(cfg, axes) * m.d_model * ab
    sp = cfg.sharding.sequence_parallel
    routed = memory.expert_rows(cfg, axes, ragged)[0] * activations * shards
    dropless = not m.capacity_factor
    counts = shards * m.num_experts * 4 if dropless else 0  # int32 assignments per expert, from every device
    kv = memory.sequence_kv(memory.tensor_elements(m, state.layout.rules.activations, axes), axes)
    kv *= memory.replica_tokens(cfg, axes) * ab  # context parallelism's V: its rows' whole sequences' K/V
    return (data_parallel.transfers(state, layers, accum, levels)
            + comms.tensor(activations, layers, accum, sp, recompute, levels(["tensor"]), moe_layers)
            + comms.context(kv, layers, accum, "attention" in recompute and cfg.remat.policy != "none",
                            levels(["context"]), memory.ring_attention(cfg, axes) and ab, ring_pass)
            + comms.pipeline(activations / (t if sp else 1), accum, *state.layout.runner.sends(),
                             levels(["pipeline"]))
            + comms.expert(routed, counts, moe_layers, accum, "expert_down" in recompute, levels(["expert"]),
                           "ragged-all-to-all" if ragged and dropless else "all-to-all"))


def refusals(cfg, axes: Mapping[str, int], state: memory.State) -> list[str]:
    """What the trainer would refuse about this mesh: its own checks (checks.problems), then its placement
    of the state (sharding.tree_shardings' divisibility)."""
    return checks.problems(cfg, axes) + ([state.refused] if state.refused else [])


def _warnings(cfg, axes: Mapping[str, int], mem: memory.Prediction, topo: hw.Topology, refused: list[str],
              bubble: float) -> list[str]:
    """What the trainer would refuse and what makes the plan less than it seems; the plan is made regardless."""
    out = [f"the trainer refuses this mesh: {problem}" for problem in refused]
    stages, n = axes["pipeline"], microbatches(cfg, axes)
    micro = cfg.train.global_batch / n
    if micro % sharding.batch_ways(axes):
        out.append("planned with the book's sequence sharding (token-level data parallelism)")
    if mem.total > topo.chip.hbm_bytes:
        out.append(f"does not fit: {mem.total / GB:.1f} GB per device of {topo.chip.hbm_bytes / GB:.0f} GB HBM")
    # A circular schedule with repeats is refused for it already (checks.problems).
    circular = cfg.pipeline.schedule == "circular" and cfg.pipeline.repeats > 1
    if 1 < stages and n < stages and not circular:
        out.append(f"pipeline.microbatches={n} is fewer than mesh.pipeline={stages} stages: at most {n} of the "
                   f"{stages} stages work at once and the bubble is {100 * bubble:.0f}% of the step; expected "
                   f"pipeline.microbatches >= {stages} (several times it keeps the bubble small)")
    rental = hw.rental_note(topo)
    return out + ([rental] if rental else [])


def plan(cfg, hardware: str, dcn_bandwidth: float | None = None) -> dict:
    """The analytic prediction for config `cfg` (scaletrain.config.load) on `hardware` (`[Sx]CHIP:DIMS`, e.g.
    v5p:4x4x4): the `plan` command's keys, the terms behind them, scaling.md's critical batch sizes and the FSDP x
    tensor split the book recommends. Plain JSON types. Raises ConfigError for an unknown chip, a malformed
    topology, or mesh degrees that do not multiply to its chips. `dcn_bandwidth`: bytes/s per chip across the
    slices in place of the chip's (what-if: planner/slices.py)."""
    topo = hw.topology(hardware)
    if dcn_bandwidth is not None:
        topo = replace(topo, chip=replace(topo.chip, dcn_bandwidth=dcn_bandwidth))
    chip, m = topo.chip, cfg.model
    shape = resolve_mesh(cfg.mesh, topo)
    axes = {a: shape.ici[a] * shape.dcn[a] for a in MESH_AXES}
    links = comms.links(topo, shape.ici, shape.dcn)
    state = memory.state(cfg, axes)
    runner = state.layout.runner
    recompute = recomputed(cfg, runner)
    count = flops.param_count(state.layout.model_cfg)

    tokens = cfg.train.global_batch * cfg.data.seq_len
    reference = objective_lib.runs_reference(cfg)
    per_token = flops.flops_per_token(state.layout.model_cfg, cfg.data.seq_len, reference)
    step_flops = per_token * tokens
    forward = forward_flops(m, cfg.data.seq_len)
    forward["attention"] *= attention_pass(cfg, chip.name)  # as executed
    # GPipe and circular under a remat policy, 1F1B keeping stage inputs, run each stage's forward again from its
    # kept input, then the layers' recomputation: one more forward of every layer (Llama-2-70B on two v5p slices
    # compiled to 1.57x data parallelism's FLOPs with 1F1B so: 5/4, over the 20% bubble).
    stage_forward = m.num_layers * sum(forward.values()) if runner.reruns_stages(cfg.remat.policy) else 0.0
    recompute_flops = tokens * (m.num_layers * sum(forward[g] for g in recompute) + stage_forward
                                + recomputed_logits(cfg) * 2 * m.d_model * m.vocab_size)
    extra_flops = tokens * attention_extra_flops(cfg, chip.name)
    bubble = schedule.bubble(runner, cfg, chip.name)
    ragged = chip.ragged_all_to_all
    ring_pass = forward["attention"] * memory.replica_tokens(cfg, axes) / (
        axes["tensor"] * sharding.seq_ways(axes) * chip.bf16_flops * chip.xla_matmul_efficiency)
    transfers = step_transfers(cfg, axes, links, recompute, state, ragged, ring_pass)
    sent, seconds = comms.by_axis(transfers)
    hbm = hbm_bytes(cfg, axes, recompute, state)
    # Every chip has its share of the work: the expert axis splits the batch (each device routes its own tokens).
    low = tokens * precision.quantized_flops(cfg, forward_flops(m, cfg.data.seq_len), recompute,
                                             recomputed_logits(cfg), flops.passes(state.layout.model_cfg, reference))
    times = {"compute": ((step_flops + recompute_flops + extra_flops - low) / chip.bf16_flops
                         + low / chip.matmul_peak(m.quantization))
             / topo.num_chips / (1 - bubble),
             "hbm": hbm / chip.hbm_bandwidth,
             "ici": max(seconds[a] for a in MESH_AXES),
             "dcn": max(seconds[f"dcn_{a}"] for a in MESH_AXES)}
    bound = max(times, key=times.get)
    step_time = times[bound]
    kernels = flash_kernel_cost(cfg, axes, chip.name) if m.attention == "flash" and chip.torus_dims else None
    executed = (step_flops + recompute_flops + extra_flops
                + tokens * buffer_flops(cfg, axes, forward, recompute, ragged)) / topo.num_chips
    scores = xla_score_bytes(cfg, memory.replica_tokens(cfg, axes) * microbatches(cfg, axes), axes["tensor"])
    estimated = estimate.step(
        chip, matmul_flops=executed - (kernels["flops"] if kernels else 0.0),
        kernel_seconds=max(kernels["flops"] / chip.bf16_flops, kernels["bytes"] / chip.hbm_bandwidth) if kernels
        else 0.0,
        memory_bytes=estimate.memory_bound_bytes(cfg, axes, state, scores * m.num_layers / axes["pipeline"],
                                                 logits_passes(cfg), chip, "expert_down" in recompute),
        bubble=bubble, exposed_seconds=sum(seconds[a] for a in estimate.EXPOSED) + sum(t.exposed for t in transfers),
        comm_seconds=max(v for a, v in seconds.items() if a not in estimate.EXPOSED))
    mem = memory.predict(cfg, axes, state, ragged)
    detail = mem.as_dict()
    refused = refusals(cfg, axes, state)
    return {
        "hardware": str(topo), "chip": chip.name, "chips": topo.num_chips, "slices": topo.slices,
        "torus": list(topo.dims), "wraparound": list(topo.wraps),
        "mesh": {"ici": dict(shape.ici), "dcn": dict(shape.dcn), "sizes": axes},
        "layout": {a: {"physical_axes": list(links[a][0].parts), "wraparound": list(links[a][0].wraps),
                       "switch": links[a][0].switch, "bandwidth": links[a][0].bandwidth}
                   for a in MESH_AXES if links[a][0].size > 1},
        "params": count.total,
        "active_params": count.active,
        "flops_per_token": per_token,
        "attention_flops_per_token": flops.attention_flops_per_token(m, cfg.data.seq_len) * (3 + reference) / 3,
        "tokens_per_step": tokens,
        "tokens_per_chip": tokens / topo.num_chips,
        "tokens_per_replica": memory.replica_tokens(cfg, axes),
        "step_flops": step_flops,
        "recompute_flops": recompute_flops,
        "quantized_flops": low,
        "attention": m.attention,
        "attention_extra_flops": extra_flops,
        "recomputed": sorted(recompute | ({"logits"} if recomputed_logits(cfg) else set())
                             | ({"stage"} if stage_forward else set())),
        "step_time_s": step_time,
        "bound": bound,
        "time_s": times,
        "step_estimate_s": estimated["total"],
        "estimate_s": estimated,
        "pipeline_bubble": bubble,
        "pipeline": schedule.timeline(state.layout.runner, bubble),
        "tokens_per_second": tokens / step_time,
        "mfu_upper_bound": step_flops / (topo.num_chips * step_time * chip.mixed_peak(
            m.quantization, flops.quantized_share(state.layout.model_cfg, cfg.data.seq_len, reference))),
        "memory_per_device_bytes": {k: detail[k] for k in ("params", "optimizer", "gradients", "activations",
                                                           "total")},
        "memory_detail_bytes": detail,
        "hbm_capacity_bytes": chip.hbm_bytes,
        "fits": mem.total <= chip.hbm_bytes,
        "hbm_traffic_bytes": hbm,
        "comm_bytes_per_device": sent,
        "comm_time_s": seconds,
        "collectives": [asdict(t) for t in transfers],
        "alpha": chip.bf16_flops / chip.ici_bandwidth_bidi,
        "critical_batch": critical_batches(cfg, topo, axes, links),
        "fsdp_tensor_split": fsdp_tensor_split(cfg, topo),
        "refusals": refused,
        "warnings": _warnings(cfg, axes, mem, topo, refused, bubble),
    }


def _si(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def _binary(x: float) -> str:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def _seconds(x: float) -> str:
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def format_table(result: dict) -> str:
    """A plan for humans: the machine and mesh, the roofline terms, memory, communication, the book's thresholds."""
    r = result
    mesh = " x ".join(f"{a}={n}" for a, n in r["mesh"]["sizes"].items() if n > 1) or "1 device"
    layout = "; ".join(f"{a} over {'memory' if r['chip'] == 'cpu' else 'NVLink'}" if v["switch"] else
                       f"{a} on torus axes {'x'.join(map(str, v['physical_axes']))}"
                       f"{'' if all(v['wraparound']) else ' (not all wrapped)'}" for a, v in r["layout"].items())
    active = f" ({_si(r['active_params'])} active per token)" if r["active_params"] != r["params"] else ""
    lines = [f"{_si(r['params'])} parameters{active} on {r['hardware']}: {r['chips']} x {r['chip']}, "
             f"{r['slices']} slice{'s' if r['slices'] > 1 else ''}; mesh {mesh}" + (f" ({layout})" if layout else ""),
             f"batch {r['tokens_per_step']:,} tokens per step: {r['tokens_per_chip']:.0f} per chip, "
             f"{r['tokens_per_replica']:.0f} per data-parallel replica and microbatch",
             f"{_si(r['flops_per_token'], 'FLOP')} per token, {_si(r['step_flops'], 'FLOP')} per step (model FLOPs), "
             f"+{_si(r['recompute_flops'], 'FLOP')} recomputed ({', '.join(r['recomputed']) or 'nothing'}), "
             f"+{_si(r['attention_extra_flops'], 'FLOP')} more executed by {r['attention']} attention",
             "",
             f"step time >= {_seconds(r['step_time_s'])} ({r['bound']}-bound), {_si(r['tokens_per_second'])} "
             f"tokens/s, MFU <= {100 * r['mfu_upper_bound']:.1f}%"]
    lines += [f"  {k:<8}{_seconds(v):>12}" for k, v in r["time_s"].items()]
    if r["pipeline_bubble"]:
        lines.append(f"  (compute includes a pipeline bubble of {100 * r['pipeline_bubble']:.1f}%)")
    e = r["estimate_s"]
    kernels = f" + kernels {_seconds(e['kernels'])}" if e["kernels"] else ""
    exposed = f" + exposed collectives {_seconds(e['exposed_collectives'])}" if e["exposed_collectives"] else ""
    lines.append(f"step as XLA will estimate it ~ {_seconds(r['step_estimate_s'])}: matmuls {_seconds(e['matmul'])}"
                 f"{kernels} + memory-bound passes {_seconds(e['memory'])}{exposed}")
    if r["pipeline"]:
        p = r["pipeline"]
        repeats = f" x {p['repeats']} repeats" if p["repeats"] > 1 else ""
        zb = " - its input gradient; W: its weight gradient" if p["schedule"] == pipeline_zb.SCHEDULE else ""
        lines += ["", f"pipeline: {p['schedule']}, {p['stages']} stages x {p['microbatches']} microbatches{repeats} "
                      f"(F: forward, B: backward of a microbatch{zb}{'; .r its repeat' if repeats else ''}; .: bubble)"]
        ticks = len(p["timeline"][0])
        if ticks <= TIMELINE_TICKS:
            width = max(len(c) for row in p["timeline"] for c in row)
            lines += [f"  stage {s:<3}" + " ".join(f"{c:>{width}}" for c in row)
                      for s, row in enumerate(p["timeline"])]
        else:
            lines.append(f"  {ticks} ticks: the timeline is in the JSON (--json)")
    detail = r["memory_detail_bytes"]
    lines += ["", f"memory per device, of {_binary(r['hbm_capacity_bytes'])} HBM: "
              + ("fits" if r["fits"] else "DOES NOT FIT")]
    lines += [f"  {k:<12}{_binary(v):>12}" for k, v in r["memory_per_device_bytes"].items()]
    lines.append(f"  (activations: saved {_binary(detail['saved_activations'])}, one layer rematerialised "
                 f"{_binary(detail['layer_working_set'])}, float32 logits {_binary(detail['logits'])})")
    if detail["host_total"]:
        lines.append(f"  host (pinned) {_binary(detail['host_total'])}")
    lines += ["", "communication per device per step:"]
    lines += [f"  {a:<14}{_si(b, 'B'):>10}{_seconds(r['comm_time_s'][a]):>12}"
              for a, b in r["comm_bytes_per_device"].items() if b]
    if not any(r["comm_bytes_per_device"].values()):
        lines.append("  none")
    lines += ["", f"compute-bound conditions (alpha = C / W_ici = {r['alpha']:.0f}):"]
    lines += [f"  {name:<14}{c['rule']}: {c['value']:.4g} vs {c['threshold']:.4g} - {'met' if c['met'] else 'NOT met'}"
              for name, c in r["critical_batch"].items()]
    s = r["fsdp_tensor_split"]
    lines.append(f"FSDP x tensor: X_opt = sqrt((B/F)(M_X/M_Y)N) = {s['x_opt']:.0f} (M_X={s['m_x']}, M_Y={s['m_y']}) "
                 f"-> fsdp={s['fsdp']} x tensor={s['tensor']}")
    lines += ["", *(f"warning: {w}" for w in r["warnings"])] if r["warnings"] else []
    return "\n".join(lines)
