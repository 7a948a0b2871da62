"""What a run says when it starts: a resume that moves the learning-rate schedule says how (and
optim.schedule_steps trains longer without moving it); the start-up line names a pipeline's schedule."""

import json

import pytest

from scaletrain import config
from scaletrain.errors import ConfigError
from scaletrain.train import optim, trainer
from tests.conftest import tiny_overrides


def _run(run_dir, capsys, **extra) -> tuple[str, str, dict[int, float]]:
    """trainer.run of the tiny model: (stdout, stderr, each step's learning rate in metrics.jsonl)."""
    cfg = config.load(None, tiny_overrides(run_dir, **{"mesh.fsdp": -1, "optim.warmup_steps": 2,
                                                       "checkpoint.async_save": False, **extra}))
    assert trainer.run(cfg) == 0
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return out, err, {r["step"]: r["learning_rate"] for r in records}


def _rate(steps: int, step: int, schedule_steps: int = 0) -> float:
    cfg = config.load(None, tiny_overrides("unused", steps=steps, **{"optim.warmup_steps": 2,
                                                                     "optim.schedule_steps": schedule_steps}))
    return float(optim.schedule(cfg.optim, steps)(step))


def test_a_resume_says_how_it_moves_the_schedule_and_schedule_steps_keeps_it(tmp_path, capsys):
    run = tmp_path / "run"
    out, err, _ = _run(run, capsys, steps=4)
    assert "resuming with" not in out + err

    # Longer: the cosine would stretch over 8 steps, so the rate would jump up from the 4-step schedule's end.
    trainer._schedule_change(config.load(None, tiny_overrides(run, steps=8, **{"optim.warmup_steps": 2})), run, 4,
                             main=True)
    before, after = _rate(4, 4), _rate(8, 4)
    assert after > 2 * before
    assert capsys.readouterr() == ("", f"warning: resuming with steps 4 -> 8: the learning rate from step 5 is "
                                       f"{after:.3g}, not {before:.3g} (optim.schedule_steps=4 keeps the schedule's "
                                       f"old length)\n")

    # Longer with the schedule held at 4 steps: steps 5-8 go on at its final rate.
    out, err, rates = _run(run, capsys, steps=8, **{"optim.schedule_steps": 4})
    assert [line for line in out.splitlines() if "resuming" in line] == [
        f"scaletrain: resuming with steps 4 -> 8, optim.schedule_steps 0 -> 4: the learning rate from step 5 is "
        f"{before:.3g}, as before"]
    assert "resuming" not in err
    assert [rates[s] for s in range(5, 9)] == pytest.approx([before] * 4)
    assert before == pytest.approx(3e-3 * 0.1)  # the schedule's end: learning_rate x min_lr_ratio


def test_schedule_change_names_each_key():
    then = config.load(None, ["steps=100"]).to_dict()
    del then["optim"]["schedule_steps"]  # a checkpoint saved before the key existed
    now = config.load(None, ["steps=100", "optim.learning_rate=1e-3"]).to_dict()
    line, moved = optim.schedule_change(then, now, 50)
    assert moved and line.startswith("optim.learning_rate 0.003 -> 0.001: the learning rate from step 51 is ")
    assert "schedule_steps" not in line  # the length did not change: no hint about it
    assert optim.schedule_change(then, config.load(None, ["steps=100"]).to_dict(), 50) is None  # nothing moved
    assert optim.schedule_change({"steps": 10}, now, 5) is None  # a config without the optimizer's keys


def test_schedule_steps_is_checked():
    with pytest.raises(ConfigError, match="optim.schedule_steps must be >= 0, got -1"):
        config.load(None, ["optim.schedule_steps=-1"])


@pytest.mark.parametrize("schedule, expected", [
    ("gpipe", "pipeline gpipe, 2 stages x 4 microbatches"),
    ("circular", "pipeline circular, 2 stages x 4 microbatches, 2 blocks of layers a stage"),
])
def test_the_start_up_line_names_a_pipeline(schedule, expected):
    cfg = config.load(None, tiny_overrides("unused", **{
        "mesh.pipeline": 2, "mesh.fsdp": 4, "train.global_batch": 16, "model.num_layers": 4,
        "pipeline.schedule": schedule, "pipeline.microbatches": 4,
        "pipeline.repeats": 2 if schedule == "circular" else 1}))
    line = trainer.describe(cfg, trainer.build(cfg), "starting at step 0")
    assert f"devices (fsdp=4 x pipeline=2, fsdp; {expected}); starting at step 0" in line
    plain = config.load(None, tiny_overrides("unused", **{"mesh.fsdp": -1}))
    assert "pipeline" not in trainer.describe(plain, trainer.build(plain), "starting at step 0")
