"""The real train step compiled ahead of time for a TPU topology (libtpu, on any machine): does it fit, what does
XLA estimate, which collectives does it run.

XLA's cost analysis counts a while loop's body once, whatever its trip count (jax-notes.md), so the step's raw
`flops` and `optimal_seconds` miss most of the scanned layer stack. The loop-corrected figures come from two
more compiles of the same step with 2 and 3 layers, every model loop unrolled and the windowed-einsum loops
XLA builds around sharded matmuls turned off: per layer = c(3) - c(2), the step = c(2) + (L - 2) x per layer
(with P pipeline stages, 2P and 3P layers; the pipeline's iterations are unrolled too; with model.moe_every = k,
2k and 3k: the scan's unit is a group of k layers). They stand for the step's program unrolled whole, which is
compiled instead when it has at most 5 units. With
gradient accumulation those compiles take one microbatch and the result is multiplied by their number (which
counts the optimizer update once per microbatch: an overestimate of a few percent). The offloaded optimizer's
layer loop (optim.offload) stays counted once.
"""

from __future__ import annotations

import copy
import re
import time

from scaletrain.errors import ConfigError, UserError
from scaletrain.facts import fit, hardware
from scaletrain.parallel import pipeline_zb
from scaletrain.planner import hlo
from scaletrain.train.runner import Runner

# Compiler options of the cost-estimate compiles: no loops around sharded matmuls.
_NO_WINDOWED_EINSUM = {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
                       "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False}
_COSTS = ("flops", "bytes accessed", "optimal_seconds")


def topology_devices(topology: str) -> list:
    """The devices of a TPU topology such as `v5p:4x4x4` or `v5e:2x2`, or of several such slices joined by DCN
    (`2xv5p:4x4x4`, as the planner writes them: each device then has its slice_index), described by libtpu."""
    from jax.experimental import topologies

    slices, chip_name, dims = hardware.parse(topology)
    if _known(chip_name):
        hardware.topology(topology)  # the shape checks `plan` and `tune` make (libtpu takes a v5p:2x2 as given)
    name = f"{chip_name}:{'x'.join(map(str, dims))}"
    try:
        return list(topologies.get_topology_desc(topology_name=name, platform="tpu", num_slices=slices,
                                                 **_wrap(name)).devices)
    except Exception as e:  # noqa: BLE001 - libtpu's errors name no fix
        if "lockfile" in str(e):  # the machine's state, not the config's: a sweep retries it on a rerun
            raise UserError("another process on this machine holds libtpu (its lockfile); wait for it, or set "
                            "ALLOW_MULTIPLE_LIBTPU_LOAD=1 where no TPU is attached") from None
        raise ConfigError(f"libtpu does not know topology '{topology}' ({str(e).splitlines()[0][:160]}); expected "
                          f"a TPU generation and chip grid, e.g. v5e:2x2, v5p:2x2x2, v6e:8x8") from None


def _known(chip_name: str) -> bool:
    try:
        hardware.spec(chip_name)
    except ConfigError:
        return False
    return True


def _wrap(name: str) -> dict:
    """libtpu's `wrap` for a slice `CHIP:DIMS`: the wraparound links the rented slice has (hardware.wraparound,
    what the planner's collectives assume). libtpu's default is none, and without them it compiles a collective
    over a whole torus axis as another: an FSDP all-gather over a v5p:4x4x4 or larger becomes a zero-filled
    buffer, a dynamic-update-slice and an all-reduce, twice the bytes (docs/maxtext-comparison.md, DeepSeek-V3).
    Nothing for a chip the table lacks: libtpu then says what it does not know."""
    chip_name, dims_text = name.split(":")
    if not _known(chip_name):
        return {}
    chip = hardware.spec(chip_name)
    dims = tuple(int(d) for d in dims_text.split("x"))
    if chip.is_gpu or len(dims) != chip.torus_dims:
        return {}
    wraps = hardware.wraparound(chip, dims)
    return {"wrap": wraps + (False,) * (3 - len(wraps))}


def devices_for(topology: str) -> list:
    """A TPU topology's devices, or with `cpu` / `cpu:N` this process's own CPU devices (a sweep measured here
    compiles for them)."""
    import jax

    if topology == "cpu" or topology.startswith("cpu:"):
        local = jax.devices("cpu")
        if topology != "cpu" and topology != f"cpu:{len(local)}":
            raise ConfigError(f"topology '{topology}': this process has {len(local)} CPU devices; expected "
                              f"cpu:{len(local)} (or start it with --cpu-devices N)")
        return local
    return topology_devices(topology)


def _cost(compiled) -> dict[str, float]:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {k: float(cost.get(k, 0.0)) for k in _COSTS}


def unrolled_cost(cfg, devices) -> dict[str, float]:
    """XLA's costs of the step with every model loop unrolled and no windowed-einsum loops: a program whose cost
    analysis counts everything it runs - what the loop correction stands for (tests/test_aot.py compares the
    two)."""
    from scaletrain.train import trainer

    setup = trainer.build(cfg, devices, unroll_loops=True)
    options = _NO_WINDOWED_EINSUM if devices[0].platform == "tpu" else None
    return _cost(setup.step.lower(*setup.abstract_args()).compile(options))


def loop_unit(cfg, runner: Runner) -> int:
    """The layers of the smallest model the loop correction may compile for `cfg` run by `runner`: a layer of
    each block of each stage (stages x repeats: a circular or interleaved schedule's blocks), each a group of
    model.moe_every layers for a mixture of experts."""
    return runner.stages * runner.repeats * (cfg.model.moe_every if cfg.model.num_experts else 1)


def _loop_corrected(cfg, devices, runner: Runner = Runner()) -> dict[str, float]:
    """The step's costs as XLA counts the unrolled program (unrolled_cost), from two smaller compiles of 2U and 3U
    layers, U = loop_unit: per unit = c(3U) - c(2U), the step = c(2U) + (L/U - 2) per unit. Not from U and 2U:
    in XLA's counts the first unit costs less than the ones after it (the tiny model's first layer 105 MB accessed,
    the next ones 116 MB), so c(2U) - c(U) undercounts a unit (docs/benchmarks.md). With at most 5U layers the
    whole program is compiled unrolled instead: no more compile time than the two."""
    accum = cfg.train.grad_accum_steps
    unit = loop_unit(cfg, runner)
    dense = cfg.model.first_dense_layers  # before the scanned stack (models/deepseek): in every variant, outside
    units = (cfg.model.num_layers - dense) // unit

    def cost(layers: int) -> dict[str, float]:
        variant = copy.deepcopy(cfg)
        variant.model.num_layers = dense + layers
        variant.train.global_batch = cfg.train.global_batch // accum
        variant.train.grad_accum_steps = 1
        return unrolled_cost(variant, devices)

    if units <= 5:
        return {k: accum * v for k, v in cost(cfg.model.num_layers - dense).items()}
    two, three = cost(2 * unit), cost(3 * unit)
    return {k: accum * (two[k] + (units - 2) * (three[k] - two[k])) for k in _COSTS}


def time_warning(runner: Runner) -> str | None:
    """Why XLA's step time of `runner`'s program is not the step's, or None where it is. Zero-bubble's tick runs
    one slot on each stage, the stage's row of a static table choosing it by one conditional a kind of slot; XLA's
    cost analysis counts every conditional's work whichever branch runs - each tick three slots, and the buffers
    each carries (the tiny model on v5p:2x2x1, 2 stages of 4 microbatches, loop-corrected: 11x the plan's
    estimate, where 1F1B's is 1.6x). No compile can correct it: every stage runs the one SPMD program, and which
    branch a stage takes is known only when it runs."""
    if runner.schedule != pipeline_zb.SCHEDULE:
        return None
    return ("XLA's step time is not comparable for the zero_bubble schedule: its cost analysis counts every "
            "tick's three per-slot conditionals whichever one runs (docs/pipeline.md, \"Not yet\"); compare it by "
            "the plan's estimate (`plan`). The memory is the step's")


def compile_step(cfg, topology: str, loop_correction: bool = True) -> dict:
    """The `compile` command's result (docs/planner.md) for `cfg` on `topology` (a TPU topology, or `cpu`:
    devices_for). Raises ConfigError for a config or topology the step cannot be built for."""
    import jax

    from scaletrain.train import trainer

    devices = devices_for(topology)
    setup = trainer.build(cfg, devices)
    start = time.perf_counter()
    try:
        compiled = setup.step.lower(*setup.abstract_args()).compile()
    except Exception as e:  # noqa: BLE001 - running out of HBM is a result, any other failure is not
        if "RESOURCE_EXHAUSTED" in str(e) or "Ran out of memory" in str(e):
            return _does_not_fit(topology, devices, _out_of_memory(str(e)), time.perf_counter() - start,
                                 str(e).splitlines()[0])
        raise
    compile_seconds = time.perf_counter() - start
    mem = fit.compiled(compiled.memory_analysis())
    raw = _cost(compiled)
    corrected = _loop_corrected(cfg, devices, setup.runner) if loop_correction else None
    best = corrected or raw
    estimate = best["optimal_seconds"]
    if estimate <= 0 or raw["optimal_seconds"] <= 0:
        # libtpu's estimate of some programs (seen on tied-embedding models) comes out negative: no estimate.
        estimate = None
    chip = _chip(devices)
    capacity = int(chip.hbm_bytes) if chip else None
    warning = time_warning(setup.runner)
    text = compiled.as_text()
    collectives = hlo.summary(hlo.inventory(text, setup.mesh))
    kernels = _kernels(cfg, setup.mesh, chip)
    return {
        "topology": topology,
        "chips": len(devices),
        "device_kind": devices[0].device_kind,
        "fits": capacity is None or mem["device_total"] <= capacity,
        "hbm_per_device_bytes": mem["device_total"],
        "hbm_capacity_bytes": capacity,
        "host_per_device_bytes": mem["host_total"],
        "memory": mem,
        "xla_flops": best["flops"],
        "xla_bytes_accessed": best["bytes accessed"],
        "xla_optimal_seconds": estimate,
        # The chip's roofline applied to XLA's own counts: the longer of compute and HBM time (overlapped, where
        # libtpu's optimal_seconds comes out near their sum).
        "xla_roofline_seconds": max(best["flops"] / chip.bf16_flops, best["bytes accessed"] / chip.hbm_bandwidth)
        if chip else None,
        "loop_corrected": corrected is not None,
        # XLA counts a Pallas kernel as nothing: the flash kernels' own FLOPs and bytes (the planner's count), and
        # XLA's estimate with them added at the chip's roofline.
        "kernel_flops": kernels and kernels["flops"],
        "kernel_bytes": kernels and kernels["bytes"],
        "xla_with_kernels_seconds": estimate + kernels["seconds"] if kernels and estimate else None,
        "xla_raw": raw,
        "collectives": {kind: {"count": int(v["count"]), "bytes": int(v["bytes"])} for kind, v in collectives.items()},
        # Across slices: libtpu's host-transfer sends, per chip (the collectives above are ICI's alone).
        "dcn": {kind: {"count": int(v["count"]), "bytes": int(v["bytes"]),
                       "sizes": {str(b): int(n) for b, n in sorted(v["sizes"].items())}}
                for kind, v in hlo.dcn(text).items()},
        "compile_seconds": compile_seconds,
        "jax_version": jax.__version__,
        # False where the step time above is not the step's (time_warning): then rank by the plan's estimate
        "xla_time_comparable": warning is None,
        "warnings": [warning] if warning else [],
    }


def _kernels(cfg, mesh, chip: hardware.Chip | None) -> dict | None:
    """The flash attention kernels' cost per device and step on a TPU (None for XLA's attention, or off TPU)."""
    if cfg.model.attention != "flash" or chip is None or chip.name == "cpu" or chip.is_gpu:
        return None
    from scaletrain.config import MESH_AXES
    from scaletrain.planner import roofline

    cost = roofline.flash_kernel_cost(cfg, {a: mesh.shape[a] for a in MESH_AXES}, chip.name)
    return {**cost, "seconds": max(cost["flops"] / chip.bf16_flops, cost["bytes"] / chip.hbm_bandwidth)}


def _out_of_memory(message: str) -> int | None:
    """The bytes XLA says a step needs, when it refused to compile one that does not fit in HBM (None when the
    message does not say)."""
    m = re.search(r"Ran out of memory[^(]*\(([\d.]+)([KMGT])\)", message)
    return int(float(m.group(1)) * 2 ** (10 * "KMGT".index(m.group(2)) + 10)) if m else None


def _chip(devices) -> hardware.Chip | None:
    if devices[0].platform == "cpu":
        return hardware.cpu(len(devices))
    name = hardware.chip(devices[0].device_kind)
    return hardware.spec(name) if name else None


def _does_not_fit(topology: str, devices, needed: int | None, seconds: float, message: str) -> dict:
    chip = _chip(devices)
    return {"topology": topology, "chips": len(devices), "device_kind": devices[0].device_kind, "fits": False,
            "hbm_per_device_bytes": needed, "hbm_capacity_bytes": int(chip.hbm_bytes) if chip else None,
            "host_per_device_bytes": 0,
            "memory": None, "xla_flops": None, "xla_bytes_accessed": None, "xla_optimal_seconds": None,
            "xla_roofline_seconds": None,
            "kernel_flops": None, "kernel_bytes": None, "xla_with_kernels_seconds": None,
            "loop_corrected": False, "xla_raw": None, "collectives": None, "dcn": None, "compile_seconds": seconds,
            "xla_time_comparable": True, "warnings": [], "error": message}


def _seconds(value: float | None) -> str:
    if value is None:
        return "unavailable"
    return f"{value:.3f} s" if value >= 1 else f"{value * 1e3:.3g} ms"


def describe(result: dict) -> str:
    """The compile result for a console."""
    gib = fit.GIB
    capacity = result["hbm_capacity_bytes"]
    if result["memory"] is None:
        needed = result["hbm_per_device_bytes"]
        return (f"{result['topology']}: {result['chips']} x {result['device_kind']}: DOES NOT FIT - XLA needs "
                + (f"at least {needed / gib:.2f} GiB" if needed else "more") + " of HBM per device"
                + (f" of {capacity / gib:.2f} GiB" if capacity else "") + f"\n  ({result['error']})")
    mem, host = result["memory"], result["host_per_device_bytes"]
    lines = [
        f"{result['topology']}: {result['chips']} x {result['device_kind']}, compiled in "
        f"{result['compile_seconds']:.0f} s",
        f"HBM per device: {result['hbm_per_device_bytes'] / gib:.2f} GiB of "
        + (f"{capacity / gib:.2f} GiB - {'fits' if result['fits'] else 'DOES NOT FIT'}" if capacity else "unknown"),
        f"  state and batch {mem['device_arguments'] / gib:.2f}, temporaries "
        f"{mem['device_temporaries'] / gib:.2f}, new outputs {mem['device_outputs'] / gib:.2f}"
        + (f"; host (pinned) {host / gib:.2f} GiB" if host else ""),
        f"XLA per device and step{' (loop-corrected)' if result['loop_corrected'] else ' (raw: loop bodies once)'}: "
        f"{result['xla_flops'] / 1e12:.4g} TFLOP, {result['xla_bytes_accessed'] / 1e9:.4g} GB accessed; "
        f"optimal_seconds {_seconds(result['xla_optimal_seconds'])}, roofline of those counts "
        f"{_seconds(result['xla_roofline_seconds'])}",
        "collectives per step (count, full-array bytes):",
    ]
    if result.get("xla_with_kernels_seconds"):
        lines.insert(-1, f"  XLA counts the flash kernels as nothing; their {result['kernel_flops'] / 1e12:.4g} TFLOP "
                         f"and {result['kernel_bytes'] / 1e9:.4g} GB at the chip's roofline make the step "
                         f"{_seconds(result['xla_with_kernels_seconds'])}")
    lines += _counts(result["collectives"])
    if result.get("dcn"):
        lines += ["over DCN per chip and step (sends, bytes; libtpu's transfers by the collective they serve):"]
        lines += _counts(result["dcn"])
    lines += [f"warning: {w}" for w in result["warnings"]]
    return "\n".join(lines)


def _counts(kinds: dict[str, dict]) -> list[str]:
    return [f"  {kind:<18} {v['count']:>6}  {v['bytes'] / 1e9:10.4g} GB" for kind, v in sorted(kinds.items())]
