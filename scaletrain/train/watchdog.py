"""The hang watchdog (docs/health.md): a thread per process that notices when the training loop has been in one
phase - a step, making a batch, an evaluation, a checkpoint - far longer than a step takes, and says so.

The loop tells it which phase it enters (`enter`) and how long its steps take (`step_time`). A phase that lasts
longer than `train.hang.factor` x the median step time, and at least `train.hang.seconds`, gets one dump: every
thread's Python stack (faulthandler's, so also a thread stuck in C) in RUN_DIR/hangs/, and a warning naming this
process, its host, the phase and the step. A process that stalls making its batch says `data`; the others, waiting
in the step's collectives for it, say `step` - so the stalled one names itself. With `train.hang.exit` the process
then exits with status 3, for a scheduler to restart the run from its checkpoint."""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import threading
import time
from collections import deque

from scaletrain.store import storage

EXIT_HANG = 3
# Seconds between two looks at the loop's phase.
POLL_S = 0.5


class Watchdog:
    def __init__(self, run_dir: str, process: int, factor: float, seconds: float, exit_on_hang: bool):
        self.mirror = storage.Mirror(run_dir)
        self.process, self.factor, self.seconds, self.exit_on_hang = process, factor, seconds, exit_on_hang
        self._times: deque[float] = deque(maxlen=100)
        self._lock = threading.Lock()
        self._phase: tuple[str, int, float] | None = None  # (phase, step, since)
        self._dumped = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="scaletrain-watchdog", daemon=True)
        self._thread.start()

    def enter(self, phase: str | None, step: int) -> None:
        """The loop starts `phase` (None: nothing to watch) working towards step `step`."""
        with self._lock:
            self._phase = None if phase is None else (phase, step, time.monotonic())
            self._dumped = False

    def step_time(self, seconds: float) -> None:
        with self._lock:
            self._times.append(seconds)

    def threshold(self) -> float:
        with self._lock:
            return self._threshold()

    def _threshold(self) -> float:
        times = sorted(self._times)
        return max(self.seconds, self.factor * times[len(times) // 2]) if times else self.seconds

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            with self._lock:
                if self._phase is None or self._dumped:
                    continue
                phase, step, since = self._phase
                waited, limit = time.monotonic() - since, self._threshold()
                if waited <= limit:
                    continue
                self._dumped = True
            self._dump(phase, step, waited, limit)

    def _dump(self, phase: str, step: int, waited: float, limit: float) -> None:
        folder = self.mirror.local / "hangs"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"process-{self.process}-step-{step}-{phase}.txt"
        what = (f"process {self.process} on {socket.gethostname()} (pid {os.getpid()}) has been in {phase} for step "
                f"{step} for {waited:.0f} s (threshold {limit:.0f} s)")
        with open(path, "w") as f:
            f.write(what + "\n\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        self.mirror.sync()
        shown = path if self.mirror.remote is None else f"{self.mirror.remote}/hangs/{path.name}"
        if self.exit_on_hang:
            print(f"error: {what}; every thread's stack in {shown}; exiting (train.hang.exit) for the run to be "
                  f"restarted from its checkpoint", file=sys.stderr, flush=True)
            os._exit(EXIT_HANG)
        print(f"warning: {what}; every thread's stack in {shown}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.mirror.close()
