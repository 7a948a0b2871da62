"""The loss-spike rule (train.spike.*, docs/health.md): a data source yields a pathological batch at a known
position - every target a token the data never holds - and the run warns, drops that step's update, or rolls back
and leaves the batch out, as configured; a rollback's run then equals, loss for loss, a run that never saw it."""

import json
import math

import numpy as np
import pytest

from scaletrain.train.metrics import MetricsLog
from scaletrain.train.spike import Spike, SpikeRule
from tests.conftest import run_main, tiny_overrides

STEPS, EVERY, BAD = 9, 3, 7  # saves at 3, 6, 9; the 7th batch is the bad one: step 7's in a run that meets it
VOCAB = 384


class _Stream:
    """The training batches with those at `positions` (counted from 1 over the whole stream) made pathological,
    or, with `drop`, left out. Its position is part of its state, so a checkpoint's data position holds it."""

    def __init__(self, inner, positions, drop=False):
        self.inner, self.positions, self.drop, self.position = inner, positions, drop, 0
        self.dropped = inner.dropped  # the examples the source left out (none: a text stream)

    def __iter__(self):
        return self

    def __next__(self):
        while True:
            batch = next(self.inner)
            self.position += 1
            if self.position not in self.positions:
                return batch
            if not self.drop:
                return dict(batch, targets=np.full_like(batch["targets"], VOCAB - 1))

    def get_state(self):
        return {"inner": self.inner.get_state(), "position": self.position}

    def set_state(self, state):
        self.inner.set_state(state["inner"])
        self.position = state["position"]


def _train(tmp_path, monkeypatch, capfd, name, positions, drop=False, **extra):
    from scaletrain.data import loader

    make = loader.make_iterator
    monkeypatch.setattr(loader, "make_iterator", lambda *a, **k: _Stream(make(*a, **k), positions, drop))
    sets = tiny_overrides(tmp_path / name, **{"mesh.fsdp": -1, "steps": STEPS, "checkpoint.every_steps": EVERY,
                                              "train.spike.window": 3, "train.spike.factor": 1.1, **extra})
    result = run_main(["--config", "configs/llama_tiny.yaml", "--cpu-devices", "8"]
                      + [a for s in sets for a in ("--set", s)], capfd)
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return result, [r for r in records if "event" not in r], [r for r in records if "event" in r]


def test_the_rule_judges_each_step_by_the_window_two_steps_back():
    rule = SpikeRule("skip", factor=2.0, window=3)
    for step, loss in enumerate([5.0, 4.0, 3.0, 2.0], start=1):
        assert math.isinf(rule.dispatched(step))  # fewer than 3 losses up to step - 2: no rule yet
        assert rule.judge(step, loss, applied=True) is None
    # Step 5's ceiling: the median of steps 1-3 (step 4 is read only after step 5 is dispatched).
    assert rule.dispatched(5) == pytest.approx(8.0)
    spike = rule.judge(5, 9.0, applied=False)
    assert spike is not None and spike.median == 4.0 and spike.ceiling == pytest.approx(8.0)
    assert rule.dispatched(6) == pytest.approx(6.0)  # steps 2-4: the dropped step 5 is not in the window
    saved = rule.state()
    rule.restore(None)
    assert math.isinf(rule.dispatched(6))
    rule.restore(json.loads(json.dumps(saved)))
    assert rule.dispatched(6) == pytest.approx(6.0)
    warn = SpikeRule("warn", factor=2.0, window=1)
    warn.judge(1, 1.0, applied=True)
    assert math.isinf(warn.dispatched(3))  # the step gets no ceiling; the host still judges it
    assert warn.judge(3, 2.5, applied=True) is not None


def _step(log, step):
    log.log({"step": step, "loss": 5.0, "tokens_per_sec": 1.0, "step_time_s": 1.0, "mfu": None})


def test_a_rollback_keeps_every_event_and_drops_the_steps_it_redoes(tmp_path, capfd):
    """Two rollbacks to step 6's checkpoint, a straggler named between them: the steps redone have one record
    each, and every event stays - none recurs in the redo (the spike's batch is left out, the straggler stays
    named) - so status counts them all. A resume drops the events of the steps it redoes, which record theirs
    anew."""
    log = MetricsLog(str(tmp_path), STEPS, 0, enabled=True, tensorboard=False)
    straggler = {"step": BAD, "event": "straggler", "process": 1, "batch_s": 2.0, "median_batch_s": 0.1,
                 "step_time_s": 0.5}
    for step in range(1, BAD + 1):
        _step(log, step)
    log.event(straggler)
    for spiked in (BAD, BAD + 1):
        log.rewind(BAD - 1)
        log.event(Spike(spiked, 9.0, 5.0, 5.5).record("rollback", to_step=BAD - 1))
        for step in range(BAD, spiked + 1):
            _step(log, step)
    for step in range(BAD + 2, STEPS + 1):
        _step(log, step)
    log.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "event" not in r] == list(range(1, STEPS + 1))
    assert [(r["event"], r["step"]) for r in records if "event" in r] == [
        ("straggler", BAD), ("loss_spike_rollback", BAD), ("loss_spike_rollback", BAD + 1)]
    (tmp_path / "config.yaml").write_text(f"steps: {STEPS}\n")  # what marks a run directory for status
    report = run_main(["status", str(tmp_path), "--plot", str(tmp_path / "loss.png")], capfd, module=True)
    assert "  health: 2 loss spike(s) (rollback; newest at step 8: loss 9.0000, 1.80x the median); straggler: " \
           "process 1 at step 7 " in report.stdout, report.stdout
    MetricsLog(str(tmp_path), STEPS, BAD - 1, enabled=True, tensorboard=False).close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, BAD))


@pytest.fixture(scope="module")
def never_saw_it(tmp_path_factory):
    """The run whose data lacks the bad batch: the one a rollback must equal."""
    monkeypatch = pytest.MonkeyPatch()
    try:
        _, records, events = _train(tmp_path_factory.mktemp("spike"), monkeypatch, None, "reference", {BAD},
                                    drop=True)
    finally:
        monkeypatch.undo()
    assert not events
    return [r["loss"] for r in records]


def test_a_rollback_leaves_the_bad_batch_out(tmp_path, monkeypatch, capfd, never_saw_it):
    result, records, events = _train(tmp_path, monkeypatch, capfd, "rollback", {BAD},
                                     **{"train.spike.action": "rollback"})
    assert result.returncode == 0, result.stderr
    # Step 7 met the bad batch, was judged a spike, and the run went back to step 6's checkpoint: step 7 then
    # trained on the batch after it, and every step's loss is the one of the run that never saw it.
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == never_saw_it
    assert [(e["event"], e["step"], e["to_step"]) for e in events] == [("loss_spike_rollback", BAD, 6)]
    assert events[0]["loss"] > events[0]["ceiling"] == pytest.approx(1.1 * events[0]["median"], rel=1e-6)
    assert sum(line.startswith("warning: loss spike at step 7") for line in result.stderr.splitlines()) == 1
    attempt = json.loads((tmp_path / "rollback" / "goodput.json").read_text())["attempts"][-1]
    assert attempt["badput"]["rollback"] > 0 and attempt["last_step"] == STEPS
    report = run_main(["status", str(tmp_path / "rollback"), "--plot", str(tmp_path / "loss.png")], capfd,
                      module=True)
    assert report.returncode == 0 and "  health: 1 loss spike(s) (rollback; newest at step 7: loss " in report.stdout


def test_skip_drops_the_update_of_the_spike(tmp_path, monkeypatch, capfd, never_saw_it):
    from scaletrain.store import checkpoint

    result, records, events = _train(tmp_path, monkeypatch, capfd, "skip", {BAD},
                                     **{"train.spike.action": "skip", "checkpoint.every_steps": 1,
                                        "checkpoint.max_to_keep": STEPS})
    assert result.returncode == 0, result.stderr
    assert [r["loss"] for r in records[:BAD - 1]] == never_saw_it[:BAD - 1]
    assert records[BAD - 1]["update_skipped"] == 1.0 and sum(r["update_skipped"] for r in records) == 1.0
    assert [(e["event"], e["step"]) for e in events] == [("loss_spike_skip", BAD)]
    assert "update dropped (train.spike.action=skip)" in result.stderr
    # Step 7's update never reached the state: its checkpoint's arrays are step 6's, bit for bit (their
    # fingerprints, recorded at each save), the step counter aside.
    folder = tmp_path / "skip" / "checkpoints"
    before, after = (checkpoint.read_metadata(folder, step)[1]["integrity"]["state"] for step in (BAD - 1, BAD))
    assert before.keys() == after.keys() and len(before) > 10
    assert {path for path in before if before[path] != after[path]} == {".step"}


def test_rollbacks_past_the_limit_stop_the_run(tmp_path, monkeypatch, capfd):
    """Two rollbacks to step 6's checkpoint, then the stop: every one recorded (a second rollback to the same
    checkpoint once erased the first's record, and status counted 2 spikes of 3)."""
    result, records, events = _train(tmp_path, monkeypatch, capfd, "limit", set(range(BAD, 100)),
                                     **{"train.spike.action": "rollback", "train.spike.limit": 2})
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "after 2 rollbacks (train.spike.limit=2)" in errors[0]
    assert "the newest checkpoint, step 6, holds the state from before it" in errors[0]
    assert [e["event"] for e in events] == ["loss_spike_rollback"] * 2 + ["loss_spike_stop"]
    report = run_main(["status", str(tmp_path / "limit"), "--plot", str(tmp_path / "loss.png")], capfd, module=True)
    assert "  health: 3 loss spike(s) (rollback, stop; newest at step " in report.stdout
    # Nothing after the spike was saved: the newest checkpoint is step 6's, from before it.
    assert sorted(int(p.name) for p in (tmp_path / "limit" / "checkpoints").iterdir()) == [3, 6]
    # The step dispatched before step 7 was read ran too, and has its record; the run stopped at step 7.
    assert records[-1]["step"] == BAD + 1 and "stopped (loss spikes) at step 8" in result.stdout


def test_a_stop_before_any_checkpoint_says_none_holds_the_state(tmp_path, monkeypatch, capfd):
    """Spikes from step 5 on, the first save due at step 6: the rollback goes to the run's start, and the stop
    says no checkpoint holds the state from before the spike."""
    result, _, events = _train(tmp_path, monkeypatch, capfd, "early", set(range(5, 100)),
                               **{"train.spike.action": "rollback", "train.spike.limit": 1,
                                  "checkpoint.every_steps": 6})
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].endswith(
        "after 1 rollbacks (train.spike.limit=1); no checkpoint was saved before it: a restart begins from the run's "
        "start (lower checkpoint.every_steps to keep one)"), result.stderr
    assert [e["event"] for e in events] == ["loss_spike_rollback", "loss_spike_stop"]
    assert events[0]["to_step"] == 0
