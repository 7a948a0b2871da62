"""Naming a straggler (docs/health.md): the process whose host falls behind the others.

Every process runs the same step on its devices, so a slow host shows not in its step time but in everyone's: the
others wait in the step's collectives for it. What differs is each host's own work, above all making its batch
(reading, decoding, packing). Each process measures its recent mean batch time; the loop's per-step agreement
(control.py) gathers them all; when the slowest process takes longer than the median of the others by more than
`train.hang.straggler` x the step time, it is named - once, until it catches up again."""

from __future__ import annotations

import statistics
from collections import deque

# Steps a process's batch time is averaged over: one slow batch in a window counts a tenth.
WINDOW = 10


class BatchTimes:
    """This process's batch times: the mean over the last WINDOW steps, proposed for agreement each step."""

    def __init__(self):
        self._times: deque[float] = deque(maxlen=WINDOW)

    def add(self, seconds: float) -> None:
        self._times.append(seconds)

    def mean(self) -> float:
        return sum(self._times) / len(self._times) if self._times else 0.0


class Stragglers:
    def __init__(self, share: float):
        self.share = share
        self.named: int | None = None  # the process named, while it stays behind

    def check(self, step: int, batch_s: tuple[float, ...], step_s: float | None) -> dict | None:
        """Each process's mean batch time (by process index) as agreed after step `step`, and the step time: the
        record naming a process that has just fallen behind, else None."""
        if self.share <= 0 or len(batch_s) < 2 or not step_s:
            return None
        slowest = max(range(len(batch_s)), key=batch_s.__getitem__)
        median = statistics.median(t for p, t in enumerate(batch_s) if p != slowest)  # of the others
        if batch_s[slowest] - median <= self.share * step_s:
            self.named = None
            return None
        if self.named == slowest:
            return None
        self.named = slowest
        return {"step": step, "event": "straggler", "process": slowest, "batch_s": batch_s[slowest],
                "median_batch_s": median, "step_time_s": step_s}
