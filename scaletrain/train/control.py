"""When to save and when to stop: host-side events that every process must act on at the same step.

A SIGTERM may reach one host of a pod before the others, and the hosts' clocks disagree about when
`checkpoint.every_minutes` has passed. If hosts acted on their own view, one would save or leave while the
others wait in a collective forever. So after each step every process proposes its flags, one tiny gather over
all devices agrees on them, and the loop reads the agreed flags one step later, as it reads the metrics: the
gather has finished by then, so agreement never stalls the device. The same gather tells every process how long
each one takes to make its batches, so a straggler is named (stragglers.py).
"""

from __future__ import annotations

import dataclasses
import signal
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from scaletrain.parallel.sharding import replicated


class Preemption:
    """Records SIGTERM (a Cloud TPU preemption notice); the loop decides, with the other hosts, what to do."""

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


@dataclasses.dataclass(frozen=True)
class Decision:
    stop: bool  # some process was asked to stop: save this step, then leave
    save: bool  # the save timer of process 0 has run out
    batch_s: tuple[float, ...] = ()  # each process's seconds making a batch (its recent mean), by process index
    step_s: float = 0.0  # process 0's newest step time


class Control:
    def __init__(self, mesh: Mesh, preemption: Preemption, every_minutes: float):
        self._preemption = preemption
        self._interval_s = every_minutes * 60 if every_minutes else None
        self._timer_start = time.monotonic()
        self._main = jax.process_index() == 0
        # One [1, 4] row per device - the two flags, its process's batch time and step time -, gathered whole on
        # every device: the max over rows is each flag OR-ed over all processes, each process's times are in its
        # rows.
        self._sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
        self._local_devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        self._process_of_row = np.array([d.process_index for d in mesh.devices.flat])
        self._processes, self._a_row_of_0 = self._process_of_row.max() + 1, int(np.argmax(self._process_of_row == 0))
        self._gather = jax.jit(lambda rows: rows, out_shardings=replicated(mesh))
        self._shape = (mesh.devices.size, 4)
        self._save_proposed = False  # and not yet saved

    def propose(self, batch_s: float = 0.0, step_s: float = 0.0) -> jax.Array:
        """Dispatch this process's flags, batch time and step time for agreement; `decide` reads the result."""
        save = False
        if self._main and self._interval_s is not None and time.monotonic() - self._timer_start >= self._interval_s:
            save, self._timer_start, self._save_proposed = True, time.monotonic(), True
        row = np.array([[self._preemption.requested, save, batch_s, step_s]], np.float32)
        rows = jax.make_array_from_single_device_arrays(
            self._shape, self._sharding, [jax.device_put(row, d) for d in self._local_devices])
        return self._gather(rows)

    def decide(self, agreed: jax.Array) -> Decision:
        rows = np.asarray(jax.device_get(agreed))
        stop, save = (rows[:, :2].max(axis=0) > 0).tolist()
        batch_s = np.zeros(self._processes)
        np.maximum.at(batch_s, self._process_of_row, rows[:, 2])
        step_s = float(rows[self._a_row_of_0, 3])
        return Decision(stop=bool(stop), save=bool(save), batch_s=tuple(batch_s.tolist()), step_s=step_s)

    def saved(self) -> None:
        """A checkpoint was just saved: the save timer starts again."""
        self._timer_start, self._save_proposed = time.monotonic(), False

    def dropped(self) -> None:
        """The agreements in flight were thrown away (a loss spike's rollback): a timed save proposed among them
        is proposed again at the next step. A preemption is proposed at every step anyway."""
        if self._save_proposed:
            self._timer_start = float("-inf")
