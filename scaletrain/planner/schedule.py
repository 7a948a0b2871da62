"""The pipeline's schedule as `plan` shows it: the trainer's own timeline per stage, and its bubble."""

from __future__ import annotations

from scaletrain.parallel import pipeline as pipeline_lib
from scaletrain.parallel import pipeline_1f1b, pipeline_zb
from scaletrain.planner import comms
from scaletrain.train.runner import Runner


def bubble(runner: Runner) -> float:
    """The share of the step a stage idles: zero-bubble's from its own table (pipeline_zb.bubble), the others'
    by comms.bubble."""
    if runner.schedule == pipeline_zb.SCHEDULE:
        return pipeline_zb.bubble(runner.stages, runner.microbatches)
    return comms.bubble(runner.stages, runner.microbatches, runner.repeats)


def timeline(runner: Runner, bubble: float) -> dict | None:
    """The pipeline's schedule where there are stages: its timeline per stage (ticks of `F3`, `B3`, `.`: the
    trainer's own, pipeline.timeline, pipeline_1f1b.timeline or pipeline_zb.timeline)."""
    stages, n, repeats = runner.stages, runner.microbatches, runner.repeats
    if stages == 1:
        return None
    if runner.schedule == pipeline_zb.SCHEDULE:
        ticks = pipeline_zb.timeline(stages, n)
    elif runner.schedule in pipeline_1f1b.SCHEDULES:
        ticks = pipeline_1f1b.timeline(stages, n, repeats)
    else:
        ticks = pipeline_lib.timeline(stages, n, repeats)
    return {"schedule": runner.schedule, "stages": stages, "microbatches": n, "repeats": repeats,
            "bubble": bubble,
            "timeline": [[tick[p] for tick in ticks] for p in range(stages)]}
