"""A jax.profiler trace of chosen train steps (`train.profile_start`, `train.profile_steps`), written into the
run directory's `profile/` for TensorBoard's profile plugin or Perfetto (docs/benchmarks.md, "Where a step's time
goes")."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import jax

from scaletrain.store import storage


class Profiler:
    """Traces steps [profile_start, profile_start + profile_steps) of this run (1-based, as the logs count them):
    the trace starts before the first is dispatched and stops once the last has finished on the devices. Every
    process writes its own host's trace. A bucket run directory gets the trace copied in when it stops."""

    def __init__(self, cfg):
        self.first, self.count = cfg.train.profile_start, cfg.train.profile_steps
        self.target = storage.path(cfg.run_dir) / "profile"
        self.remote = storage.is_remote(cfg.run_dir)
        self.local: Path | None = None

    def before(self, step: int) -> None:
        if self.count and step == self.first and self.local is None:
            self.local = Path(tempfile.mkdtemp(prefix="scaletrain-profile-")) if self.remote else Path(self.target)
            jax.profiler.start_trace(str(self.local), create_perfetto_trace=True)

    def after(self, step: int, state) -> None:
        if self.local is not None and step == self.first + self.count - 1:
            jax.block_until_ready(state)
            self.close()

    def close(self) -> None:
        """Stop a trace in progress (also when the run ends before its last profiled step)."""
        if self.local is None:
            return
        jax.profiler.stop_trace()
        if self.remote:
            for file in self.local.rglob("*"):
                if file.is_file():
                    destination = self.target / file.relative_to(self.local).as_posix()
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    destination.write_bytes(file.read_bytes())
            shutil.rmtree(self.local, ignore_errors=True)
        if jax.process_index() == 0:
            print(f"profile of steps {self.first}-{self.first + self.count - 1} written to {self.target} "
                  f"(tensorboard --logdir {self.target.parent}, or open the .xplane.pb / .trace.json.gz in Perfetto)",
                  file=sys.stderr, flush=True)
        self.local = None
