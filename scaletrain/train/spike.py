"""The loss-spike rule (docs/health.md, `train.spike.*`): a step's loss far above the running median of the steps
before it is a spike, and the run warns, drops that step's update inside the step, or rolls back to its newest
checkpoint from before it and goes on past the batch that caused it.

The host judges: it keeps the losses of the last `window` steps whose updates were applied, and passes each step a
ceiling - `factor` x their median - which the step compares its loss with (with `skip`, a loss above it drops the
update as a non-finite one does). The loop reads a step's metrics one step late, so the ceiling of step s is
made from the steps up to s-2, always - also where the loop happens to know step s-1 already (before a save) -
so that a run's ceilings depend on its losses alone, not on when it saved or where it resumed: the checkpoint
keeps the window (`state`), and a resumed or rolled-back run makes the same ceilings as one that never stopped."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque

import numpy as np


@dataclasses.dataclass(frozen=True)
class Spike:
    step: int
    loss: float
    median: float
    ceiling: float

    def describe(self) -> str:
        return (f"step {self.step}: loss {self.loss:.4f} is {self.loss / self.median:.2f}x the median "
                f"{self.median:.4f} of the steps before it (ceiling {self.ceiling:.4f})")

    def record(self, action: str, **more) -> dict:
        """Its line in metrics.jsonl."""
        return {"step": self.step, "event": f"loss_spike_{action}", "loss": self.loss, "median": self.median,
                "ceiling": self.ceiling, **more}


class SpikeRule:
    def __init__(self, action: str, factor: float, window: int):
        self.action, self.factor, self.window = action, factor, window
        # (step, loss) of the newest steps whose updates were applied: a window's worth up to s-2, and step s-1.
        self._applied: deque[tuple[int, float]] = deque(maxlen=window + 1)
        self._ceilings: dict[int, tuple[float, float]] = {}  # dispatched step -> (median, ceiling)

    def dispatched(self, step: int) -> float:
        """Step `step` is about to be dispatched: the ceiling `judge` will compare its loss with (inf: no rule yet,
        with fewer than `window` losses known, or none at all), and what the step itself gets - the ceiling with
        `skip` (the step drops an update above it), inf otherwise."""
        losses = [loss for s, loss in self._applied if s <= step - 2][-self.window:]
        if self.action == "off" or len(losses) < self.window:
            return math.inf
        median = statistics.median(losses)
        ceiling = float(np.float32(self.factor * median))  # as the step compares it, in float32
        self._ceilings[step] = (median, ceiling)
        return ceiling if self.action == "skip" else math.inf

    def judge(self, step: int, loss: float, applied: bool) -> Spike | None:
        """Step `step`'s loss, read; `applied`: its update reached the parameters. The spike it is, if one."""
        median, ceiling = self._ceilings.pop(step, (math.nan, math.inf))
        if applied and math.isfinite(loss):
            self._applied.append((step, loss))
        return Spike(step, loss, median, ceiling) if loss > ceiling else None

    def state(self) -> dict:
        """What a checkpoint keeps (JSON): the window as of the checkpoint's step."""
        return {"applied": [list(entry) for entry in self._applied]}

    def restore(self, state: dict | None) -> None:
        """Back to a checkpoint's window (none: a checkpoint from before the rule, or a fresh start)."""
        self._applied.clear()
        self._applied.extend((int(s), float(loss)) for s, loss in (state or {}).get("applied", []))
        self._ceilings.clear()
