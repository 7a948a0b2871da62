"""Orbax checkpoints: the training state and the data position, saved asynchronously, restored into any mesh.

Restore targets are abstract arrays carrying the *current* run's shardings, so Orbax reads each shard
straight into place. Every save records fingerprints of its arrays, its data position and its metadata
(integrity.py), and a restore verifies them. A newest checkpoint that is incomplete (no commit marker), cannot be
read or fails verification is reported and the previous one is used; a damaged one is never deleted: it is moved
aside to `damaged_checkpoints/` once the run is known to proceed, and the checkpoint the run resumed from is kept
whatever `max_to_keep` says until a later run resumes from a newer one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from scaletrain.errors import CheckpointError, first_line
from scaletrain.store import integrity, storage

ITEMS = ("state", "data", "meta")
# Orbax writes this file into a step (and into each item) just before it commits the step, also where commit is
# an atomic rename: a step folder without it was never finished, whatever the storage.
COMMIT_MARKER = "commit_success.txt"
DAMAGED = "damaged_checkpoints"  # beside checkpoints/: steps that failed verification, kept for inspection


def _loop_closed(error: BaseException | None) -> bool:
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


class _DropAbandoned(logging.Filter):
    """Drops the loop-closed errors, and asyncio's report of the abandoned reads' own failures (the unreadable
    files, already named in the skipped step's warning) when their tasks are collected."""

    def filter(self, record: logging.LogRecord) -> bool:
        abandoned = record.name == "asyncio" and "exception was never retrieved" in record.getMessage()
        return not (abandoned or (record.exc_info and _loop_closed(record.exc_info[1])))


def _silence_abandoned_reads() -> None:
    """A failed restore leaves Tensorstore reads in flight; their callbacks later find Orbax's event loop closed
    and each would print a traceback - as an unraisable exception, from a Python or a native thread, or logged by
    a future's callback - and asyncio logs the reads' own failures when their tasks are collected: the aftermath
    of an error already reported in one line. Only those are dropped. Installed before a restore starts: a read
    can finish after Orbax closes its loop but before the restore's exception reaches the caller."""
    previous = sys.unraisablehook
    if getattr(previous, "scaletrain", False):
        return

    def unraisable_hook(unraisable):
        if not _loop_closed(unraisable.exc_value):
            previous(unraisable)

    previous_thread_hook = threading.excepthook

    def thread_hook(args):
        if not _loop_closed(args.exc_value):
            previous_thread_hook(args)

    previous_excepthook = sys.excepthook

    def excepthook(kind, value, traceback):  # a callback run from a native thread, printed with PyErr_Print
        if not _loop_closed(value):
            previous_excepthook(kind, value, traceback)

    unraisable_hook.scaletrain = True
    sys.unraisablehook, threading.excepthook, sys.excepthook = unraisable_hook, thread_hook, excepthook
    logging.getLogger("concurrent.futures").addFilter(_DropAbandoned())
    logging.getLogger("asyncio").addFilter(_DropAbandoned())


def locate(location: str | os.PathLike) -> tuple[epath.Path, int | None]:
    """A run directory, its checkpoints/ folder or one step's folder, local or gs:// -> (checkpoints folder, step
    or None)."""
    path = storage.path(location)
    if (path / "checkpoints").is_dir():
        return path / "checkpoints", None
    if path.name.isdigit() and (path / "state").is_dir():
        return path.parent, int(path.name)
    if path.is_dir():
        return path, None
    raise CheckpointError(f"'{path}' is not a run directory, a checkpoints/ folder or a checkpoint step folder")


class _Protected(ocp.checkpoint_managers.PreservationPolicy):
    """Keeps the steps in a set that may grow after the manager is made: the step a run resumed from (its newest
    verified checkpoint) and steps that could not be read (never deleted)."""

    def __init__(self, steps: set[int]):
        self.steps = steps

    def should_preserve(self, checkpoints, *, context):
        return [c.step in self.steps for c in checkpoints]


class Checkpointer:
    def __init__(self, directory: str | os.PathLike, max_to_keep: int, async_save: bool):
        self.directory = storage.path(directory)
        self.protected: set[int] = set()
        self.manager = ocp.CheckpointManager(
            self.directory,
            # Folders left by a save that was killed mid-write go at start-up; finished ones are deleted only
            # after a newer save has committed (max_to_keep), and never the protected ones.
            options=ocp.CheckpointManagerOptions(
                enable_async_checkpointing=async_save, create=True, cleanup_tmp_directories=True,
                preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(
                    [ocp.checkpoint_managers.LatestN(n=max_to_keep), _Protected(self.protected)])),
            item_names=ITEMS,
        )
        self.incomplete: set[int] = set()  # no commit marker: a killed save, replaced when the run gets there again
        self.damaged: set[int] = set()  # committed but unreadable or failing verification: moved aside, never lost
        self._fingerprint = None

    def _fingerprints(self, state: Any) -> dict[str, str]:
        if self._fingerprint is None:  # one jitted function: the state keeps its shardings for the whole run
            self._fingerprint = integrity.make(state)
        return integrity.by_path(state, self._fingerprint(state))

    def save(self, step: int, state: Any, data_state: dict, meta: dict) -> None:
        """Returns once the arrays are copied off the devices; the write finishes in the background."""
        if step in self.incomplete:
            self.manager.delete(step)
            self.incomplete.discard(step)
        meta = {**meta, "integrity": {"version": integrity.VERSION, "state": self._fingerprints(state),
                                      "data": integrity.of_json(data_state), "meta": integrity.of_json(meta)}}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        data=ocp.args.JsonSave(data_state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)

    def newest_before(self, step: int) -> int | None:
        """The newest checkpoint's step from before `step` (None: none was saved)."""
        return max((s for s in self.manager.all_steps() if s < step), default=None)

    def restore_latest(self, abstract_state: Any, before: int | None = None) -> tuple[int, Any, dict, dict] | None:
        """(step, state, data_state, metadata) from the newest readable and verified checkpoint (from before step
        `before`, if given), or None if there is none."""
        steps = sorted((s for s in self.manager.all_steps() if before is None or s < before), reverse=True)
        _silence_abandoned_reads()
        for step in steps:
            try:
                self._check_committed(step)
            except CheckpointError as e:
                self._skip(step, f"incomplete ({e})", self.incomplete)
                continue
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
                    meta=ocp.args.JsonRestore()))
                problem = self._verify(restored)
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped, and said so
                problem = f"unreadable ({first_line(e)})"
            if problem:
                self._skip(step, problem, self.damaged)
                continue
            self.protected.add(step)
            return step, restored.state, dict(restored.data), dict(restored.meta)
        if steps:
            raise CheckpointError(f"no readable checkpoint in {self.manager.directory} (tried steps "
                                  f"{', '.join(map(str, steps))}); nothing was changed; move the directory away "
                                  f"to start afresh")
        return None

    def _verify(self, restored) -> str | None:
        """What is wrong with a restored checkpoint, or None if its fingerprints match."""
        meta = dict(restored.meta)
        recorded = meta.pop("integrity", None)
        if recorded is None or recorded.get("version") != integrity.VERSION:
            if jax.process_index() == 0:
                print("warning: this checkpoint has no fingerprints this scaletrain can check (saved by another "
                      "version): restored unverified", file=sys.stderr)
            return None
        if integrity.of_json(meta) != recorded.get("meta"):
            return "damaged: its metadata differs from its fingerprint"
        if integrity.of_json(dict(restored.data)) != recorded.get("data"):
            return "damaged: its data position differs from its fingerprint"
        wrong = integrity.mismatches(recorded.get("state", {}), self._fingerprints(restored.state))
        if wrong:
            return (f"damaged: {len(wrong)} array{'s differ' if len(wrong) > 1 else ' differs'} from its fingerprint "
                    f"({', '.join(wrong[:2])}{', ...' if len(wrong) > 2 else ''})")
        return None

    def _skip(self, step: int, problem: str, kind: set[int]) -> None:
        kind.add(step)
        self.protected.add(step)
        if jax.process_index() == 0:
            print(f"warning: checkpoint at step {step} is {problem}; trying an older one", file=sys.stderr,
                  flush=True)

    def set_aside_damaged(self) -> None:
        """Moves each damaged step to damaged_checkpoints/ (once the run is known to proceed): out of the way of
        the run's own saves and of `max_to_keep`, kept for whoever wants to look at it."""
        if not self.damaged:
            return
        if jax.process_index() == 0:
            for step in sorted(self.damaged):
                target = self.directory.parent / DAMAGED / str(step)
                suffix = 1
                while target.exists():
                    target, suffix = self.directory.parent / DAMAGED / f"{step}-{suffix}", suffix + 1
                target.parent.mkdir(parents=True, exist_ok=True)
                (self.directory / str(step)).rename(target)
                print(f"moved the damaged checkpoint at step {step} to {target}", flush=True)
        multihost_utils.sync_global_devices("scaletrain: damaged checkpoints set aside")
        self.protected -= self.damaged
        self.damaged.clear()
        self.manager.reload()

    def _check_committed(self, step: int) -> None:
        folder = self.manager.directory / str(step)  # an epath: local or gs://
        for item in ("", *ITEMS):
            if not (folder / item / COMMIT_MARKER).exists():
                raise CheckpointError(f"{folder / item / COMMIT_MARKER} is missing")

    def wait(self) -> None:
        """Block until every save is durable on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


@contextlib.contextmanager
def _absl_quiet(level: int):
    """Orbax's absl log lines below `level` left out: ours say what went wrong, in one line."""
    absl = logging.getLogger("absl")
    before = absl.level
    absl.setLevel(level)
    try:
        yield
    finally:
        absl.setLevel(before)


def _read_only(directory: epath.Path) -> ocp.CheckpointManager:
    # Orbax warns, twice, that a read-only manager will not save, and logs a damaged step's metadata file whole as an
    # error: what is wrong with a step is reported where it is read, in one line.
    with _absl_quiet(logging.CRITICAL):
        return ocp.CheckpointManager(directory, item_names=ITEMS,
                                     options=ocp.CheckpointManagerOptions(read_only=True, create=False))


def saved_steps(directory: epath.Path) -> list[int]:
    """The committed checkpoints' steps in a checkpoints/ folder (none where there is no folder), read only."""
    return sorted(_read_only(directory).all_steps()) if directory.is_dir() else []


def read_metadata(directory: epath.Path, step: int | None = None) -> tuple[int, dict]:
    """(step, metadata) of the newest checkpoint, or of `step`: what `ckpt inspect` prints."""
    return _metadata(_read_only(directory), directory, step)


def _metadata(manager: ocp.CheckpointManager, directory: epath.Path, step: int | None) -> tuple[int, dict]:
    steps = manager.all_steps()
    if not steps:
        raise CheckpointError(f"no checkpoints in {directory}; expected a run directory's checkpoints/ folder")
    step = max(steps) if step is None else step
    if step not in steps:
        raise CheckpointError(f"no checkpoint at step {step} in {directory}; there are {sorted(steps)}")
    try:
        with _absl_quiet(logging.CRITICAL):  # Orbax logs a damaged metadata file's whole text as an error
            meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # noqa: BLE001 - reported as one line
        raise CheckpointError(f"checkpoint at step {step} in {directory} has no readable metadata ({type(e).__name__}:"
                              f" its folder is empty or damaged); expected a step a run committed - name another "
                              f"with --step, or move this one aside") from None
    return step, dict(meta)


def check_resumable(directory: epath.Path, meta: dict, run_dir: str) -> bool:
    """Whether there are checkpoints to resume; refuses (CheckpointError) to resume checkpoints of another model -
    other array shapes or dtypes, another vocabulary - naming the config keys that differ. Reads only: run before
    anything is written."""
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"'{directory}' is a file; expected the run's checkpoints folder (or nothing)")
    if not directory.exists():
        return False
    manager = _read_only(directory)
    steps = manager.all_steps()
    _silence_abandoned_reads()
    for step in sorted(steps, reverse=True):
        try:
            saved = dict(manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)
        except Exception:  # noqa: BLE001 - an unreadable step is the restore's to report; look at an older one
            continue
        break
    else:
        return bool(steps)
    if saved.get("params_only"):
        raise CheckpointError(f"run_dir '{run_dir}' holds a parameters-only checkpoint (step {step}, written by "
                              f"`convert from-hf`): it has no optimizer state to resume. Nothing was changed. To "
                              f"train from it, give this run another run_dir and add checkpoint.init_from={run_dir}")

    def layout(m: dict) -> dict:
        return {p: (a["shape"], a["dtype"]) for p, a in m.get("arrays", {}).items()}

    if layout(saved) == layout(meta):
        return True
    then, now = saved.get("config", {}).get("model", {}), meta["config"]["model"]
    keys = sorted(k for k in then.keys() | now.keys() if then.get(k) != now.get(k))
    if keys:
        what = "; ".join(f"model.{k} is {then.get(k)} there, {now.get(k)} here" for k in keys[:4])
    else:
        path = next(p for p in sorted(layout(saved).keys() | layout(meta).keys())
                    if layout(saved).get(p) != layout(meta).get(p))
        what = f"array {path} is {layout(saved).get(path)} there, {layout(meta).get(path)} here"
    # checkpoint.init_from reads parameters of the shapes this model has: advised only where none differs - and
    # with another run_dir, as init_from starts only a run_dir without checkpoints (this one would refuse it again).
    shared = layout(saved).keys() & layout(meta).keys()
    if any(layout(saved)[p][0] != layout(meta)[p][0] for p in shared):
        advice = "; its parameters' shapes differ from this model's, so they cannot start it either"
    else:
        advice = (f", and add checkpoint.init_from={run_dir} to start it from those parameters (init_from starts "
                  f"only a run_dir that holds no checkpoints)")
    raise CheckpointError(f"run_dir '{run_dir}' holds checkpoints (step {step}) of another model: {what}. Nothing "
                          f"was changed. To train this model, give it another run_dir{advice}")


def params_source(path: str | os.PathLike, abstract_params: Any, what: str = "checkpoint.init_from",
                  step: int | None = None) -> tuple[ocp.CheckpointManager, epath.Path, int, dict, dict]:
    """(read-only manager, checkpoints folder, step, metadata, saved parameter arrays) of the checkpoint
    `restore_params` would read, its parameter shapes checked against `abstract_params` from the saved metadata
    alone, so a mismatched model is one clear error (starting with `what`), found before anything is compiled.
    Parameters the checkpoint leaves out because its run keeps them elsewhere (a LoRA run's base: metadata
    `base`) are checked there."""
    try:
        directory, found = locate(path)
    except CheckpointError as e:
        raise CheckpointError(f"{what}: {e}") from None
    step = found if step is None else step
    manager = _read_only(directory)
    step, meta = _metadata(manager, directory, step)
    wanted = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}
    saved = {p.removeprefix(".params"): a for p, a in meta["arrays"].items() if p.startswith(".params")}
    for name, x in wanted.items():
        if name not in saved and meta.get("base"):
            continue  # checked in the base's checkpoint (restore_params)
        if name not in saved and name.startswith("['mtp']"):
            raise CheckpointError(f"{what}: {directory / str(step)} has no multi-token prediction modules, which "
                                  f"model.mtp_depth={x.shape[0]} asks for (its model was converted or trained "
                                  f"without them); set model.mtp_depth=0, or start from a checkpoint that has them")
        if name not in saved:
            raise CheckpointError(f"{what}: {directory / str(step)} has no parameter {name}; "
                                  f"it was saved by another model (it has {len(saved)} parameter arrays)")
        if tuple(saved[name]["shape"]) != x.shape:
            raise CheckpointError(f"{what}: parameter {name} is {tuple(saved[name]['shape'])} in "
                                  f"{directory / str(step)} but {x.shape} in this model; the model configs differ")
    return manager, directory, step, meta, saved


def _subtree(tree: Any, keep) -> Any:
    """The nested dict `tree` with only the leaves whose path (a keystr) `keep` accepts; None when none."""
    if not isinstance(tree, dict):
        return None
    out = {}
    for key, value in tree.items():
        part = _subtree(value, lambda p, key=key: keep(f"[{key!r}]{p}")) if isinstance(value, dict) else (
            value if keep(f"[{key!r}]") else None)
        if part is not None:
            out[key] = part
    return out or None


def joined(a: Any, b: Any) -> Any:
    """Two nested dicts of parameters with disjoint leaves as one (a run's own parameters and its base's)."""
    if a is None or b is None:
        return b if a is None else a
    return {k: joined(a.get(k), b.get(k)) for k in a.keys() | b.keys()}


def restore_params(path: str | os.PathLike, abstract_params: Any, what: str = "checkpoint.init_from",
                   step: int | None = None) -> tuple[int, Any]:
    """(step, parameters) of a checkpoint (the newest, or `step`), placed with the shardings of
    `abstract_params` (a nested dict), verified against their fingerprints; its optimizer state and data position
    are not read. Parameters its run left out of it (a LoRA run's base, kept at its checkpoint.init_from: the
    metadata's `base`) are read from there."""
    manager, directory, step, meta, saved = params_source(path, abstract_params, what, step)
    own = _subtree(abstract_params, lambda name: name in saved)
    elsewhere = _subtree(abstract_params, lambda name: name not in saved)
    params = _read_params(manager, directory, step, meta, saved, own, what) if own is not None else None
    if elsewhere is not None:
        base = meta["base"]
        _, rest = restore_params(base, elsewhere, f"{what} (the base of {directory / str(step)}, kept at {base})")
        params = joined(params, rest)
    return step, params


def _read_params(manager: ocp.CheckpointManager, directory: epath.Path, step: int, meta: dict, saved: dict,
                 abstract_params: Any, what: str) -> Any:
    # Read as saved, verified, then cast: a fingerprint is of the saved bits.
    saved_dtypes = jax.tree.map(lambda x: saved[x]["dtype"],
                                jax.tree_util.tree_map_with_path(lambda p, _: jax.tree_util.keystr(p), abstract_params))
    restore_args = jax.tree.map(lambda x, dt: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=dt), abstract_params,
                                saved_dtypes)
    _silence_abandoned_reads()
    try:
        restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item={"params": abstract_params}, restore_args={"params": restore_args}, partial_restore=True)))
    except Exception as e:  # noqa: BLE001 - reported as one line
        raise CheckpointError(f"{what}: cannot read the parameters at {directory / str(step)} "
                              f"({first_line(e)})") from None
    params = restored.state["params"]
    recorded = meta.get("integrity", {})
    recorded = recorded.get("state") if recorded.get("version") == integrity.VERSION else None
    if recorded is not None:
        found = {f".params{p}": f for p, f in integrity.by_path(params, integrity.make(params)(params)).items()}
        wrong = integrity.mismatches({p: recorded.get(p) for p in found}, found)
        if wrong:
            raise CheckpointError(f"{what}: the checkpoint at {directory / str(step)} is damaged: {wrong[0]} "
                                  f"differs from its fingerprint; choose another step")
    return jax.tree.map(lambda x, a: x if x.dtype == a.dtype else x.astype(a.dtype), params, abstract_params)
