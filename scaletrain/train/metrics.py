"""Where step metrics go: run_dir/metrics.jsonl, TensorBoard scalars in run_dir/tb, and the console; how a step is
timed (StepClock); the line a run ends with (`summary`). docs/benchmarks.md says what each field measures.

With a gs:// run_dir both files are written locally and uploaded (storage.Mirror) every minute, at each
checkpoint and at the end: a kill without warning loses at most the records since the last upload, and a resumed
run redoes those steps anyway."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import jax

from scaletrain.store import storage
from scaletrain.train import goodput

SYNC_EVERY_S = storage.SYNC_EVERY_S


class StepClock:
    """The step time of each record: the mean time of the steps since the previous record, or of the last WINDOW
    steps where that is more, never less than the devices spent on them - measured without ever making the host
    wait for a step it would not wait for anyway.

    The loop dispatches step s+1 before it waits for step s, so when the host sees step s finished, step s+1 may
    have run for a while (the host was busy or descheduled) or be finished too: the time between two such sights
    can be far below a step. Instead a window of steps (p, c] runs from a moment known to precede the start of step
    p+1 - the later of its dispatch and the last moment a step up to p was seen unfinished (the host polls a step
    it waits for) - to the moment step c is seen finished. The devices run steps p+1..c inside it, one after the
    other, so the window's mean is never less than theirs. It may exceed it by what was left of step p when step
    p+1 was dispatched: on a TPU, where the host sees each step end, nearly nothing; on a CPU, whose dispatch often
    waits for the step before, up to a step, which WINDOW steps make small.

    Where the loop waits anyway - to evaluate, to save - it waits for the step first and dispatches the next one
    only after (`paused`): no step runs in between, and that time is taken out of every window that holds it."""

    WINDOW = 10
    POLL_S = 1e-3  # the longest sleep between two looks at a step: how late the host may see it finished

    def __init__(self, start_step: int):
        self._start = self._previous = start_step  # the run's first step - 1; the previous record's step
        self._dispatched: dict[int, float] = {}
        self._floor: dict[int, float] = {}  # step -> the last moment a step up to it was seen unfinished
        self._unfinished = float("-inf")
        self._seen: tuple[int, float] | None = None  # (the last step seen finished, when)
        self._paused: dict[int, float] = {}  # step -> seconds from seeing it finished to dispatching the next
        self._pause: tuple[int, float] | None = None

    def dispatching(self, step: int) -> None:
        """Just before `step` is dispatched: it cannot start earlier."""
        now = self._dispatched[step] = time.perf_counter()
        if self._pause is not None and self._pause[0] == step - 1:
            self._paused[step - 1] = now - self._pause[1]
        self._pause = None

    def wait(self, step: int, outputs: Any) -> None:
        """Until `step`'s outputs (arrays) are ready, looking every so often; the first wait for a step counts."""
        if self._seen is not None and self._seen[0] >= step:
            return
        leaves, pause = jax.tree.leaves(outputs), 1e-5
        while True:
            t = time.perf_counter()
            if all(x.is_ready() for x in leaves):
                break
            self._unfinished = t  # the step ends after this
            time.sleep(pause)
            pause = min(2 * pause, self.POLL_S)
        self._seen = (step, time.perf_counter())
        self._floor[step] = self._unfinished

    def paused(self, step: int) -> None:
        """No step runs from `step` seen finished until the next is dispatched."""
        assert self._seen is not None and self._seen[0] == step, (self._seen, step)
        self._pause = self._seen

    def record(self, step: int) -> float:
        """The mean step time of the window ending at `step`, which `wait` has seen finished."""
        seen, finished = self._seen
        assert seen == step, (seen, step)
        first = max(self._start, min(self._previous, step - self.WINDOW))  # the window: steps first+1 .. step
        start = max(self._floor.get(first, float("-inf")), self._dispatched[first + 1])
        paused = sum(seconds for s, seconds in self._paused.items() if first < s < step)
        self._previous = step
        self._dispatched = {s: t for s, t in self._dispatched.items() if s > step - self.WINDOW}
        self._floor = {s: t for s, t in self._floor.items() if s >= step - self.WINDOW}
        self._paused = {s: t for s, t in self._paused.items() if s > step - self.WINDOW}
        return (finished - start - paused) / (step - first)


def _fmt_duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    """One live line on a terminal; on a pipe, about twenty plain lines per run."""

    def __init__(self, total_steps: int, stream=sys.stdout):
        self.total, self.stream = total_steps, stream
        self.live = stream.isatty()
        self.every = max(1, total_steps // 20)
        self.line_open = False

    def update(self, record: dict, eta_s: float) -> None:
        step = record["step"]
        mfu = "   -  " if record["mfu"] is None else f"{100 * record['mfu']:5.1f}%"
        line = (f"step {step:>{len(str(self.total))}}/{self.total}  loss {record['loss']:.4f}  "
                f"{record['tokens_per_sec']:,.0f} tok/s  MFU {mfu}  step {record['step_time_s'] * 1e3:.0f} ms  "
                f"ETA {_fmt_duration(eta_s)}")
        if "eval_loss" in record:
            line += f"  eval loss {record['eval_loss']:.4f}"
        if self.live:
            width = int(40 * step / self.total)
            self.stream.write(f"\r[{'#' * width}{'.' * (40 - width)}] {line}\033[K")
            self.line_open = True
        elif step % self.every == 0 or step == self.total or step == 1:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.line_open:
            self.stream.write("\n")
            self.stream.flush()
            self.line_open = False


class MetricsLog:
    """Writes one record per logged step; only the main process writes."""

    def __init__(self, run_dir: str, total_steps: int, resume_step: int, enabled: bool,
                 tensorboard: bool = True):
        self.enabled = enabled
        self.total_steps = total_steps
        self.progress = Progress(total_steps)
        self.start_step = resume_step
        self.start_time = time.perf_counter()
        self.evals: list[tuple[int, float]] = []  # (step, eval_loss) of every record kept or logged
        self.last_logged = resume_step  # the newest step the file had a record of (a killed run's, redone now)
        if not enabled:
            return
        self.mirror = storage.Mirror(run_dir)
        self.mirror.fetch("metrics.jsonl")
        self.path = self.mirror.local / "metrics.jsonl"
        self._truncate_after(resume_step)
        self.synced = time.monotonic()
        self.file = self.path.open("a")
        self.tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(self.mirror.local / "tb"), flush_secs=10)

    def _truncate_after(self, step: int, rolled_back: bool = False) -> None:
        """A resumed (or rolled-back) run redoes the steps after its checkpoint: drop their old records so each
        step has one. A resumed run drops their events too (records with an `event`: a loss spike, a straggler),
        which it records again as they recur. A rolled-back one keeps them: they do not recur - the spike's batch
        is left out of the redo, a straggler named stays named until it catches up - and status counts what the
        run went through from them (a second rollback to the same checkpoint once erased the first's record)."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
                if "event" not in record:
                    self.last_logged = max(self.last_logged, record["step"])
                if record["step"] <= step or (rolled_back and "event" in record):
                    kept.append(line)
                    if "eval_loss" in record:
                        self.evals.append((record["step"], record["eval_loss"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill
        self.path.write_text("".join(k + "\n" for k in kept))

    def rewind(self, step: int) -> None:
        """The run rolled back to `step`: the step records after it go, the events stay (`_truncate_after`)."""
        if not self.enabled:
            return
        self.file.close()
        self.evals = []
        self._truncate_after(step, rolled_back=True)
        self.file = self.path.open("a")
        self.start_step, self.start_time = step, time.perf_counter()

    def event(self, record: dict) -> None:
        """A record of something that happened at a step (`record["event"]` names it), beside the step records."""
        if self.enabled:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        if "eval_loss" in record:
            self.evals.append((record["step"], record["eval_loss"]))
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar("eval/loss" if k == "eval_loss" else f"train/{k}", v, record["step"])
        if time.monotonic() - self.synced > SYNC_EVERY_S:
            self.sync()
        done = record["step"] - self.start_step
        elapsed = time.perf_counter() - self.start_time
        self.progress.update(record, elapsed / max(done, 1) * (self.total_steps - record["step"]))

    def scalars(self, values: dict[str, float], step: int) -> None:
        """TensorBoard scalars beside the step records (goodput's)."""
        if self.enabled and self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)

    def sync(self) -> None:
        """Everything logged so far, durable in the run directory."""
        if not self.enabled:
            return
        if self.tb is not None:
            self.tb.flush()
        self.mirror.sync()
        self.synced = time.monotonic()

    def close(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        self.mirror.close()
        self.progress.close()


def summary(outcome: str, first: int, last: int, total: int, tokens_per_step: int, seconds: float,
            evals: list[tuple[int, float]], checkpoint: str | None, accounts: dict | None = None) -> str:
    """The line a run ends with: what it did (steps first..last of total; `first` > `last`: none), in how long,
    the newest and the best held-out loss of the run directory's records, where its newest checkpoint is, and the
    run's goodput over all its attempts (`accounts`: goodput.totals)."""
    done = last - first + 1
    line = (f"scaletrain: {outcome} at step {last} of {total}: "
            + (f"steps {first}-{last} this run ({done} steps, {done * tokens_per_step:,} tokens)" if done > 0 else
               "no steps this run") + f" in {_fmt_duration(seconds)} wall time")
    if evals:
        (step, loss), (best_step, best) = evals[-1], min(evals, key=lambda e: e[1])
        line += f"; eval loss {loss:.4f} at step {step}, best {best:.4f} at step {best_step}"
    line += f"; newest checkpoint {checkpoint or 'none'}"
    return line + (f"; {goodput.describe(accounts)}" if accounts else "")
