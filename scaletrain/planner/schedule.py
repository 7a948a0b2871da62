"""The pipeline's schedule as `plan` shows it: the trainer's own timeline per stage, and its bubble."""

from __future__ import annotations

from scaletrain.parallel import pipeline as pipeline_lib
from scaletrain.parallel import pipeline_1f1b, pipeline_zb
from scaletrain.planner import comms
from scaletrain.train.runner import Runner


def bubble(runner: Runner, cfg=None, chip: str | None = None) -> float:
    """The share of the step a stage idles: zero-bubble's from its own table, each tick as long as its costliest
    slot (pipeline_zb.bubble; the slots' costs `slot_costs` of config `cfg` on `chip`, alike without one), the
    others' by comms.bubble."""
    if runner.schedule == pipeline_zb.SCHEDULE:
        costs = slot_costs(cfg, chip) if cfg is not None else (1.0, 1.0, 1.0)
        return pipeline_zb.bubble(runner.stages, runner.microbatches, costs)
    return comms.bubble(runner.stages, runner.microbatches, runner.repeats)


def slot_costs(cfg, chip: str | None = None) -> tuple[float, float, float]:
    """FLOPs per token of a layer in zero-bubble's forward, input and weight slots: the matmuls in each (their
    input- and weight-side transposes in the input and weight slots), attention's forward in the first and its
    backward, as executed (roofline.ATTENTION_PASSES), in the second."""
    from scaletrain.planner import roofline  # which imports this module

    forward = roofline.forward_flops(cfg.model, cfg.data.seq_len)
    attention = forward.pop("attention")
    backward = roofline.ATTENTION_PASSES[cfg.model.attention][1]
    matmuls = sum(forward.values())
    return matmuls + attention * roofline.attention_pass(cfg, chip), matmuls + attention * backward, matmuls


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
