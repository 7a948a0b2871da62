"""The questions asked before renting a pod: how long (and how many chip-hours) a run of N tokens takes, and the
fewest chips it fits on (`plan --tokens N [--mfu M]`; docs/planner.md).

Both rest on the plan itself: the FLOPs are flops.py's, the step time the roofline's, and "fits" means the
planner's per-chip memory (the trainer's own state layout, layout.py) within the chip's HBM on a mesh the trainer
accepts (parallelism.py).
"""

from __future__ import annotations

import math
from typing import Iterator

from scaletrain.config import MESH_AXES
from scaletrain.errors import ConfigError
from scaletrain.facts import hardware as hw
from scaletrain.planner import memory, roofline

DAY_S = 86400.0
# GPU clusters planned by min_chips: up to one node, then whole nodes, up to this many.
MAX_GPU_NODES = 4096


def training(cfg, result: dict, tokens: float, mfu: float | None = None) -> dict:
    """A run of `tokens` tokens on the plan's machine: its model FLOPs (flops.py: 6 per multiplied weight and
    token - the book's 6ND - plus causal attention, which the book leaves out), and its days and chip-hours at
    model FLOPs utilisation `mfu`, or at the plan's predicted step time when None. Says whether `mfu` exceeds
    what the plan predicts the mesh can reach, and whether the trainer would refuse the mesh at all."""
    total = result["flops_per_token"] * tokens
    matmul = total - result["attention_flops_per_token"] * tokens
    bound = result["mfu_upper_bound"]
    used = bound if mfu is None else mfu
    peak = result["step_flops"] / (result["step_time_s"] * bound)  # all chips' FLOP/s
    seconds = total / (peak * used)
    return {"tokens": tokens, "total_flops": total, "matmul_flops": matmul, "attention_flops": total - matmul,
            "steps": math.ceil(tokens / result["tokens_per_step"]), "mfu": used,
            "mfu_source": "given" if mfu is not None else "predicted step time",
            "mfu_upper_bound": bound, "mfu_above_bound": used > bound,
            "days": seconds / DAY_S, "chip_hours": seconds / 3600.0 * result["chips"],
            "hardware": result["hardware"], "chips": result["chips"], "mesh_refused": bool(result["refusals"]),
            "fits": result["fits"]}


def on_fewest_chips(cfg, chips: dict, tokens: float, mfu: float | None = None) -> dict | None:
    """`training` on the slice `min_chips` found, with the mesh it found there (the config's, one degree filling
    the slice): at the given MFU, or at that slice's own predicted step time. None when no slice fits."""
    if chips["min_chips"] is None:
        return None
    filled = cfg.copy_and_resolve_references()
    for key, degree in _filling(cfg, hw.topology(chips["hardware"]).chip.is_gpu).items():
        filled.mesh[key] = degree
    return training(filled, roofline.plan(filled, chips["hardware"]), tokens, mfu)


def warnings(training_: dict, result: dict) -> list[str]:
    """The plan's warnings about its own budget: an assumed MFU above the one the plan predicts at most."""
    t = training_
    if not t["mfu_above_bound"]:
        return []
    slower = t["mfu"] / t["mfu_upper_bound"]
    return [f"--mfu {t['mfu']:g} is above this plan's predicted bound of {100 * t['mfu_upper_bound']:.1f}% MFU (its "
            f"step, {result['bound']}-bound, takes at least {result['step_time_s']:.3g} s): the days and chip-hours "
            f"assume what the plan says this mesh cannot reach; at the bound they are {t['days'] * slower:.3g} days, "
            f"{t['chip_hours'] * slower:.3g} chip-hours"]


def _candidates(topo: hw.Topology) -> Iterator[str]:
    """Slices of the topology's chip that exist, smallest first, as `hardware` strings with its slice count:
    Cloud TPU's accelerator types; GPUs up to a node, then whole nodes."""
    chip = topo.chip
    if chip.is_gpu:
        per_node = chip.chips_per_host
        counts = [n for n in (1, 2, 4) if n < per_node] + [per_node * k for k in range(1, MAX_GPU_NODES + 1)]
        yield from (f"{chip.name}:{n}" for n in counts)
        return
    if chip.name in hw.cloud_tpus():  # else hardware.yaml lists no slices of it: no candidates
        yield from (s.hardware(topo.slices) for s in hw.cloud_slices(chip.name))


def _filling(cfg, gpu: bool) -> dict:
    """The config's mesh with one ICI degree left to fill each candidate slice: the one set to -1, else fsdp; on
    GPUs, whose candidates vary in nodes, one DCN degree too: the one set to -1, else dcn_data."""
    mesh = cfg.mesh.to_dict()
    mesh[next((a for a in MESH_AXES if mesh[a] == -1), "fsdp")] = -1
    if gpu:
        mesh[next((f"dcn_{a}" for a in MESH_AXES if mesh[f"dcn_{a}"] == -1), "dcn_data")] = -1
    return mesh


def capacity_chips(cfg, chip: hw.Chip) -> float:
    """The book's count of the chips a run needs: one copy of the parameters, gradients and optimizer state, and
    the activations the remat policy saves for the whole batch (one microbatch), over one chip's HBM - nothing
    replicated, no working set, no layout: a lower bound."""
    whole = memory.predict(cfg, dict.fromkeys(MESH_AXES, 1))
    return (whole.params + whole.gradients + whole.optimizer + whole.saved_activations) / chip.hbm_bytes


def min_chips(cfg, hardware: str) -> dict:
    """The fewest chips of the plan's generation, in a slice that exists (with the plan's slice count), on which
    the config fits: the planner's memory per chip within its HBM, on a mesh the trainer accepts. The config's
    mesh is kept but for one ICI degree, which fills the slice (`_filling`). `min_chips` is None when no slice
    fits, or when hardware.yaml lists no slices of a TPU (`note` says which)."""
    topo = hw.topology(hardware)
    mesh_cfg = _filling(cfg, topo.chip.is_gpu)
    listed = topo.chip.is_gpu or topo.chip.name in hw.cloud_tpus()
    out = {"min_chips": None, "hardware": None, "mesh": None, "memory_per_device_bytes": None,
           "capacity_chips": capacity_chips(cfg, topo.chip),
           "note": "no slice of this generation fits it" if listed else
                   f"hardware.yaml lists no slices of {topo.chip.name}"}
    for candidate in _candidates(topo):
        slice_ = hw.topology(candidate)
        try:
            shape = roofline.resolve_mesh(mesh_cfg, slice_)
        except ConfigError:
            continue
        axes = {a: shape.ici[a] * shape.dcn[a] for a in MESH_AXES}
        state = memory.state(cfg, axes)
        if roofline.refusals(cfg, axes, state):
            continue
        need = memory.predict(cfg, axes, state, slice_.chip.ragged_all_to_all).total
        if need <= slice_.chip.hbm_bytes:
            return {**out, "min_chips": slice_.num_chips, "hardware": str(slice_), "mesh": axes,
                    "memory_per_device_bytes": need, "note": None}
    return out


def describe(training_: dict | None, chips: dict | None, result: dict) -> list[str]:
    """Lines for the plan's table."""
    lines = []
    if training_:
        t = training_
        chips_ = f"{result['chips']} chip{'s' if result['chips'] > 1 else ''}"
        refused = (" - on a mesh the trainer refuses (see the warnings)" if t["mesh_refused"] else
                   " - on a mesh that does not fit (see the warnings)" if not t["fits"] else "")
        lines.append(f"training on {t['tokens']:.3g} tokens ({t['steps']:,.0f} steps): {t['total_flops']:.3g} FLOP "
                     f"(matmuls {t['matmul_flops']:.3g}, attention {t['attention_flops']:.3g}); at MFU "
                     f"{100 * t['mfu']:.1f}% ({t['mfu_source']}): {t['days']:.3g} days on {chips_}, "
                     f"{t['chip_hours']:.3g} chip-hours{refused}")
    if chips:
        where = (chips["note"] if chips["min_chips"] is None else
                 f"{chips['min_chips']} ({chips['hardware']}, mesh "
                 f"{' x '.join(f'{a}={n}' for a, n in chips['mesh'].items() if n > 1) or '1 device'}, "
                 f"{chips['memory_per_device_bytes'] / 2**30:.1f} GiB per chip)")
        lines.append(f"fewest chips that fit: {where}; the book's count (state and saved activations over HBM): "
                     f"{math.ceil(chips['capacity_chips'])}")
        f = chips.get("training")
        if f:
            above = (f", above its predicted bound of {100 * f['mfu_upper_bound']:.1f}%" if f["mfu_above_bound"]
                     else "")
            source = "its predicted step time" if f["mfu_source"] != "given" else f"given{above}"
            lines.append(f"  training there at MFU {100 * f['mfu']:.1f}% ({source}): {f['days']:.3g} days on "
                         f"{f['chips']} chips, {f['chip_hours']:.3g} chip-hours")
    return lines
