"""`python -m scaletrain plan --config C --hardware SxCHIP:DIMS --across-slices`: data parallelism, FSDP or a pipeline
across the slices - which wins, by how much, and where the answer flips (docs/pipeline.md, "When pipelining pays").

Every layout keeps the config's own mesh inside each slice and puts one mesh axis across the slices:
- data: each slice a replica, the gradients reduced over DCN once a step;
- fsdp: the state split over every chip, FSDP's gathers and reductions crossing DCN at every layer;
  both accumulating the gradients of MICROBATCHES microbatches (and of the config's train.grad_accum_steps);
- pipeline: a stage of the layer stack on each slice, only stage activations crossing DCN, at the price of a
  bubble - every schedule the trainer runs (GPipe, circular, 1F1B, interleaved 1F1B, zero-bubble; all but GPipe
  and circular also gathering the FSDP weights once a step, 1F1B and interleaved keeping only stage inputs), with
  the blocks a stage of SCHEDULES and MICROBATCHES per stage (its microbatches replacing accumulation).
Each layout is planned by roofline.plan - the plan `plan` prints and `tune` ranks, the trainer's own checks
refusing what it would refuse - and ranked as `tune` ranks (tune.rank_key: fit first, then the plan's estimate of
the compiled step).

The verdict: the best layout of each family and how far the others are behind it; the DCN bandwidth per chip at
which the winner would change between a pipeline and not (every layout's step is non-increasing in it: found on a
grid of factors of two, then by bisection); and the winner at other slice counts, the config's tokens per chip
kept (the global batch scaled with the slices).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scaletrain.config import MESH_AXES
from scaletrain.errors import ConfigError
from scaletrain.facts import hardware as hw
from scaletrain.parallel import pipeline_1f1b
from scaletrain.planner import tune
from scaletrain.planner.roofline import _seconds, _si

FAMILIES = tune.ACROSS
SCHEDULES = (("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4),
             ("zero_bubble", 1))
MICROBATCHES = (1, 2, 4, 8)  # a pipeline's per stage; data parallelism's and FSDP's accumulated
FACTORS = tuple(2.0 ** k for k in range(-12, 7))  # of the chip's DCN bandwidth, where the flip is looked for
BISECTIONS = 10  # halvings of the bracket, in log space: within 2^(1/1024) of the flip
SLICE_COUNTS = (2, 4, 8)


def layouts(cfg, slices: int) -> list[tuple[str, dict[str, Any]]]:
    """(family, choices) of every layout across `slices` slices: the config's mesh inside each slice, one axis
    across them."""
    def across(axis: str) -> dict[str, Any]:
        return {f"mesh.dcn_{a}": slices if a == axis else 1 for a in MESH_AXES}

    # Microbatches for every family, or the comparison is rigged: data parallelism and FSDP accumulate
    # gradients over them (a step that fits no other way), a pipeline schedules them instead of accumulating.
    accumulations = sorted({*MICROBATCHES, cfg.train.grad_accum_steps})
    out = [(family, {**across(family), "train.grad_accum_steps": n})
           for family in FAMILIES if family != "pipeline" for n in accumulations]
    for schedule, repeats in SCHEDULES:
        for per_stage in MICROBATCHES:
            choices = {**across("pipeline"), "train.grad_accum_steps": 1, "pipeline.schedule": schedule,
                       "pipeline.repeats": repeats, "pipeline.microbatches": per_stage * slices}
            out.append(("pipeline", choices))
            if schedule in pipeline_1f1b.OWN_GRADIENTS:  # gathering once: faster, more memory
                out.append(("pipeline", {**choices, "pipeline.gather_weights": "once"}))
            if schedule in pipeline_1f1b.SCHEDULES:  # the leaner way
                out.append(("pipeline", {**choices, "pipeline.keep": "stage_inputs"}))
    return out


def planned(path: Path, common: tuple[str, ...], hardware: str, dcn_bandwidth: float | None = None,
            batch: int | None = None, only: list[tuple[str, dict]] | None = None) -> list[dict]:
    """Every layout for `hardware` (or `only` these (family, layout) pairs) planned (tune.evaluate), with its
    family and its whole layout (the record's choices are those that differ from the config); `batch` in place of
    the config's train.global_batch."""
    from scaletrain import config

    common = (*common, *([f"train.global_batch={batch}"] if batch else ()))
    base = config.load(path, list(common))
    topo = hw.topology(hardware)
    return [{**tune.evaluate(path, common, base, choices, hardware, dcn_bandwidth), "family": family,
             "layout": choices} for family, choices in (only or layouts(base, topo.slices))]


def best(records: list[dict], families=FAMILIES) -> dict | None:
    """The best record of these families, as tune ranks (fit first, then the predicted step); None if all are
    refused."""
    allowed = [r for r in records if r["family"] in families and r["status"] != "refused"]
    return min(allowed, key=tune.rank_key) if allowed else None


def _pipeline_wins(records: list[dict]) -> bool | None:
    winner = best(records)
    return None if winner is None else winner["family"] == "pipeline"


def flip(path: Path, common: tuple[str, ...], hardware: str, records: list[dict], bandwidth: float) -> float | None:
    """The DCN bandwidth per chip (bytes/s) nearest to `bandwidth` (by ratio) across which a pipeline starts or
    stops winning, or None when the answer is the same at every factor of FACTORS; `records`: the layouts planned
    at `bandwidth`. Both ways are searched: a pipeline sends the fewest bytes over DCN only where its stage
    activations are smaller than the gradients data parallelism reduces - a small model's are not."""
    wins = _pipeline_wins(records)
    # What is refused, and what fits, does not depend on the bandwidth: those that fit are all that can win
    # (or, where none does, all that are not refused).
    allowed = [r for r in records if r["status"] != "refused"]
    contenders = [(r["family"], r["layout"]) for r in [r for r in allowed if r["status"] == "fits"] or allowed]

    def pipeline_wins(factor: float) -> bool | None:
        return _pipeline_wins(planned(path, common, hardware, bandwidth * factor, only=contenders))

    inside = {True: 1.0, False: 1.0}  # per side (faster, slower): the factor nearest the flip still at `wins`
    for factor in sorted((f for f in FACTORS if f != 1), key=lambda f: max(f, 1 / f)):
        side = factor > 1
        if pipeline_wins(factor) == wins:
            inside[side] = factor
            continue
        near = inside[side]
        for _ in range(BISECTIONS):
            mid = (near * factor) ** 0.5
            near, factor = (mid, factor) if pipeline_wins(mid) == wins else (near, mid)
        return bandwidth * (near * factor) ** 0.5
    return None


def verdict(path: str | Path, common: tuple[str, ...], hardware: str) -> dict:
    """The comparison the module docstring describes, as plain JSON types. Raises ConfigError for a single-slice
    topology or one where the trainer refuses every layout."""
    from scaletrain import config

    path, topo = Path(path).resolve(), hw.topology(hardware)
    if topo.slices == 1:
        raise ConfigError(f"--across-slices compares layouts across slices; --hardware {hardware} is one slice. "
                          f"Expected SLICESxCHIP:DIMS, e.g. 2x{hardware}")
    records = planned(path, common, hardware)
    winner = best(records)
    if winner is None:
        raise ConfigError(f"every layout across {topo.slices} slices is refused; the first: {records[0]['reason']}")
    pipelines: dict[str, list[dict]] = {}
    for r in records:
        if r["family"] == "pipeline":
            pipelines.setdefault(f"{r['layout']['pipeline.schedule']} x{r['layout']['pipeline.repeats']}", []).append(r)
    schedules = {key: b for key, group in pipelines.items() if (b := best(group)) is not None}
    refused = next((r["reason"] for r in records if r["family"] == "pipeline" and r["status"] == "refused"), None)
    bandwidth = topo.chip.dcn_bandwidth
    # Without a pipeline the trainer accepts there is nothing to flip to.
    at = flip(path, common, hardware, records, bandwidth) if schedules else None
    batch = config.load(path, list(common)).train.global_batch
    by_slices = {}
    for n in SLICE_COUNTS:
        other = f"{n}x{topo.chip.name}:{'x'.join(map(str, topo.dims))}"
        there = planned(path, common, other, batch=batch * n // topo.slices) if n != topo.slices else records
        by_slices[n] = {f: best(there, (f,)) for f in FAMILIES}
        by_slices[n]["winner"] = best(there)
    return {"hardware": str(topo), "slices": topo.slices, "dcn_bandwidth": bandwidth, "winner": winner,
            "best": {f: best(records, (f,)) for f in FAMILIES}, "schedules": schedules,
            "pipeline_wins": winner["family"] == "pipeline", "pipeline_refused": None if schedules else refused,
            "flip_dcn_bandwidth": at,
            "pipeline_wins_below_flip": None if at is None else (at < bandwidth) != (winner["family"] == "pipeline"),
            "by_slices": by_slices, "refused": sum(r["status"] == "refused" for r in records),
            "planned": len(records)}


def _describe(r: dict) -> str:
    c = r["layout"]
    if r["family"] != "pipeline":
        n = c["train.grad_accum_steps"]
        return f"{r['family']} across the slices, {n} microbatch{'es' if n > 1 else ''}"
    once = (", gathering once" if c.get("pipeline.gather_weights") == "once" else "") + (
        ", keeping stage inputs" if c.get("pipeline.keep") == "stage_inputs" else "")
    repeats = f" x{c['pipeline.repeats']}" if c["pipeline.repeats"] > 1 else ""
    return f"pipeline: {c['pipeline.schedule']}{repeats}, {c['pipeline.microbatches']} microbatches{once}"


def _row(r: dict) -> str:
    p = r["plan"]
    fits = "" if r["status"] == "fits" else " (does not fit)"
    return (f"| {_describe(r)} | {_seconds(p['step_time_s'])} | {_seconds(p['roofline_s'])}, {p['bound']} | "
            f"{100 * p['bubble']:.0f}% | {tune._gib(p['memory_per_device_bytes'])} GiB{fits} | "
            f"{_si(p['dcn_bytes'], 'B')} | {_si(p['ici_bytes'], 'B')} |")


def _behind(r: dict | None, winner: dict) -> str:
    if r is None:
        return "refused"
    if r["status"] != "fits":
        return f"does not fit ({tune._gib(r['plan']['memory_per_device_bytes'])} GiB)"
    return f"{r['plan']['step_time_s'] / winner['plan']['step_time_s'] - 1:+.1%}"


def format_table(v: dict) -> str:
    winner, wins = v["winner"], v["pipeline_wins"]
    lines = [f"Across {v['slices']} slices ({v['hardware']}, DCN {v['dcn_bandwidth'] / 1e9:.2f} GB/s a chip): "
             f"{v['planned']} layouts planned, {v['refused']} refused by the trainer's checks; the best of each.",
             "", "| across the slices | step (plan's estimate) | roofline, bound | bubble | HBM a chip | "
                 "DCN a chip a step | ICI a chip a step |", "|---|---|---|---|---|---|---|"]
    shown = [*(v["best"][f] for f in FAMILIES if f != "pipeline"), *sorted(v["schedules"].values(), key=tune.rank_key)]
    lines += [_row(r) for r in shown if r is not None]
    others = [f"{f}: {_behind(v['best'][f], winner)}" for f in FAMILIES if f != winner["family"]]
    lines += ["", f"Verdict: {_describe(winner)} ({_seconds(winner['plan']['step_time_s'])} a step"
                  f"{'' if winner['status'] == 'fits' else ', but nothing fits'}); the best of the others: "
                  f"{', '.join(others)}."]
    at = v["flip_dcn_bandwidth"]
    if v["pipeline_refused"]:
        lines.append(f"No pipeline: the trainer refuses every one ({v['pipeline_refused']}).")
    elif at is None:
        lines.append(f"No flip from {min(FACTORS):g}x to {max(FACTORS):g}x this DCN bandwidth (the range searched): "
                     f"{'a pipeline wins' if wins else 'no pipeline wins'} throughout.")
    else:
        below = "a pipeline" if v["pipeline_wins_below_flip"] else "no pipeline"
        above = "no pipeline" if v["pipeline_wins_below_flip"] else "a pipeline"
        lines.append(f"Flip: {below} wins below {at / 1e9:.3g} GB/s of DCN a chip, {above} above it "
                     f"({at / v['dcn_bandwidth']:.3g}x this chip's).")
    counts = []
    for n, b in v["by_slices"].items():
        w = b["winner"]
        if w is None:
            counts.append(f"{n}: every layout refused")
            continue
        rest = ", ".join(f"{f} {_behind(b[f], w)}" for f in FAMILIES if f != w["family"])
        counts.append(f"{n}: {_describe(w)}" + (f" ({rest})" if rest else ""))
    lines += ["", "By slice count, the tokens per chip kept:", *[f"- {c}" for c in counts]]
    return "\n".join(lines)
