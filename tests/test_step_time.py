"""The trainer's step time measures steps: never less than a step, whatever the host does meanwhile, with
evaluation and checkpointing timed in their own fields; and a run ends with one summary line."""

import contextlib
import io
import json
import re
import statistics
import time

import pytest

from scaletrain import config
from scaletrain.data import prepare, tokenizer
from scaletrain.train import control, evaluation, trainer
from tests.conftest import ROOT, tiny_overrides

STEPS, EVERY = 40, 10
STALL_AT, STALL_S = 25, 0.2  # the host stops for a while between dispatching a step and reading the one before
EVAL_S = 1.0  # the first evaluation takes at least this long


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 40-step run evaluating and checkpointing every 10 steps: (its records, what it printed)."""
    root = tmp_path_factory.mktemp("step_time")
    sources = sorted(str(p) for p in (ROOT / "scaletrain").rglob("*.py"))[:40]
    prepare.prepare(tokenizer.load("bytes"), sources, str(root / "data"), "text", 0.2, 1)
    cfg = config.load(None, tiny_overrides(root / "run", steps=STEPS, **{
        "mesh.fsdp": -1, "data.source": "prepared", "data.path": root / "data", "train.eval_every_steps": EVERY,
        "train.eval_batches": 2, "checkpoint.every_steps": EVERY}))
    with pytest.MonkeyPatch.context() as patch:
        propose, evaluate, calls = control.Control.propose, evaluation.Evaluator.__call__, []

        def stalled(self, *args):  # called once before the loop, then after each step's dispatch
            calls.append(None)
            if len(calls) == STALL_AT + 1:
                time.sleep(STALL_S)
            return propose(self, *args)

        def slow(self, params):
            if not hasattr(self, "slowed"):
                self.slowed = time.sleep(EVAL_S)
            return evaluate(self, params)

        patch.setattr(control.Control, "propose", stalled)
        patch.setattr(evaluation.Evaluator, "__call__", slow)
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert trainer.run(cfg) == 0
    records = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    return root, records, out.getvalue()


def test_step_time_is_a_step_and_evaluation_and_checkpoints_are_timed_apart(run):
    _, records, _ = run
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    times = [r["step_time_s"] for r in records]
    median = statistics.median(times)
    # The stall once made the step after it look almost free (MFU 4798% in a CPU run); the evaluation's
    # second, and each save, counted in their step.
    assert min(times) >= median / 2, (min(times), median)
    assert max(times) < EVAL_S, max(times)
    assert all(r["mfu"] <= 1 for r in records)
    for r in records:
        assert r["tokens_per_sec"] == pytest.approx(8 * 32 / r["step_time_s"])
    timed = [r for r in records if "eval_time_s" in r or "checkpoint_time_s" in r]
    assert [r["step"] for r in timed] == [10, 20, 30, 40]
    assert all("eval_loss" in r and r["eval_time_s"] > 0 and r["checkpoint_time_s"] > 0 for r in timed)
    assert timed[0]["eval_time_s"] >= EVAL_S


def test_a_run_ends_with_a_summary(run):
    root, records, out = run
    evals = [(r["eval_loss"], r["step"]) for r in records if "eval_loss" in r]
    (best, at), last = min(evals), evals[-1][0]
    expected = (f"scaletrain: finished at step 40 of 40: steps 1-40 this run (40 steps, 10,240 tokens) in WALL wall "
                f"time; eval loss {last:.4f} at step 40, best {best:.4f} at step {at}; newest checkpoint "
                f"{root / 'run' / 'checkpoints' / '40'}; goodput GOODPUT")
    pattern = re.escape(expected).replace("WALL", r"\d\d:\d\d").replace("GOODPUT", r"\d+\.\d% of \d+ s \(badput: .*\)")
    assert re.fullmatch(pattern, out.splitlines()[-1]), out
