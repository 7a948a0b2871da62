"""Where step metrics go: run_dir/metrics.jsonl, TensorBoard scalars in run_dir/tb, and the console.

With a gs:// run_dir both files are written locally and uploaded (storage.Mirror) every minute, at each
checkpoint and at the end: a kill without warning loses at most the records since the last upload, and a resumed
run redoes those steps anyway."""

from __future__ import annotations

import json
import sys
import time

from scaletrain.store import storage

# Seconds between uploads of a gs:// run directory's metrics files.
SYNC_EVERY_S = 60


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

    def _truncate_after(self, step: int) -> None:
        """A resumed run redoes the steps after its checkpoint: drop their old records so each step has one."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill
        self.path.write_text("".join(k + "\n" for k in kept))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
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
