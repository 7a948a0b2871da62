"""`python -m scaletrain tune --config C --topology T [--budget N] --out DIR`: the fastest configuration of C that
fits T, found ahead of time, on any machine (docs/tune.md).

1. Search. Every combination of the choices that leave the model's maths alone (`space`): the mesh's
   factorisations over ICI and DCN, the sharding preset, the remat policy (the named ones and a few custom ones
   from the model's checkpoint names), gradient accumulation and optimizer / parameter offload where the step
   would not fit without them, then the logits block of the best. Each is planned by the roofline
   (`roofline.plan`: milliseconds); what the config checks or the trainer would refuse is dropped with its
   reason, never proposed.
2. Prune. Fit first (the plan's memory within the chip's HBM), then the predicted step time - the plan's
   estimate of what the compile will report (planner/estimate.py), not the roofline's bound (`rank_key`);
   the budget spread over remat policies and layouts (`select`).
3. Compile. The best `budget` candidates, ahead of time for T with the loop correction, through the sweep's
   machinery (planner/sweep.py: results.jsonl - an interrupted search resumes from it -, summary.md,
   sweep.png); ranked by XLA's estimate with the kernels' time, the fastest that fits written as best.yaml, a
   config to train with as it is, and tune.md, the table with why each other candidate lost.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from scaletrain import remat
from scaletrain.config import CONTEXT_ATTENTIONS, MESH_AXES
from scaletrain.errors import ConfigError
from scaletrain.planner import sweep as sweep_lib

PLANS = "plan.jsonl"
BEST = "best.yaml"
REPORT = "tune.md"
PRESETS = ("fsdp", "zero1", "zero2")  # how the state is split over the fsdp axis (docs/sharding.md)
MAX_LOGITS_BLOCK = 2048  # positions: beyond it a block's float32 logits cost memory and save no time


def logits_blocks(seq_len: int) -> list[int]:
    """model.logits_block values tried on the best candidates: the whole sequence (0), an eighth, a quarter and a
    half of it, up to MAX_LOGITS_BLOCK."""
    return [0] + [b for b in (seq_len // 8, seq_len // 4, seq_len // 2) if 1 <= b <= MAX_LOGITS_BLOCK]
MAX_TENSOR = 8  # tensor parallelism stays within a host's chips: its per-layer collectives cannot cross more
# Relief for a step that does not fit as it is: more microbatches; host memory only where nothing else fits -
# the plan does not time host transfers (its hardware table has no sourced host-link bandwidth), so an
# offloading candidate would plan as fast as one that keeps everything on the device.
ACCUMULATION = ({"train.grad_accum_steps": 2}, {"train.grad_accum_steps": 4})
OFFLOAD = ({"optim.offload": True}, {"train.grad_accum_steps": 2, "optim.offload": True}, {"params.offload": True})
SHOWN = 20  # candidates listed in tune.md below the compiled ones
# How far the plan's memory may be from the compile's (docs/tune.md): a candidate planned closer than this to the
# chip's HBM may not fit.
MEMORY_TOLERANCE = 0.10
ACROSS = ("data", "fsdp", "pipeline")  # the mesh axes a search puts across slices (`meshes`)
COMPILED_TIE = 0.01  # compiled step times this close are a tie, broken by the less memory (`winner`)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _factorisations(n: int, axes: tuple[str, ...]) -> Iterator[dict[str, int]]:
    """Every way of writing n as a product of one factor per axis, in order."""
    if len(axes) == 1:
        yield {axes[0]: n}
        return
    for d in _divisors(n):
        for rest in _factorisations(n // d, axes[1:]):
            yield {axes[0]: d, **rest}


def meshes(cfg, chips_per_slice: int, slices: int) -> Iterator[dict[str, int]]:
    """Mesh degrees (every `mesh.` key) for a topology: the slice's chips factored over data, fsdp, tensor (at most
    MAX_TENSOR), for a mixture of experts expert (dividing the experts) and, for a config that splits its sequences
    (mesh.context other than 1: a long-context config), context; the slices over DCN by data, fsdp or - where the
    layers divide - pipeline."""
    m = cfg.model
    ici_axes = (("data", "fsdp", "tensor") + (("expert",) if m.num_experts else ())
                + (("context",) if cfg.mesh.context != 1 else ()))
    dcn_axes = [None] if slices == 1 else [a for a in ACROSS if a != "pipeline" or m.num_layers % slices == 0]
    for dcn in dcn_axes:
        for ici in _factorisations(chips_per_slice, ici_axes):
            if ici["tensor"] > MAX_TENSOR or (m.num_experts and m.num_experts % ici["expert"]):
                continue
            yield {**{f"mesh.{a}": ici.get(a, 1) for a in MESH_AXES},
                   **{f"mesh.dcn_{a}": (slices if a == dcn else 1) for a in MESH_AXES}}


def remat_choices(cfg, offload: bool = False) -> list[dict[str, Any]]:
    """The named policies, then custom ones that keep more than `minimal`: everything but the MLP's (or the
    experts') gate and up projections on the device; everything but up; and everything, gate and up offloaded to
    host memory - the policies between `minimal` and `none` a large batch may still fit. Those that keep
    something in host memory only with `offload`, those that do not only without it."""
    m = cfg.model
    out = [{"remat.policy": p} for p in remat.POLICIES if p != "custom"]
    dense, moe = not m.num_experts or m.moe_every > 1, bool(m.num_experts)
    inputs = ("mlp_gate", "mlp_up") * dense + ("moe_gate", "moe_up") * moe
    absent = {"mlp_gate", "mlp_up", "moe_gate", "moe_up"} - set(inputs)
    ups = tuple(n for n in inputs if n.endswith("_up"))
    for modes in ({n: "remat" for n in inputs}, {n: "remat" for n in ups}, {n: "offload" for n in inputs}):
        # A name the model does not have is left as recomputed (the default): no choice, not in the name.
        custom = {n: "remat" if n in absent else modes.get(n, "device")
                  for n in remat.NAMES if n != "decoder_layer_input"}
        out.append({"remat.policy": "custom", **{f"remat.custom.{n}": mode for n, mode in custom.items()}})
    return [c for c in out if _offloads(c) == offload]


def _offloads(choices: dict[str, Any]) -> bool:
    """Whether a remat choice keeps anything in host memory."""
    policy = choices["remat.policy"]
    modes = remat.NAMED.get(policy, {}) if policy != "custom" else {
        k: v for k, v in choices.items() if k.startswith("remat.custom.")}
    return "offload" in modes.values()


def space(cfg, chips_per_slice: int, slices: int, offload: bool = False) -> Iterator[dict[str, Any]]:
    """The first search's candidates: mesh x preset x remat (`remat_choices`) x, with the sequence split, both
    context attentions (all-gather, ring), at the config's own accumulation, offload and logits block. (Relief and
    logits blocks come after planning: `search`.)"""
    for mesh in meshes(cfg, chips_per_slice, slices):
        fsdp = mesh["mesh.fsdp"] * mesh["mesh.dcn_fsdp"]
        presets = PRESETS if fsdp > 1 else (cfg.sharding.preset,)
        split = mesh["mesh.context"] * mesh["mesh.dcn_context"] > 1
        attentions = CONTEXT_ATTENTIONS if split else (cfg.model.context_attention,)
        for preset, schedule, policy, attention in itertools.product(
                presets, schedules(cfg, mesh["mesh.dcn_pipeline"]), remat_choices(cfg, offload), attentions):
            yield {**mesh, "sharding.preset": preset, **schedule, "model.context_attention": attention, **policy}


def schedules(cfg, stages: int) -> list[dict[str, Any]]:
    """The pipeline schedules searched with stages across the slices: 1F1B, interleaved 1F1B with 2 blocks a
    stage where the layers divide (the lesser bubble, for a little more memory), and zero-bubble (the least
    bubble and no recomputation, for every layer's residuals; docs/pipeline.md); none without."""
    if stages == 1:
        return [{}]
    interleaved = cfg.model.num_layers % (2 * stages) == 0
    return ([{"pipeline.schedule": "1f1b"}]
            + [{"pipeline.schedule": "interleaved_1f1b", "pipeline.repeats": 2}] * interleaved
            + [{"pipeline.schedule": "zero_bubble"}])


# --- search and prune ------------------------------------------------------------------------------------

def _differing(base, choices: dict[str, Any]) -> dict[str, Any]:
    """The choices whose value differs from the base config's: the candidate's name and overrides."""
    from scaletrain.config import get

    return {k: v for k, v in choices.items() if get(base, k) != v}


def evaluate(path: Path, common: tuple[str, ...], base, choices: dict[str, Any], hardware: str,
             dcn_bandwidth: float | None = None) -> dict:
    """One candidate planned (at `dcn_bandwidth` bytes/s per chip across slices, where given: roofline.plan):
    its status ('fits', 'does not fit' or 'refused', with the reason) and the plan."""
    from scaletrain import config
    from scaletrain.planner import roofline

    choices = _differing(base, choices)
    record = {"name": sweep_lib.name(choices), "choices": choices}
    try:
        cfg = config.load(path, [*common, *sweep_lib.overrides(choices)])
        p = roofline.plan(cfg, hardware, dcn_bandwidth)
    except ConfigError as e:
        return {**record, "status": "refused", "reason": str(e)}
    if p["refusals"]:
        return {**record, "status": "refused", "reason": p["refusals"][0]}
    memory = p["memory_per_device_bytes"]["total"]
    sent = p["comm_bytes_per_device"]
    plan = {"step_time_s": p["step_estimate_s"], "bound": p["bound"], "hidden_s": sum(p["time_s"].values()),
            "memory_per_device_bytes": memory, "hbm_capacity_bytes": p["hbm_capacity_bytes"],
            "roofline_s": p["step_time_s"], "bubble": p["pipeline_bubble"],
            "dcn_bytes": sum(v for a, v in sent.items() if a.startswith("dcn_")),
            "ici_bytes": sum(v for a, v in sent.items() if not a.startswith("dcn_")),
            # the axis across the slices, whether the candidate or the base config sets it
            "across": next((a for a, n in p["mesh"]["dcn"].items() if n > 1), None)}
    return {**record, "status": "fits" if p["fits"] else "does not fit", "plan": plan}


def rank_key(record: dict) -> tuple:
    """Fit first, then the predicted step time; among equal times (compute-bound layouts tie) those with
    MEMORY_TOLERANCE of headroom first, by the less time the hidden terms take; those without, by the less
    memory (the likelier to fit)."""
    plan = record.get("plan") or {}
    memory, hidden = plan.get("memory_per_device_bytes", math.inf), plan.get("hidden_s", math.inf)
    marginal = memory > (1 - MEMORY_TOLERANCE) * plan.get("hbm_capacity_bytes", 0)
    return (record["status"] != "fits", plan.get("step_time_s", math.inf), marginal,
            (memory, hidden) if marginal else (hidden, memory))


def search(path: Path, common: tuple[str, ...], hardware: str, budget: int, log: Callable = print) -> list[dict]:
    """Every candidate planned, ranked (rank_key). Stage 1: `space`, each candidate that does not fit again with
    more microbatches (ACCUMULATION); only where none fits, with host offload too (OFFLOAD and the offloading
    remat policies). Stage 2: the best 3 x budget with each of `logits_blocks`."""
    from scaletrain import config
    from scaletrain.facts import hardware as hw

    base = config.load(path, common)
    topo = hw.topology(hardware)
    start = time.perf_counter()
    records: dict[tuple, dict] = {}

    def add(choices: dict[str, Any]) -> dict:
        key = tuple(sorted(_differing(base, choices).items()))
        if key not in records:
            records[key] = evaluate(path, common, base, choices, hardware)
        return records[key]

    def plan_all(candidates: list[dict], reliefs: tuple[dict, ...], what: str) -> None:
        for i, choices in enumerate(candidates):
            if add(choices)["status"] == "does not fit":
                for relief in reliefs:
                    add({**choices, **relief})
            if (i + 1) % 200 == 0:
                log(f"  planned {i + 1} of {len(candidates)} {what} ...")

    primary = list(space(base, topo.chips_per_slice, topo.slices))
    plan_all(primary, ACCUMULATION, "layouts")
    if not any(r["status"] == "fits" for r in records.values()):
        log("nothing fits in device memory: host offload too")
        plan_all(primary + list(space(base, topo.chips_per_slice, topo.slices, offload=True)),
                 OFFLOAD + ACCUMULATION, "layouts with host offload")
    best = sorted((r for r in records.values() if r["status"] == "fits"), key=rank_key)[:3 * budget]
    for record in best:
        for block in logits_blocks(base.data.seq_len):
            add({**record["choices"], "model.logits_block": block})
    ranked = sorted(records.values(), key=rank_key)
    counts = {s: sum(r["status"] == s for r in ranked) for s in ("fits", "does not fit", "refused")}
    log(f"planned {len(ranked)} candidates in {time.perf_counter() - start:.0f} s: {counts['fits']} fit, "
        f"{counts['does not fit']} do not, {counts['refused']} refused by the config checks or the trainer")
    return ranked


def _layout(record: dict) -> tuple:
    """A candidate's choices but its logits block: what the compile budget is spread over."""
    return tuple(sorted((k, v) for k, v in record["choices"].items() if k != "model.logits_block"))


def _policy(record: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in record["choices"].items() if k.startswith("remat.")))


def select(ranked: list[dict], budget: int) -> list[dict]:
    """The `budget` candidates to compile, in the plan's order: first the best of each remat policy, fastest
    policy first, then the next best by the plan - one per layout (`_layout`) throughout. Spread so because
    the plan is least sure where a policy's memory lands (the compile says whether it fits) and ties layouts
    that are all compute-bound (the compile tells them apart), and candidates that differ only in their logits
    block plan within a percent of each other."""
    fits = [r for r in ranked if r["status"] == "fits"]
    layouts, policies, out = set(), set(), []
    for first_of_each_policy in (True, False):
        for record in fits:
            if len(out) == budget:
                break
            if _layout(record) in layouts or (first_of_each_policy and _policy(record) in policies):
                continue
            layouts.add(_layout(record))
            policies.add(_policy(record))
            out.append(record)
    return sorted(out, key=rank_key)


# --- compile and report ----------------------------------------------------------------------------------

def winner(fitting: list[dict]) -> dict | None:
    """The fastest compiled candidate that fits - of those within COMPILED_TIE of the fastest, the one that
    needs the least memory: XLA's estimate is a cost model, not a measurement, and headroom is what a real chip's
    fragmentation and another libtpu's buffer assignment eat first."""
    if not fitting:
        return None
    fastest = min(_compiled_time(r) for r in fitting)
    tied = [r for r in fitting if _compiled_time(r) <= fastest * (1 + COMPILED_TIE)]
    return min(tied, key=lambda r: r["compile"]["hbm_per_device_bytes"])


def _compiled_time(record: dict) -> float | None:
    """The step time a compiled candidate is ranked by: XLA's estimate, or the plan's estimate of it where the
    compile says XLA's is not the step's (zero-bubble: aot.time_warning) - XLA's would rank it last whatever its
    step."""
    if _by_plan(record):
        return (record.get("plan") or {}).get("step_estimate_s")
    return sweep_lib.xla_time(record.get("compile") or {})


def _by_plan(record: dict) -> bool:
    return (record.get("compile") or {}).get("xla_time_comparable") is False


def run(path: str | Path, common: tuple[str, ...], topology: str, budget: int, out: str | Path,
        loop_correction: bool = True, log: Callable = print) -> dict | None:
    """The whole search (module docstring). Returns the best compiled record, or None when none fits."""
    path, out = Path(path).resolve(), Path(out)
    spec = sweep_lib.Sweep(base=path, common=tuple(common), stages=("plan", "compile"), hardware=topology,
                           topology=topology, loop_correction=loop_correction, steps=1, variants=())
    earlier(spec, out)
    ranked = search(path, common, topology, budget, log)
    chosen = select(ranked, budget)
    spec = dataclasses.replace(spec, variants=tuple(r["choices"] for r in chosen))
    out.mkdir(parents=True, exist_ok=True)
    search_id = sweep_lib.identity(spec)
    with (out / PLANS).open("w") as f:
        f.writelines(json.dumps({**r, "search": search_id}) + "\n" for r in ranked)
    if not chosen:
        (out / REPORT).write_text(report(ranked, [], None, spec, budget))
        return None
    log(f"compiling the best {len(chosen)} for {topology}"
        f"{' (three compiles each: the loop correction)' if loop_correction else ''}:")
    compiled = sweep_lib.run(spec, out, log=log)
    by_name = {r["name"]: r for r in compiled}
    fitting = [r for r in compiled if r["status"] == "ok" and (r.get("compile") or {}).get("fits")
               and _compiled_time(r) is not None]
    best = winner(fitting)
    if best is not None:
        (out / BEST).write_text(best_yaml(path, common, best, topology, budget))
    (out / REPORT).write_text(report(ranked, [by_name[r["name"]] for r in chosen], best, spec, budget))
    return best


def earlier(spec: sweep_lib.Sweep, out: Path) -> None:
    """Refuses (ConfigError), before the search, an `out` that holds another search's results - another base
    config, --set, topology or loop correction: its compiles (sweep.earlier), or its plans where it compiled
    nothing. Its best.yaml and tune.md would be left beside this search's, or replaced by them."""
    sweep_lib.earlier(spec, out)
    plans = out / PLANS
    first = plans.read_text().partition("\n")[0] if plans.is_file() else ""
    if not first:
        return
    try:
        other = json.loads(first)["search"]
    except (json.JSONDecodeError, KeyError, TypeError):
        other = None
    differ = [k for k, v in sweep_lib.identity(spec).items() if not isinstance(other, dict) or other.get(k) != v]
    if differ:
        raise ConfigError(f"{plans} holds the plans of another search (different {', '.join(differ)}); use a new "
                          f"--out or delete the folder")


def best_yaml(path: Path, common: tuple[str, ...], best: dict, topology: str, budget: int) -> str:
    """The base config file's own mapping with the common overrides and the winner's choices set: a config to
    train with as it is, its choices and the search's figures in a comment."""
    from scaletrain.config import parse_override, read_mapping

    tree = read_mapping(path, "config file", "configs/llama_tiny.yaml")
    for text in best["overrides"]:
        key, value = parse_override(text)
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    comp, plan = best["compile"], best["plan"]
    how = ("the plan's estimate: XLA's is not this schedule's step" if _by_plan(best) else
           f"XLA's estimate{', loop-corrected' if comp['loop_corrected'] else ''}, kernels counted")
    header = [f"Found by `python -m scaletrain tune --config {path.name} --topology {topology} --budget {budget}` "
              f"on {datetime.date.today()} (docs/tune.md).",
              f"Choices over {path.name}: {' '.join(best['overrides']) or 'none (the config as it is)'}.",
              f"Compiled for {topology}: {comp['hbm_per_device_bytes'] / 2**30:.2f} GiB per chip, "
              f"{_compiled_time(best):.4g} s per step ({how}); "
              f"planned {plan['memory_per_device_bytes'] / 2**30:.2f} GiB, "
              f"{plan.get('step_estimate_s', plan['step_time_s']):.4g} s."]
    return "".join(f"# {line}\n" for line in header) + yaml.safe_dump(tree, sort_keys=False)


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def verdict(record: dict, best: dict | None) -> str:
    """Why a compiled candidate lost (or that it won)."""
    if record["status"] != "ok":
        return f"{record['status']}: {record['error']}"
    comp = record["compile"]
    if not comp["fits"]:
        return (f"does not fit: compiled {_gib(comp['hbm_per_device_bytes'])} GiB of "
                f"{_gib(comp['hbm_capacity_bytes'])}")
    if record is best:
        return "**best**"
    if best is None or _compiled_time(record) is None:
        return "no estimate"
    change = _compiled_time(record) / _compiled_time(best) - 1
    how = "compiled" if not (_by_plan(record) or _by_plan(best)) else "the plan's estimate for zero-bubble"
    if change < COMPILED_TIE:
        return (f"{change:+.1%} ({how}): within {COMPILED_TIE:.0%}, and the best needs "
                f"{_gib(best['compile']['hbm_per_device_bytes'])} GiB, not {_gib(comp['hbm_per_device_bytes'])}")
    return f"{change:+.1%} slower ({how})"


def across_slices(ranked: list[dict]) -> list[str]:
    """tune.md's lines on a multi-slice topology: the best candidate that fits with each axis across the slices,
    by the plan (`plan --across-slices` adds every pipeline schedule and where the answer flips)."""
    best: dict[str, tuple[int, dict]] = {}
    for k, r in enumerate(ranked, 1):
        across = (r.get("plan") or {}).get("across")
        if r["status"] == "fits" and across and across not in best:
            best[across] = (k, r)
    if len(best) < 2:
        return []
    first = min(r["plan"]["step_time_s"] for _, r in best.values())
    return ["", "## Across the slices: the best of each by the plan", "",
            "| across | plan rank | candidate | predicted s | vs the best | predicted GiB |",
            "|---|---|---|---|---|---|",
            *[f"| {a} | {k} | {r['name']} | {_s(r['plan']['step_time_s'])} | "
              f"{r['plan']['step_time_s'] / first - 1:+.1%} | {_gib(r['plan']['memory_per_device_bytes'])} |"
              for a, (k, r) in sorted(best.items(), key=lambda kv: kv[1][0])]]


def report(ranked: list[dict], compiled: list[dict], best: dict | None, spec: sweep_lib.Sweep, budget: int) -> str:
    """tune.md: the compiled candidates ranked by the compiled estimate, then the best of the rest by the plan,
    and what the search refused and why."""
    counts = {s: sum(r["status"] == s for r in ranked) for s in ("fits", "does not fit", "refused")}
    lines = [f"# tune: {spec.base.name} on {spec.topology}", "",
             f"{len(ranked)} candidates planned: {counts['fits']} fit by the plan, {counts['does not fit']} do not, "
             f"{counts['refused']} refused by the config checks or the trainer. The best {len(compiled)} by the "
             f"plan (budget {budget}) compiled ahead of time"
             f"{' with the loop correction' if spec.loop_correction else ''}; step times are XLA's estimate with "
             f"the kernels' time added where XLA cannot see them. Common overrides: {' '.join(spec.common) or 'none'}.",
             "", "## Compiled", "",
             "| rank | candidate | predicted s | predicted GiB | compiled s | compiled GiB | verdict |",
             "|---|---|---|---|---|---|---|"]
    order = sorted(compiled, key=lambda r: (verdict(r, best) != "**best**", r["status"] != "ok",
                                            not (r.get("compile") or {}).get("fits"),
                                            _compiled_time(r) or math.inf))
    for rank, r in enumerate(order, 1):
        plan, comp = r.get("plan") or {}, r.get("compile") or {}
        compiled_s = f"{_s(_compiled_time(r))} (the plan's)" if _by_plan(r) else _s(_compiled_time(r))
        lines.append(f"| {rank} | {r['name']} | {_s(plan.get('step_estimate_s', plan.get('step_time_s')))} | "
                     f"{_gib(plan.get('memory_per_device_bytes'))} | {compiled_s} | "
                     f"{_gib(comp.get('hbm_per_device_bytes'))} | {verdict(r, best)} |")
    warning = next((r["compile"]["warnings"][0] for r in compiled if _by_plan(r)), None)
    if warning:
        lines += ["", f"Zero-bubble's compiled s is the plan's estimate of the compiled step, and it is ranked by "
                      f"that: {warning}."]
    names = {r["name"] for r in compiled}
    layouts = {_layout(r) for r in ranked if r["name"] in names}
    rest = [(k, r) for k, r in enumerate(ranked, 1) if r["status"] == "fits" and r["name"] not in names][:SHOWN]
    lines += ["", f"## Not compiled: the next {len(rest)} by the plan", "",
              "| plan rank | candidate | predicted s | bound | predicted GiB | why it lost |",
              "|---|---|---|---|---|---|"]
    for k, r in rest:
        why = ("a compiled layout with another logits block" if _layout(r) in layouts
               else f"predicted slower than the {len(compiled)} compiled")
        lines.append(f"| {k} | {r['name']} | {_s(r['plan']['step_time_s'])} | {r['plan']['bound']} | "
                     f"{_gib(r['plan']['memory_per_device_bytes'])} | {why} |")
    lines += across_slices(ranked)
    misfits = sorted((r for r in ranked if r["status"] == "does not fit"),
                     key=lambda r: r["plan"]["memory_per_device_bytes"])
    if misfits:
        r = misfits[0]
        lines += ["", f"{len(misfits)} candidates do not fit by the plan; the smallest, {r['name']}, needs "
                      f"{_gib(r['plan']['memory_per_device_bytes'])} GiB of {_gib(r['plan']['hbm_capacity_bytes'])}."]
    reasons: dict[str, int] = {}
    for r in ranked:
        if r["status"] == "refused":
            reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    if reasons:
        lines += ["", "Refused (never proposed), by reason:", ""]
        lines += [f"- {n} x {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
    lines += ["", f"Every candidate's plan: {PLANS}; every compile: {sweep_lib.RESULTS}, summary.md, sweep.png."]
    return "\n".join(lines) + "\n"
