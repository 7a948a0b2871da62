"""The collectives of data parallelism in all its forms (FSDP, ZeRO-1/2, plain data parallelism, over ICI and DCN),
read off the trainer's rule tables rather than preset names: what the roofline (roofline.py) times on each mesh
axis."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from scaletrain import models
from scaletrain.config import MESH_AXES
from scaletrain.parallel import sharding
from scaletrain.planner import comms, memory


def _innermost_first(names) -> list[str]:
    return sorted(names, key=MESH_AXES.index, reverse=True)


def transfers(state: memory.State, layers: int, microbatches: int,
                            levels: Callable[[Sequence[str]], list[comms.Link]]) -> list[comms.Transfer]:
    """The collectives of data parallelism in all its forms, read off the rule tables (sharding.py) rather than
    preset names. With P, G and O the batch axes that shard the parameters, the gradients and the optimizer
    state: per microbatch, each layer's weights all-gathered over P for the forward pass and again for the
    backward (which also serves a remat recomputation; the compiled fsdp=8 step re-gathers in the backward even
    without remat, docs/parallelism.md); the gradients reduce-scattered over G, and all-reduced over the batch
    axes that shard no state - over those that shard only the optimizer state (O - G), all but the last
    microbatch all-reduce and the last reduce-scatters into its layout (the compiled ZeRO-1 step's choice:
    docs/benchmarks.md); after the update, the new weights all-gathered over O - P. So FSDP (P = G = O = fsdp)
    gathers and scatters over fsdp and all-reduces its scattered gradients over data; dp all-reduces over both;
    ZeRO-1 (O = data x fsdp) and ZeRO-2 (G = O = data x fsdp) scatter the gradients and gather the updated
    weights. Weights move one layer at a time inside the scanned stack, the rest (embedding, output projection,
    final norm) once; bytes are one device's tensor shard of each, whole over the axes the collective spans.
    Inside a microbatch the weights travel as their matmuls read them - weight matrices in the compute dtype, or
    int8 / fp8 where model.quantization rounds them (models.operand_dtypes) - and their gradients in the compute
    dtype; what moves once a step (the summed gradients, the updated weights) in the parameter dtype.
    The `context` axis's devices hold other tokens of the same sequences: for the state they are batch axes. The
    `expert` axis is a batch axis too, but the mesh axes of the `experts` dim split the model, as `tensor`
    does: an array split along experts is neither gathered nor reduced over them (each device trains its own
    experts on every token routed to them), and every other array's gradients are all-reduced over them.

    A 1F1B or zero-bubble pipeline (parallel/pipeline_1f1b.py, pipeline_zb.py) sums each device's gradients over
    the step and all-reduces them once over the batch axes that shard no parameter; with
    pipeline.gather_weights=once over every batch axis, the weights then gathered once on the way in."""
    rules = state.layout.rules
    runner = state.layout.runner
    batch = set(sharding.mesh_axes(rules.activations["batch"])) | set(sharding.mesh_axes(rules.activations["seq"]))
    experts = set(sharding.mesh_axes(rules.params.get("experts")))

    def over(table: sharding.RuleTable) -> set[str]:
        return {a for name, entry in table.items() if name != "experts" for a in sharding.mesh_axes(entry)} & batch

    operands = models.operand_dtypes(state.layout.model_cfg)
    cotangents = models.operand_dtypes(state.layout.model_cfg, quantized=False)

    def moves(table, axes_: set[str], kind: str, what: str, count: int,
              of_experts: bool | None = None, dtypes: Any = None) -> list[comms.Transfer]:
        if not axes_:
            return []
        names = _innermost_first(axes_)
        # Gradients, and the weights an update writes, are the trained parameters' alone (not LoRA's base).
        trained = table is rules.grads or what == "updated weights"
        layer, rest = state.weights(table, names, of_experts, dtypes, trained=trained)
        if not layer + rest:  # no array of the kind `of_experts` asks for
            return []
        return (comms.collective(kind, f"layer {what}", layer, layers * count, levels(names))
                + comms.collective(kind, f"embedding and output {what}", rest, count, levels(names)))

    p, g, o = over(rules.params), over(rules.grads), over(rules.opt_state)
    if runner.gather_once:
        return (moves(rules.params, p, "all-gather", "weights, once a step", 1)
                + moves(rules.grads, batch, "all-reduce", "gradients, once a step", 1)
                + moves(rules.params, o - p, "all-gather", "updated weights", 1))
    if runner.forms_gradients:
        return (moves(rules.params, p, "all-gather", "weights, forward", microbatches, dtypes=operands)
                + moves(rules.params, p, "all-gather", "weights, backward", microbatches, dtypes=operands)
                + moves(rules.grads, g, "reduce-scatter", "gradients", microbatches, dtypes=cotangents)
                + moves(rules.grads, batch - p, "all-reduce", "gradients, once a step", 1)
                + moves(rules.params, o - p, "all-gather", "updated weights", 1))
    return (moves(rules.params, p, "all-gather", "weights, forward", microbatches, dtypes=operands)
            + moves(rules.params, p, "all-gather", "weights, backward", microbatches, dtypes=operands)
            + moves(rules.grads, g, "reduce-scatter", "gradients", microbatches, dtypes=cotangents)
            + moves(rules.grads, batch - g - o, "all-reduce", "gradients", microbatches, of_experts=False,
                    dtypes=cotangents)
            + moves(rules.grads, batch - g - o - experts, "all-reduce", "experts' gradients", microbatches,
                    of_experts=True, dtypes=cotangents)
            + moves(rules.grads, o - g, "all-reduce", "gradients", microbatches - 1, dtypes=cotangents)
            + moves(rules.grads, o - g, "reduce-scatter", "gradients", 1, dtypes=cotangents)
            + moves(rules.params, o - p, "all-gather", "updated weights", 1))


