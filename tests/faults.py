"""`python tests/faults.py POINT STEP TRAIN_ARGS...`: train.py, interrupted at an exact moment.

Timing a kill from outside cannot aim at "mid-save" on a model that saves in milliseconds, so the interruption
is made from inside, at a named point:
  between-steps  SIGKILL right after step STEP's metrics record is written
  mid-step       SIGKILL while step STEP runs (dispatch is asynchronous: the host is preparing the next batch)
  mid-save       SIGKILL when the save of step STEP has written every file but not yet committed (local or gs://)
  sigterm        SIGTERM to this process right after step STEP's metrics record is written (as a preemption)
  sigterm-early  SIGTERM to this process while it builds the model, before anything is compiled (STEP unused)
  stall          STALL_S seconds asleep while making the batch of step STEP + 1 (a data source that hangs)
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _at_record(step: int, signum: int) -> None:
    from scaletrain.train import metrics

    log = metrics.MetricsLog.log

    def log_then_signal(self, record):
        log(self, record)
        if record["step"] == step:
            os.kill(os.getpid(), signum)

    metrics.MetricsLog.log = log_then_signal


def _at_batch(step: int, action) -> None:
    """`action()` as the batch of step `step` + 1 is made: while step `step` runs (dispatch is asynchronous)."""
    from scaletrain.train import trainer

    put_batch = trainer.Setup.put_batch
    calls = 0

    def put_batch_interrupted(self, local):  # the name a hang dump shows
        nonlocal calls
        calls += 1
        if calls == step + 1:  # a fresh run: call k makes step k's batch, after step k - 1 was dispatched
            action()
        return put_batch(self, local)

    trainer.Setup.put_batch = put_batch_interrupted


def _mid_save(step: int) -> None:
    """Locally Orbax commits a step by renaming its temporary folder; in a bucket, by writing commit markers into
    the final folder. Either way the kill comes just before the first commit."""
    from orbax.checkpoint._src.path import atomicity

    def step_folder(path) -> bool:
        return any(name == str(step) or name.startswith(f"{step}.orbax-checkpoint-tmp")
                   for name in (path.name, path.parent.name))

    for kind in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
        def kill_before_commit(self, *args, _finalize=kind.finalize, **kwargs):
            if step_folder(self.get()):
                os.kill(os.getpid(), signal.SIGKILL)
            return _finalize(self, *args, **kwargs)

        kind.finalize = kill_before_commit


STALL_S = 10.0


def _sigterm_early() -> None:
    from scaletrain.train import trainer

    build = trainer.build

    def build_then_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return build(*args, **kwargs)

    trainer.build = build_then_signal


def main() -> int:
    point, step, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    if point == "between-steps":
        _at_record(step, signal.SIGKILL)
    elif point == "sigterm":
        _at_record(step, signal.SIGTERM)
    elif point == "sigterm-early":
        _sigterm_early()
    elif point == "mid-step":
        _at_batch(step, lambda: os.kill(os.getpid(), signal.SIGKILL))
    elif point == "mid-save":
        _mid_save(step)
    elif point == "stall":
        _at_batch(step, lambda: time.sleep(STALL_S))
    else:
        raise SystemExit(f"unknown point {point}")
    from scaletrain.__main__ import main as scaletrain_main

    return scaletrain_main(["train", *args])


if __name__ == "__main__":
    sys.exit(main())
