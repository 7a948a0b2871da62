"""Goodput: where a run's wall time goes, across every start of the same run directory (docs/health.md).

Each start of `train.py` on a run directory is an attempt. A process keeps a ledger of its attempt: seconds spent
stepping (productive), and badput by cause - start-up (building the model, the data and the devices), compile,
restore (or initialisation), data (the host making a batch while the devices had finished their step and waited:
an upper bound), evaluation, checkpoint (the blocking part of a save, and the wait for the last one), rollback
(a loss spike's: the steps done in vain and the restore), and idle
(the rest: shutting down, writing the summary). It is written, whole and atomically, to RUN_DIR/goodput.json (process
0; process p > 0 to goodput.p.json) every WRITE_EVERY_S of stepping, at each checkpoint and at the end, and
uploaded to a gs:// run directory every minute and at each checkpoint.

An attempt that resumes a killed one finds what the kill cost: the steps the killed attempt finished after the
checkpoint this one restores are done again (`redone`: those it had recorded, at its mean step time, taken from
its productive time; `redone_steps` counts also those after its last record, from metrics.jsonl), and the time
from the killed attempt's last record to this attempt's start (`restart`: the scheduler's delay, the process
start, and whatever the killed attempt did after its last record) is lost - unless that attempt finished or
stopped on a non-finite loss (a later start that raises `steps` continues a finished run: the time between is
nobody's). Over all attempts the causes and the productive time add up to the wall time: each attempt's from its
start to its last record, and the restarts between them."""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from scaletrain.store import storage

# Badput by cause, in the order they are reported.
CAUSES = ("startup", "compile", "restore", "data", "evaluation", "checkpoint", "rollback", "redone", "restart",
          "idle")
# Causes timed inside the training loop, whose time is taken out of the loop's (productive) time.
_IN_LOOP = ("data", "evaluation", "checkpoint", "rollback")
# Seconds between two writes of the ledger while steps run (a write is a few hundred microseconds).
WRITE_EVERY_S = 2.0


def file_name(process: int) -> str:
    return "goodput.json" if process == 0 else f"goodput.{process}.json"


def read(run_dir: str | os.PathLike, process: int = 0) -> list[dict]:
    """The attempts recorded in a run directory (local or gs://), oldest first; none where there is no file."""
    location = storage.path(run_dir) / file_name(process)
    return json.loads(location.read_text())["attempts"] if location.exists() else []


def totals(attempts: list[dict]) -> dict:
    """Wall time (each attempt's, from its start to its last record, and the restarts between them), the productive
    seconds, badput by cause (each attempt's idle: its wall time less everything else), the steps redone and the
    share that was productive."""
    badput = dict.fromkeys(CAUSES, 0.0)
    productive, redone_steps, wall_total = 0.0, 0, 0.0
    for attempt in attempts:
        wall = attempt["updated"] - attempt["started"]
        wall_total += wall + attempt["badput"].get("restart", 0.0)
        productive += attempt["productive"]
        for cause, seconds in attempt["badput"].items():
            badput[cause] += seconds
        # Redone work was counted productive by the attempt that did it first: it moves to badput here.
        productive -= attempt["badput"].get("redone", 0.0)
        own = attempt["productive"] + sum(s for c, s in attempt["badput"].items() if c not in ("redone", "restart"))
        badput["idle"] += max(0.0, wall - own)
        redone_steps += attempt.get("redone_steps", 0)
    return {"wall": wall_total, "productive": productive, "badput": badput, "redone_steps": redone_steps,
            "goodput": productive / wall_total if wall_total > 0 else 0.0, "attempts": len(attempts)}


def scalars(total: dict) -> dict[str, float]:
    """TensorBoard's goodput/* scalars: the productive share and each cause's share of the wall time."""
    wall = total["wall"] or 1.0
    return {"goodput/goodput": total["goodput"], **{f"goodput/{c}": s / wall for c, s in total["badput"].items()}}


def describe(total: dict) -> str:
    """'goodput 91.2% of 3720 s (badput: compile 4.1%, ...)' (the three largest causes first)."""
    wall = total["wall"] or 1.0
    causes = sorted(((s, c) for c, s in total["badput"].items() if s > 0), reverse=True)
    lost = ", ".join(f"{c} {s / wall:.1%}" for s, c in causes[:3])
    return f"goodput {total['goodput']:.1%} of {total['wall']:.0f} s" + (f" (badput: {lost})" if lost else "")


class Ledger:
    """One process's accounting of this attempt (module docstring). `began`: time.perf_counter() when the process
    started the run."""

    def __init__(self, run_dir: str, process: int, began: float):
        self.mirror = storage.Mirror(run_dir)
        self.name = file_name(process)
        self.mirror.fetch(self.name)
        path = self.mirror.local / self.name
        try:
            self.previous = json.loads(path.read_text())["attempts"] if path.exists() else []
        except (ValueError, KeyError, TypeError):  # accounting must never stop a run: start it afresh
            print(f"warning: {self.name} in the run directory is unreadable; goodput is counted from this start",
                  file=sys.stderr, flush=True)
            self.previous = []
        self._warned = False
        self._clock = began
        self.attempt = {"started": time.time() - (time.perf_counter() - began), "updated": time.time(),
                        "first_step": 0, "last_step": 0, "productive": 0.0,
                        "badput": dict.fromkeys(CAUSES, 0.0), "redone_steps": 0, "ended": None}
        self._written = self._synced = float("-inf")
        self._loop_began = None  # perf_counter when the training loop started
        self._in_loop = 0.0

    def spend(self, cause: str, seconds: float) -> None:
        self.attempt["badput"][cause] += seconds
        if self._loop_began is not None and cause in _IN_LOOP:
            self._in_loop += seconds

    @contextmanager
    def timing(self, cause: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.spend(cause, time.perf_counter() - t0)

    def started(self, cause: str = "startup") -> None:
        """Everything since the process began (or the last call) goes to `cause`."""
        now = time.perf_counter()
        self.spend(cause, now - self._clock)
        self._clock = now

    def _interrupted(self) -> dict | None:
        """The previous attempt, where it was cut short (killed or preempted: it did not finish, nor stop for a
        person to look at a non-finite loss)."""
        if not self.previous or self.previous[-1].get("ended") in ("finished", "stopped"):
            return None
        return self.previous[-1]

    def resumed(self, step: int) -> None:
        """This attempt starts at `step`: the previous attempt's steps after it that it had recorded are redone
        (their time moves from its productive time), and the time between its last record and this attempt's start
        was lost to the restart."""
        self.attempt["first_step"] = self.attempt["last_step"] = step
        last = self._interrupted()
        if last is None:
            return
        done, redone = last["last_step"] - last["first_step"], max(0, last["last_step"] - step)
        self.attempt["redone_steps"] = redone
        self.attempt["badput"]["redone"] = redone * last["productive"] / done if done > 0 else 0.0
        self.attempt["badput"]["restart"] = max(0.0, self.attempt["started"] - last["updated"])

    def logged(self, last_logged: int) -> None:
        """The metrics log's newest record before this start: steps of the previous attempt past its last record
        here, also redone (their time is in `restart`, where the ledger did not see them)."""
        if self._interrupted() is not None:
            self.attempt["redone_steps"] = max(self.attempt["redone_steps"],
                                               last_logged - self.attempt["first_step"])

    def rolled_back(self, step: int, seconds: float) -> None:
        """The run went back to `step` (a loss spike's rollback, docs/health.md), restoring it in `seconds`: the
        steps done after it were in vain, at this attempt's mean step time."""
        done, lost = self.attempt["last_step"] - self.attempt["first_step"], self.attempt["last_step"] - step
        self.spend("rollback", seconds + (lost * self.attempt["productive"] / done if done > 0 else 0.0))
        self.attempt["last_step"] = step
        self.attempt["first_step"] = min(self.attempt["first_step"], step)

    def loop_started(self) -> None:
        self._loop_began = time.perf_counter()

    def stepped(self, step: int) -> None:
        """Step `step` is done (its metrics read): the loop's time so far, less the badput in it, was productive.
        Written every WRITE_EVERY_S."""
        now = time.perf_counter()
        self.attempt["last_step"] = step
        self.attempt["productive"] = now - self._loop_began - self._in_loop
        if now - self._written > WRITE_EVERY_S:
            self.write()
            self._written = now
        if now - self._synced > storage.SYNC_EVERY_S:  # a gs:// run directory's copy, with the metrics'
            self.sync()
            self._synced = now

    def write(self) -> None:
        """This attempt's record, written beside the earlier ones (atomically: a kill leaves the old file or the
        new one)."""
        self.attempt["updated"] = time.time()
        path = self.mirror.local / self.name
        temporary = path.with_suffix(".json.tmp")
        try:
            temporary.write_text(json.dumps({"attempts": [*self.previous, self.attempt]}, indent=1))
            Path(temporary).replace(path)
        except OSError as e:  # a full or vanished disk: say so once, and train on
            if not self._warned:
                print(f"warning: cannot write {path} ({e.strerror}); goodput is not recorded meanwhile",
                      file=sys.stderr, flush=True)
                self._warned = True

    def sync(self) -> None:
        """Uploaded to a gs:// run directory (a local one has it already)."""
        if self.mirror.remote is not None:
            self.mirror.sync()

    def totals(self) -> dict:
        """`totals` over the earlier attempts and this one so far."""
        return totals([*self.previous, self.attempt])

    def close(self, ended: str) -> dict:
        """The last record (`ended`: finished, preempted, stopped), uploaded; the totals over every attempt."""
        self.attempt["ended"] = ended
        self.write()
        self.mirror.close()
        return self.totals()
