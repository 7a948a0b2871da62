"""`python -m scaletrain status RUN_DIR`: where a run is, read from its run directory alone (docs/health.md).

Reads config.yaml, metrics.jsonl, goodput.json, run.lock, the checkpoints' list and the hang dumps' names - never
writes there, so it is safe beside a live run, on a finished one and on a gs:// run directory. The loss curves go
to a small PNG (in the current directory by default) and a text sparkline; health flags from the run's records."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
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


def _records(run_dir, warnings: list[str]) -> list[dict]:
    """metrics.jsonl's records: step records (an integer `step`) and events (a string `event`). A last line that
    is no JSON is one being written, or cut short by a kill, and is left out quietly; any other line that is not a
    record is left out with a warning."""
    path = run_dir / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines() if path.exists() else []
    except (OSError, UnicodeDecodeError) as e:
        warnings.append(f"metrics.jsonl cannot be read ({_reason(e)}): no steps, losses or events")
        return []
    out, odd = [], 0
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            odd += number < len(lines)
            continue
        if isinstance(record, dict) and (isinstance(record.get("event"), str) or _is_step(record.get("step"))):
            out.append(record)
        else:
            odd += 1
    if odd:
        warnings.append(f"metrics.jsonl: {odd} line(s) are not records (a JSON object with an integer step or an "
                        f"event); left out")
    return out


def _is_step(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(record: dict, key: str) -> bool:
    return isinstance(record.get(key), (int, float)) and not isinstance(record.get(key), bool)


def _reason(error: Exception) -> str:
    """An exception as a few words: its first line, or what it names."""
    if isinstance(error, KeyError):
        return f"no {error}"
    return (str(error).splitlines() or [""])[0][:120] or type(error).__name__


def _plan(run_dir, warnings: list[str]) -> tuple[int | None, int | None]:
    """(steps, tokens per step) from the run's config.yaml; (None, None) with a warning where it is damaged."""
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        return int(cfg["steps"]), int(cfg["train"]["global_batch"]) * int(cfg["data"]["seq_len"])
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError, ValueError) as e:
        warnings.append(f"config.yaml is not a run's config ({_reason(e)}; expected the YAML a run writes, with "
                        f"steps, train.global_batch and data.seq_len): the steps to go and the tokens are unknown")
        return None, None


def _goodput(location: str, warnings: list[str]) -> tuple[list[dict], dict | None]:
    """goodput.json's attempts and their totals; none, with a warning, where the file is damaged."""
    try:
        attempts = goodput.read(location)
        return attempts, (goodput.totals(attempts) if attempts else None)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.append(f"goodput.json is not a goodput record ({_reason(e)}; expected the attempts a run "
                        f"writes): goodput unknown")
        return [], None


def _holder(run_dir, warnings: list[str]) -> dict | None:
    """The run lock's holder record, with whether it is alive: its heartbeat recent (a bucket's lock beats every
    15 s; a local one is written once, and held while the process lives)."""
    path = run_dir / LOCK_FILE
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # none, or one being written
    if not isinstance(holder, dict):
        warnings.append(f"{LOCK_FILE} holds no lock record (a JSON {type(holder).__name__}; expected an object with "
                        f"pid, host and started): the holder is unknown")
        return None
    try:
        if storage.is_remote(str(run_dir)):
            holder["alive"] = time.time() - float(holder.get("heartbeat", 0)) < STALE_AFTER_S
        else:
            holder["alive"] = _flocked(path, holder)
    except (OSError, TypeError, ValueError) as e:
        warnings.append(f"{LOCK_FILE}'s record is damaged ({_reason(e)}): taken as not held")
        holder["alive"] = False
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
    """Everything `status` prints, as a dict (--json). A damaged or odd file costs what it holds - named in
    `warnings` - and never the rest of the report: `status` is for exactly the runs that went wrong."""
    run_dir = storage.path(location)
    if not (run_dir / "config.yaml").exists():
        raise UserError(f"'{location}' is not a run directory (no config.yaml); expected the run_dir of a run that "
                        f"has started")
    warnings: list[str] = []
    total_steps, tokens_per_step = _plan(run_dir, warnings)
    records = _records(run_dir, warnings)
    events = [r for r in records if "event" in r]
    records = [r for r in records if "event" not in r]
    holder = _holder(run_dir, warnings)
    attempts, totals = _goodput(location, warnings)
    ended = attempts[-1].get("ended") if attempts else None
    step = records[-1]["step"] if records else 0
    recorded = attempts[-1].get("last_step") if attempts else None
    if not records and _is_step(recorded) and recorded:
        warnings.append(f"metrics.jsonl holds no step records, where goodput.json's last start reached step "
                        f"{recorded}: the step is goodput's, the losses unknown")
        step = recorded
    running = bool(holder and holder["alive"])
    times = sorted(r["step_time_s"] for r in records[-ETA_WINDOW:] if _number(r, "step_time_s"))
    try:
        checkpoints = checkpoint.saved_steps(run_dir / "checkpoints")
    except (OSError, ValueError) as e:
        warnings.append(f"checkpoints/ cannot be listed ({_reason(e)})")
        checkpoints = []
    return {
        "run_dir": str(run_dir),
        "state": "running" if running else ended or ("stopped" if step else "not started"),
        "step": step, "steps": total_steps, "tokens": step * tokens_per_step if tokens_per_step else None,
        # Only a live run has an ETA: a stopped one goes nowhere until it is started again.
        "eta_s": (total_steps - step) * times[len(times) // 2]
        if running and times and total_steps and step < total_steps else 0.0,
        "loss": records[-1].get("loss") if records and _number(records[-1], "loss") else None,
        "eval_loss": [(r["step"], r["eval_loss"]) for r in records if _number(r, "eval_loss")],
        "newest_checkpoint": checkpoints[-1] if checkpoints else None,
        "lock": holder,
        "last_record_age_s": time.time() - attempts[-1]["updated"] if totals else None,
        "goodput": totals,
        "losses": [(r["step"], r["loss"]) for r in records if _number(r, "loss")],
        "health": _health(run_dir, records, events, warnings),
        "warnings": warnings,
    }


def _health(run_dir, records: list[dict], events: list[dict], warnings: list[str]) -> dict:
    """What went wrong, as the run recorded it: loss spikes and what was done (train.spike.*), non-finite updates
    dropped, stragglers named, hang dumps written, oldest first (docs/health.md)."""
    spike_keys, straggler_keys = ("step", "loss", "median"), ("process", "step", "batch_s", "median_batch_s")
    spikes = [e for e in events if e["event"].startswith("loss_spike_")]
    stragglers = [e for e in events if e["event"] == "straggler"]
    odd = [e for e in spikes if not all(_number(e, k) for k in spike_keys)]
    odd += [e for e in stragglers if not all(_number(e, k) for k in straggler_keys)]
    if odd:
        warnings.append(f"metrics.jsonl: {len(odd)} event(s) lack their figures; left out")
    return {
        "loss_spikes": [e for e in spikes if e not in odd],
        "nonfinite_steps": [r["step"] for r in records
                            if r.get("update_skipped") and not (_number(r, "loss") and math.isfinite(r["loss"]))],
        "stragglers": [e for e in stragglers if e not in odd],
        "hangs": _hangs(run_dir / "hangs", warnings),
    }


def _hangs(folder, warnings: list[str]) -> list[str]:
    """The hang dumps' names, oldest first: by the time they were written, then by step (names sort step 10 before
    step 9)."""
    if not folder.exists():
        return []
    if not folder.is_dir():
        warnings.append("hangs is not a folder (the watchdog writes its dumps in RUN_DIR/hangs/): no hang dumps read")
        return []

    def written(dump) -> tuple:
        step = re.search(r"step-(\d+)", dump.name)
        return dump.stat().mtime, int(step.group(1)) if step else -1, dump.name

    try:
        return [dump.name for dump in sorted(folder.iterdir(), key=written)]
    except OSError as e:
        warnings.append(f"hangs/ cannot be read ({_reason(e)})")
        return []


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
    if report["losses"] or report["eval_loss"]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def describe(report: dict) -> str:
    """The text report."""
    r, lines = report, []
    lines.append(f"{r['run_dir']}: {r['state']}, step {r['step']:,}"
                 + (f" of {r['steps']:,} ({r['tokens']:,} tokens)" if r["steps"] is not None else "")
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
