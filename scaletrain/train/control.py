"""When to save and when to stop: host-side events that every process must act on at the same step.

A SIGTERM may reach one host of a pod before the others, and the hosts' clocks disagree about when
`checkpoint.every_minutes` has passed. If hosts acted on their own view, one would save or leave while the
others wait in a collective forever. So after each step every process proposes its flags, one tiny
max-reduction over all devices agrees on them, and the loop reads the agreed flags one step later, as it
reads the metrics: the reduction has finished by then, so agreement never stalls the device.
"""

from __future__ import annotations

import dataclasses
import signal
import time

import jax
import jax.numpy as jnp
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


class Control:
    def __init__(self, mesh: Mesh, preemption: Preemption, every_minutes: float):
        self._preemption = preemption
        self._interval_s = every_minutes * 60 if every_minutes else None
        self._timer_start = time.monotonic()
        self._main = jax.process_index() == 0
        # One [1, 2] row per device; the max over rows is each flag OR-ed over all processes.
        self._sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
        self._local_devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        self._reduce = jax.jit(lambda rows: jnp.max(rows, axis=0), out_shardings=replicated(mesh))
        self._shape = (mesh.devices.size, 2)

    def propose(self) -> jax.Array:
        """Dispatch this process's flags for agreement; `decide` reads the result."""
        save = False
        if self._main and self._interval_s is not None and time.monotonic() - self._timer_start >= self._interval_s:
            save, self._timer_start = True, time.monotonic()
        row = np.array([[self._preemption.requested, save]], np.int32)
        rows = jax.make_array_from_single_device_arrays(
            self._shape, self._sharding, [jax.device_put(row, d) for d in self._local_devices])
        return self._reduce(rows)

    @staticmethod
    def decide(agreed: jax.Array) -> Decision:
        stop, save = np.asarray(jax.device_get(agreed)).tolist()
        return Decision(stop=bool(stop), save=bool(save))

    def saved(self) -> None:
        """A checkpoint was just saved: the save timer starts again."""
        self._timer_start = time.monotonic()
