"""Mesh sweeps from YAML (`python -m scaletrain sweep SWEEP.yaml --out DIR`): every variant of a base config
planned (roofline), compiled ahead of time, and run for a few steps here - each stage optional - with the three
views of each variant side by side and their disagreements flagged (docs/planner.md, "Sweeps").

A sweep file:

    base: ../llama_tiny.yaml          # the config every variant starts from (relative to the sweep file)
    set: [steps=10]                   # overrides for every variant (optional)
    stages: [plan, compile, run]      # any of the three, in this order
    hardware: cpu:8                   # what `plan` predicts for (planner/hardware.py)
    topology: cpu:8                   # what `compile` compiles for (default: hardware); a TPU topology or cpu:N
    loop_correction: false            # compile: two more compiles per variant for loop-corrected counts
    steps: 5                          # run: steps timed after one warm-up step
    grid:                             # every combination, in the order written ...
      mesh.fsdp: [8, 4]
      mesh.tensor: [1, 2]
    variants:                         # ... and/or a list, each a mapping of overrides
      - {mesh.data: 2, mesh.fsdp: 4}

An invalid variant (a ConfigError from any stage) is recorded with its error and the sweep goes on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import yaml

from scaletrain.errors import ConfigError

STAGES = ("plan", "compile", "run")
# Predictions and results further apart than this (relative to the later stage) are flagged in the summary.
TOLERANCE = 0.25
RESULTS = "results.jsonl"
_KEYS = {"base", "set", "stages", "hardware", "topology", "loop_correction", "steps", "grid", "variants"}


@dataclasses.dataclass(frozen=True)
class Sweep:
    base: Path
    common: tuple[str, ...]  # key=value overrides of every variant
    stages: tuple[str, ...]
    hardware: str | None
    topology: str | None
    loop_correction: bool
    steps: int
    variants: tuple[dict[str, Any], ...]


def load(path: str | Path) -> Sweep:
    """Read and check a sweep file. Raises ConfigError saying what is wrong and what is expected."""
    from scaletrain.config import read_mapping

    path = Path(path)
    raw = read_mapping(path, "sweep file", "configs/sweeps/tiny_cpu.yaml", _KEYS)
    if "base" not in raw:
        raise ConfigError(f"sweep file {path}: 'base' (the config every variant starts from) is missing")
    stages = raw.get("stages", list(STAGES))
    if not isinstance(stages, list) or not stages or any(s not in STAGES for s in stages):
        raise ConfigError(f"sweep file {path}: stages {stages!r}; expected a list of {', '.join(STAGES)}")
    hardware = raw.get("hardware")
    topology = raw.get("topology", hardware)
    if "plan" in stages and not hardware:
        raise ConfigError(f"sweep file {path}: the plan stage needs 'hardware', e.g. hardware: v5p:4x4x2")
    if "compile" in stages and not topology:
        raise ConfigError(f"sweep file {path}: the compile stage needs 'topology' (or 'hardware'), e.g. v5p:4x4x2")
    if not isinstance(raw["base"], str):
        raise ConfigError(f"sweep file {path}: base={raw['base']!r}; expected the path of a config file")
    if not isinstance(raw.get("loop_correction", True), bool):
        raise ConfigError(f"sweep file {path}: loop_correction={raw['loop_correction']!r}; expected true or false")
    steps = raw.get("steps", 5)
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"sweep file {path}: steps={steps!r}; expected a positive integer")
    variants = tuple(_variants(raw, path))
    base = (path.parent / raw["base"]).resolve()
    # A base that cannot be read is the sweep file's error, not each variant's.
    read_mapping(base, f"sweep file {path}: base config", "configs/llama_tiny.yaml")
    return Sweep(base=base, common=tuple(_as_overrides(raw.get("set", []), path)),
                 stages=tuple(s for s in STAGES if s in stages), hardware=hardware, topology=topology,
                 loop_correction=raw.get("loop_correction", True), steps=steps, variants=variants)


def _as_overrides(entries, path: Path) -> list[str]:
    if isinstance(entries, dict):
        return [f"{k}={_scalar(v)}" for k, v in entries.items()]
    if not isinstance(entries, list) or not all(isinstance(e, str) and "=" in e for e in entries):
        raise ConfigError(f"sweep file {path}: 'set' must be a list of KEY=VALUE strings or a mapping")
    return list(entries)


def _scalar(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def overrides(variant: dict[str, Any]) -> list[str]:
    """A variant's {key: value} as `--set` overrides, KEY=VALUE with the value a YAML scalar."""
    return [f"{k}={_scalar(v)}" for k, v in variant.items()]


def _variants(raw: dict, path: Path) -> list[dict[str, Any]]:
    """The grid's combinations (last key fastest), then the listed variants."""
    grid, listed = raw.get("grid") or {}, raw.get("variants") or []
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        raise ConfigError(f"sweep file {path}: 'grid' must map config keys to non-empty lists of values")
    if not isinstance(listed, list) or not all(isinstance(v, dict) for v in listed):
        raise ConfigError(f"sweep file {path}: 'variants' must be a list of mappings of config keys to values")
    out = [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())] if grid else []
    out += listed
    if not out:
        raise ConfigError(f"sweep file {path}: no variants; give a 'grid', a 'variants' list, or both")
    return out


# Key prefixes a variant's name leaves out, and the longer keys it shortens.
_SHORT = {"mesh.": "", "remat.policy": "remat", "sharding.preset": "preset",
          "train.grad_accum_steps": "accum", "model.logits_block": "logits_block"}


def name(variant: dict[str, Any]) -> str:
    """`mesh.fsdp=4 mesh.tensor=2` -> `fsdp=4 tensor=2`: short enough for a plot's axis."""
    def short(key: str) -> str:
        for long, new in _SHORT.items():
            if key.startswith(long):
                return new + key.removeprefix(long)
        return key

    custom: dict[str, list[str]] = {}  # a custom policy's names by mode: one entry in the name
    for k, v in variant.items():
        if k.startswith("remat.custom."):
            custom.setdefault(v, []).append(k.removeprefix("remat.custom."))
    parts = [f"{short(k)}={v}" for k, v in variant.items() if not k.startswith("remat.custom.")]
    if custom:
        parts.append("(" + "; ".join(f"{mode}: {','.join(names)}" for mode, names in custom.items()) + ")")
    return " ".join(parts) or "base"


# --- stages ----------------------------------------------------------------------------------------------

def _plan(cfg, sweep: Sweep) -> dict:
    from scaletrain.planner import roofline

    p = roofline.plan(cfg, sweep.hardware)
    return {"hardware": p["hardware"], "chip": p["chip"], "step_time_s": p["step_time_s"], "bound": p["bound"],
            "step_estimate_s": p["step_estimate_s"],
            "memory_per_device_bytes": p["memory_per_device_bytes"]["total"], "fits": p["fits"],
            "mfu_upper_bound": p["mfu_upper_bound"], "comm_bytes_per_device": p["comm_bytes_per_device"],
            "pipeline_bubble": p["pipeline_bubble"], "warnings": p["warnings"]}


def _compile(cfg, sweep: Sweep) -> dict:
    from scaletrain.planner import aot

    c = aot.compile_step(cfg, sweep.topology, loop_correction=sweep.loop_correction)
    return {k: c[k] for k in ("topology", "fits", "hbm_per_device_bytes", "hbm_capacity_bytes", "xla_flops",
                              "xla_optimal_seconds", "xla_roofline_seconds", "xla_with_kernels_seconds",
                              "loop_corrected", "collectives", "compile_seconds", "xla_time_comparable",
                              "warnings")}


def _run(cfg, sweep: Sweep) -> dict:
    """`steps` steps on this process's devices after one warm-up step: the median step time, tokens/s, MFU, and
    the compiled step's memory per device."""
    import jax
    import numpy as np

    from scaletrain.data import loader as data
    from scaletrain.facts import fit, flops, hardware
    from scaletrain.train import objective, trainer

    setup = trainer.build(cfg, jax.devices())
    compiled = setup.step.lower(*setup.abstract_args()).compile()
    state = setup.init(jax.random.PRNGKey(cfg.seed))
    batches = data.make_iterator(cfg, setup.batch_sharding)
    seconds, losses, no_ceiling = [], [], setup.loss_ceiling()
    for _ in range(sweep.steps + 1):
        batch = setup.put_batch(next(batches))
        start = time.perf_counter()
        state, metrics = compiled(state, batch, no_ceiling)
        losses.append(float(metrics["loss"]))  # waits for the step
        seconds.append(time.perf_counter() - start)
    step_time = statistics.median(seconds[1:])
    tokens = cfg.train.global_batch * cfg.data.seq_len
    reference = objective.runs_reference(cfg)
    peak = hardware.peak_flops(jax.devices(), cfg.hardware.peak_flops_per_device, cfg.model.quantization,
                               flops.quantized_share(setup.model_cfg, cfg.data.seq_len, reference))
    model_flops = flops.flops_per_token(setup.model_cfg, cfg.data.seq_len, reference) * tokens
    device = jax.devices()[0]
    return {"devices": len(jax.devices()), "device_kind": device.device_kind,
            "chip": "cpu" if device.platform == "cpu" else hardware.chip(device.device_kind), "step_time_s": step_time,
            "tokens_per_second": tokens / step_time, "mfu": model_flops / (step_time * peak) if peak else None,
            # The compiled step's bytes: a device's peak_bytes_in_use would be the maximum over every variant
            # this process has run so far.
            "memory_per_device_bytes": fit.compiled(compiled.memory_analysis())["device_total"],
            "losses": losses, "finite": bool(np.isfinite(losses).all())}


_STAGE_FNS = {"plan": _plan, "compile": _compile, "run": _run}
# The sweep file's settings each stage's results depend on.
_STAGE_FIELDS = {"plan": ("hardware",), "compile": ("topology", "loop_correction"), "run": ("steps",)}


def checks(record: dict, sweep: Sweep) -> list[str]:
    """Where two views of one variant on the same machine differ by more than TOLERANCE."""
    plan, comp, run = record.get("plan"), record.get("compile"), record.get("run")
    pairs = []
    if plan and comp and comp.get("xla_flops") is not None and sweep.topology == sweep.hardware:
        pairs += [("step time", "plan", plan.get("step_estimate_s", plan["step_time_s"]), "compile (XLA)",
                   xla_time(comp)),
                  ("memory", "plan", plan["memory_per_device_bytes"], "compile", comp["hbm_per_device_bytes"])]
    if plan and run and plan["chip"] == run["chip"]:
        pairs += [("step time", "plan", plan["step_time_s"], "run", run["step_time_s"]),
                  ("memory", "plan", plan["memory_per_device_bytes"], "run (compiled here)",
                   run["memory_per_device_bytes"])]
    if comp and run and comp["topology"].startswith("cpu") and run["chip"] == "cpu":
        pairs.append(("step time", "compile (XLA)", xla_time(comp), "run", run["step_time_s"]))
    flags = [f"compile: {w}" for w in (comp or {}).get("warnings", [])]
    for what, a_name, a, b_name, b in pairs:
        if a is not None and b and abs(a - b) / b > TOLERANCE:
            flags.append(f"{what}: {a_name} {_fmt(what, a)} vs {b_name} {_fmt(what, b)} ({a / b - 1:+.0%})")
    return flags


def xla_time(comp: dict) -> float | None:
    """XLA's own estimate - with the flash kernels' time added, which XLA counts as nothing (aot.compile_step) -,
    else the chip's roofline of XLA's counts (libtpu's estimate is sometimes missing); None where the compile says
    neither is the step's (zero-bubble: aot.time_warning)."""
    if comp.get("xla_time_comparable") is False:
        return None
    return comp.get("xla_with_kernels_seconds") or comp.get("xla_optimal_seconds") or comp.get("xla_roofline_seconds")


def _fmt(what: str, value: float) -> str:
    return f"{value / 2**30:.3g} GiB" if what == "memory" else f"{value:.3g} s"


def best_time(record: dict) -> tuple[float, str] | None:
    """The most trustworthy step time a variant has: measured, else XLA's, else - where XLA's is not the step's -
    the plan's estimate of it, else the roofline's."""
    if record.get("run"):
        return record["run"]["step_time_s"], "measured"
    comp = record.get("compile") or {}
    if xla_time(comp):
        return xla_time(comp), "XLA"
    if record.get("plan") and comp.get("xla_time_comparable") is False:
        return record["plan"]["step_estimate_s"], "plan's estimate"
    if record.get("plan"):
        return record["plan"]["step_time_s"], "roofline"
    return None


def run(sweep: Sweep, out: str | Path, log=print) -> list[dict]:
    """Every variant through every stage; results.jsonl grows a line per variant as it finishes, so a sweep
    stopped midway keeps what it measured, and a rerun into the same folder resumes: variants recorded there
    are kept (failed ones run again). Then summary.md and sweep.png, of this sweep's variants."""
    out = Path(out)
    kept = earlier(sweep, out)
    out.mkdir(parents=True, exist_ok=True)
    sweep_id = identity(sweep)
    records = []
    for i, variant in enumerate(sweep.variants):
        given = [*sweep.common, *overrides(variant)]
        log(f"[{i + 1}/{len(sweep.variants)}] {name(variant)}")
        record = kept.get(tuple(given))
        if record is not None:
            log(f"    {record['status']}, kept from an earlier run")
            records.append(record)
            continue
        record = {"name": name(variant), "overrides": given, "sweep": sweep_id, **_measure(sweep, given)}
        log(f"    {record['status']}" + (f": {record['error']}" if "error" in record else "")
            + "".join(f"\n    check: {c}" for c in record["checks"]))
        records.append(record)
        with (out / RESULTS).open("a") as f:
            f.write(json.dumps(record) + "\n")
    (out / "summary.md").write_text(summary(records, sweep))
    plot(records, out / "sweep.png")
    return records


def _measure(sweep: Sweep, overrides: list[str]) -> dict:
    """One variant's stages: its status, each stage's results (or its error) and their checks."""
    from scaletrain import config

    record = {"status": "ok"}
    try:
        cfg = config.load(sweep.base, overrides)
        for stage in sweep.stages:
            if stage == "run" and (record.get("compile") or {}).get("fits") is False:
                record["run"] = None  # compiled for this machine and found too big: nothing to run
                continue
            record[stage] = _STAGE_FNS[stage](cfg, sweep)
    except ConfigError as e:
        record.update(status="invalid", error=str(e))
    except Exception as e:  # noqa: BLE001 - one variant's failure is a result; the sweep goes on
        record.update(status="failed", error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                      traceback=traceback.format_exc(limit=-3))
    record["checks"] = checks(record, sweep) if record["status"] == "ok" else []
    return record


def identity(sweep: Sweep) -> dict:
    """What a sweep's results depend on besides each variant's own overrides: the base config as the common
    overrides change it (`set`, tune's --set: another base as much as an edited file is), the stages and their
    settings. Every record carries it, so that a rerun into the same folder can tell its own sweep's results from
    another's."""
    return {"base_sha256": hashlib.sha256(sweep.base.read_bytes()).hexdigest(), "common": list(sweep.common),
            "stages": list(sweep.stages),
            **{field: getattr(sweep, field) for stage in sweep.stages for field in _STAGE_FIELDS[stage]}}


def earlier(sweep: Sweep, out: str | Path) -> dict[tuple[str, ...], dict]:
    """The records an earlier run of this sweep left in OUT/results.jsonl, by overrides, failed ones left out
    (what failed may since have been fixed). Another sweep's results are refused: kept beside this one's, they
    would be ranked against results measured differently."""
    results, sweep_id = Path(out) / RESULTS, identity(sweep)
    if not results.is_file():
        return {}
    kept = {}
    for n, line in enumerate(results.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
            other, overrides, status = record.get("sweep"), tuple(record["overrides"]), record["status"]
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise ConfigError(f"{results}:{n} is not a sweep's record; use a new --out or delete the folder") from None
        differ = [k for k in sweep_id if not isinstance(other, dict) or other.get(k) != sweep_id[k]]
        if differ:
            raise ConfigError(f"{results} holds the results of another sweep (different {', '.join(differ)}); use "
                              f"a new --out or delete the folder")
        if status != "failed":
            kept[overrides] = record
    return kept


# --- reports ---------------------------------------------------------------------------------------------

def summary(records: list[dict], sweep: Sweep) -> str:
    """Variants ranked by their best available step time, with every stage's view beside it."""
    ranked = sorted(records, key=lambda r: (r["status"] != "ok", best_time(r) is None,
                                            (best_time(r) or (math.inf,))[0]))
    lines = [f"# Sweep of {sweep.base.name}", "",
             f"Stages: {', '.join(sweep.stages)}; plan for `{sweep.hardware}`, compile for `{sweep.topology}`"
             f"{' (loop-corrected)' if sweep.loop_correction else ''}"
             f"{f'; run: {sweep.steps} timed steps here' if 'run' in sweep.stages else ''}. "
             f"Common overrides: {' '.join(sweep.common) or 'none'}. Differences over {TOLERANCE:.0%} between "
             f"two views of the same machine are flagged.", "",
             "| rank | variant | best step time | predicted s | bound | XLA s | measured s | predicted GiB | "
             "compiled GiB | measured GiB | fits | checks |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rank, r in enumerate(ranked, 1):
        plan, comp, run_ = r.get("plan") or {}, r.get("compile") or {}, r.get("run") or {}
        best = best_time(r)
        if r["status"] != "ok":
            lines.append(f"| - | {r['name']} | {r['status']}: {r['error']} ||||||||||")
            continue
        fits = comp.get("fits", plan.get("fits"))
        lines.append(" | ".join([
            f"| {rank}", r["name"], f"{best[0]:.4g} s ({best[1]})" if best else "-",
            _cell(plan.get("step_time_s")), plan.get("bound", "-"),
            _cell(xla_time(comp)),
            _cell(run_.get("step_time_s")), _cell(plan.get("memory_per_device_bytes"), 2**30),
            _cell(comp.get("hbm_per_device_bytes"), 2**30), _cell(run_.get("memory_per_device_bytes"), 2**30),
            "-" if fits is None else "yes" if fits else "NO", "; ".join(r["checks"]) or "ok"]) + " |")
    return "\n".join(lines) + "\n"


def _cell(value: float | None, unit: float = 1.0) -> str:
    return "-" if value is None else f"{value / unit:.4g}"


def plot(records: list[dict], path: Path) -> None:
    """Step time and memory per device of each valid variant: predicted, compiled and measured side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    valid = [r for r in records if r["status"] == "ok"]
    series = {
        "step time (s)": [("predicted", lambda r: (r.get("plan") or {}).get("step_time_s")),
                          ("XLA", lambda r: xla_time(r.get("compile") or {})),
                          ("measured", lambda r: (r.get("run") or {}).get("step_time_s"))],
        "memory per device (GiB)": [
            ("predicted", lambda r: _gib((r.get("plan") or {}).get("memory_per_device_bytes"))),
            ("compiled", lambda r: _gib((r.get("compile") or {}).get("hbm_per_device_bytes"))),
            ("measured", lambda r: _gib((r.get("run") or {}).get("memory_per_device_bytes")))],
    }
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(valid) + 4), 4.5))
    x = np.arange(len(valid))
    for ax, (title, views) in zip(axes, series.items()):
        for k, (label, get) in enumerate(views):
            values = [get(r) for r in valid]
            ax.bar(x + (k - 1) * 0.27, [v if v is not None else 0 for v in values], 0.27, label=label)
        ax.set_xticks(x, [r["name"] for r in valid], rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _gib(value: float | None) -> float | None:
    return None if value is None else value / 2**30
