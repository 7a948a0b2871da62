"""`python -m scaletrain status RUN_DIR`: where a run is, read from its run directory alone (docs/health.md).

Reads config.yaml, metrics.jsonl, goodput.json, run.lock, the checkpoints' list and the hang dumps' names - never
writes there, so it is safe beside a live run, on a finished one and on a gs:// run directory. The loss curves go
to a small PNG (in the current directory by default) and a text sparkline; health flags from the run's records."""

from __future__ import annotations

import itertools
import json
import math
import os
import socket
import time

import yaml

from scaletrain.errors import UserError
from scaletrain.store import checkpoint, storage
from scaletrain.store.run_lock import FILE_NAME as LOCK_FILE
from scaletrain.store.run_lock import STALE_AFTER_S
from scaletrain.train import goodput

_BARS = "▁▂▃▄▅▆▇█"
# Recent records the ETA's step time is the median of.
ETA_WINDOW = 20


def sparkline(values: list[float], width: int = 40) -> str:
    """`values` (means of `width` equal slices where there are more) as eighths of a bar, low to high; non-finite
    values (a dropped update's loss) left out."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return ""
    if len(values) > width:
        edges = [round(i * len(values) / width) for i in range(width + 1)]
        values = [sum(values[a:b]) / (b - a) for a, b in itertools.pairwise(edges)]
    low, high = min(values), max(values)
    scale = (len(_BARS) - 1) / (high - low) if high > low else 0.0
    return "".join(_BARS[round((v - low) * scale)] for v in values)


def _records(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    out = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written, or cut short by a kill
    return out


def _holder(run_dir) -> dict | None:
    """The run lock's holder record, with whether it is alive: its heartbeat recent (a bucket's lock beats every
    15 s; a local one is written once, and held while the process lives)."""
    path = run_dir / LOCK_FILE
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if storage.is_remote(str(run_dir)):
        holder["alive"] = time.time() - holder.get("heartbeat", 0) < STALE_AFTER_S
    else:
        holder["alive"] = _flocked(path, holder)
    return holder


def _flocked(path, holder: dict) -> bool:
    """Whether some process holds a flock on `path`, read from the kernel's table (/proc/locks) rather than by
    trying to take one, which could make a run starting at that moment find its directory in use. Without the
    table: whether the holder's pid lives, where it is of this host."""
    try:
        inode = os.stat(path).st_ino
        with open("/proc/locks") as f:
            table = f.read().splitlines()
    except OSError:
        return holder.get("host") != socket.gethostname() or _pid_lives(holder.get("pid"))
    return any(len(fields) > 5 and fields[1] == "FLOCK" and fields[5].endswith(f":{inode}")
               for fields in (line.split() for line in table))


def _pid_lives(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:
        pass
    return True


def status(location: str) -> dict:
    """Everything `status` prints, as a dict (--json)."""
    run_dir = storage.path(location)
    if not (run_dir / "config.yaml").exists():
        raise UserError(f"'{location}' is not a run directory (no config.yaml); expected the run_dir of a run that "
                        f"has started")
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    total_steps = int(cfg["steps"])
    tokens_per_step = int(cfg["train"]["global_batch"]) * int(cfg["data"]["seq_len"])
    records = _records(run_dir)
    events = [r for r in records if "event" in r]
    records = [r for r in records if "event" not in r]
    step = records[-1]["step"] if records else 0
    times = sorted(r["step_time_s"] for r in records[-ETA_WINDOW:] if "step_time_s" in r)
    holder = _holder(run_dir)
    attempts = goodput.read(location)
    ended = attempts[-1].get("ended") if attempts else None
    checkpoints = checkpoint.saved_steps(run_dir / "checkpoints")
    return {
        "run_dir": str(run_dir),
        "state": "running" if holder and holder["alive"] else ended or ("stopped" if records else "not started"),
        "step": step, "steps": total_steps, "tokens": step * tokens_per_step,
        "eta_s": (total_steps - step) * times[len(times) // 2] if times and step < total_steps else 0.0,
        "loss": records[-1].get("loss") if records else None,
        "eval_loss": [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r],
        "newest_checkpoint": checkpoints[-1] if checkpoints else None,
        "lock": holder,
        "last_record_age_s": time.time() - attempts[-1]["updated"] if attempts else None,
        "goodput": goodput.totals(attempts) if attempts else None,
        "losses": [(r["step"], r["loss"]) for r in records if "loss" in r],
        "health": _health(run_dir, records, events),
    }


def _health(run_dir, records: list[dict], events: list[dict]) -> dict:
    """What went wrong, as the run recorded it: loss spikes and what was done (train.spike.*), non-finite updates
    dropped, stragglers named, hang dumps written (docs/health.md)."""
    hangs = run_dir / "hangs"
    return {
        "loss_spikes": [e for e in events if e["event"].startswith("loss_spike_")],
        "nonfinite_steps": [r["step"] for r in records
                            if r.get("update_skipped") and not math.isfinite(r.get("loss", math.nan))],
        "stragglers": [e for e in events if e["event"] == "straggler"],
        "hangs": sorted(p.name for p in hangs.iterdir()) if hangs.exists() else [],
    }


def _health_line(health: dict) -> str:
    flags = []
    if health["loss_spikes"]:
        spikes, newest = health["loss_spikes"], health["loss_spikes"][-1]
        actions = {e["event"].removeprefix("loss_spike_") for e in spikes}
        flags.append(f"{len(spikes)} loss spike(s) ({', '.join(sorted(actions))}; newest at step {newest['step']}: "
                     f"loss {newest['loss']:.4f}, {newest['loss'] / newest['median']:.2f}x the median)")
    if health["nonfinite_steps"]:
        steps = health["nonfinite_steps"]
        flags.append(f"{len(steps)} non-finite update(s) dropped (newest at step {steps[-1]})")
    if health["stragglers"]:
        named = health["stragglers"][-1]
        flags.append(f"straggler: process {named['process']} at step {named['step']} (batches "
                     f"{named['batch_s']:.2f} s a step, the others {named['median_batch_s']:.2f} s)")
    if health["hangs"]:
        flags.append(f"{len(health['hangs'])} hang dump(s) in hangs/ (newest {health['hangs'][-1]})")
    return "  health: " + ("; ".join(flags) if flags else "ok")


def plot(report: dict, path: str | os.PathLike) -> None:
    """The loss and eval-loss curves, a small PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3), dpi=100)
    if report["losses"]:
        ax.plot(*zip(*report["losses"]), label="loss", linewidth=1)
    if report["eval_loss"]:
        ax.plot(*zip(*report["eval_loss"]), "o-", label="eval loss", markersize=3)
    ax.set_xlabel("step")
    ax.set_title(os.path.basename(report["run_dir"].rstrip("/")), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def describe(report: dict) -> str:
    """The text report."""
    r, lines = report, []
    lines.append(f"{r['run_dir']}: {r['state']}, step {r['step']:,} of {r['steps']:,} ({r['tokens']:,} tokens)"
                 + (f", ETA {r['eta_s'] / 60:.1f} min" if r["eta_s"] else ""))
    lock = r["lock"]
    if lock:
        lines.append(f"  lock: process {lock.get('pid')} on {lock.get('host')} since {lock.get('started')}"
                     + ("" if lock["alive"] else " (not held: the run is gone)"))
    if r["last_record_age_s"] is not None:
        lines.append(f"  last record {r['last_record_age_s']:.0f} s ago")
    lines.append(f"  newest checkpoint: step {r['newest_checkpoint']}" if r["newest_checkpoint"] is not None else
                 "  newest checkpoint: none")
    if r["losses"]:
        lines.append(f"  loss {r['loss']:.4f}  {sparkline([v for _, v in r['losses']])}")  # nan, inf print as such
    if r["eval_loss"]:
        lines.append(f"  eval loss {r['eval_loss'][-1][1]:.4f}  {sparkline([v for _, v in r['eval_loss']])}")
    if r["goodput"]:
        total = r["goodput"]
        lines.append(f"  {goodput.describe(total)}; {total['attempts']} start(s), {total['redone_steps']} steps redone")
    lines.append(_health_line(r["health"]))
    return "\n".join(lines)
