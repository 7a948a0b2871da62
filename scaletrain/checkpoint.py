"""Orbax checkpoints: the training state and the data position, saved asynchronously, restored into any mesh.

Restore targets are abstract arrays carrying the *current* run's shardings, so Orbax reads each shard
straight into place. A newest checkpoint that is incomplete (no commit marker) or cannot be read is reported
and the previous one is used.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from scaletrain import storage
from scaletrain.errors import CheckpointError, first_line

ITEMS = ("state", "data", "meta")
# Orbax writes this file into a step (and into each item) just before it commits the step, also where commit is
# an atomic rename: a step folder without it was never finished, whatever the storage.
COMMIT_MARKER = "commit_success.txt"


def _silence_abandoned_reads() -> None:
    """A failed restore leaves Tensorstore reads in flight; their callbacks later find Orbax's event loop closed
    and each would print a traceback, the aftermath of an error already reported in one line. Only that
    exception is dropped."""
    previous = sys.unraisablehook
    if getattr(previous, "scaletrain", False):
        return

    def hook(unraisable):
        error = unraisable.exc_value
        if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
            previous(unraisable)

    hook.scaletrain = True
    sys.unraisablehook = hook


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


class Checkpointer:
    def __init__(self, directory: str | os.PathLike, max_to_keep: int, async_save: bool):
        self.manager = ocp.CheckpointManager(
            storage.path(directory),
            # Folders left by a save that was killed mid-write go at start-up; finished ones are deleted only
            # after a newer save has committed (max_to_keep).
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                                 create=True, cleanup_tmp_directories=True),
            item_names=ITEMS,
        )
        self.unreadable: set[int] = set()  # steps skipped at restore: rewritten when the run gets there again

    def save(self, step: int, state: Any, data_state: dict, meta: dict) -> None:
        """Returns once the arrays are copied off the devices; the write finishes in the background."""
        if step in self.unreadable:
            self.manager.delete(step)
            self.unreadable.discard(step)
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        data=ocp.args.JsonSave(data_state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
        """(step, state, data_state) from the newest readable checkpoint, or None if there is none."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        for step in steps:
            try:
                self._check_committed(step)
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped, and said so
                _silence_abandoned_reads()
                if jax.process_index() == 0:
                    print(f"warning: checkpoint at step {step} is unreadable ({first_line(e)}); trying an older one",
                          file=sys.stderr)
                self.unreadable.add(step)
                continue
            return step, restored.state, dict(restored.data)
        if steps:
            raise CheckpointError(f"no readable checkpoint in {self.manager.directory} (tried steps "
                                  f"{', '.join(map(str, steps))}); move the directory away to start afresh")
        return None

    def _check_committed(self, step: int) -> None:
        folder = self.manager.directory / str(step)  # an epath: local or gs://
        for item in ("", *ITEMS):
            if not (folder / item / COMMIT_MARKER).exists():
                raise CheckpointError(f"incomplete: {folder / item / COMMIT_MARKER} is missing")

    def wait(self) -> None:
        """Block until every save is durable on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def _read_only(directory: epath.Path) -> ocp.CheckpointManager:
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # Orbax warns, twice, that a read-only manager will not save
    try:
        return ocp.CheckpointManager(directory, item_names=ITEMS,
                                     options=ocp.CheckpointManagerOptions(read_only=True, create=False))
    finally:
        absl.setLevel(level)


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
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # noqa: BLE001 - reported as one line
        raise CheckpointError(f"checkpoint at step {step} has no readable metadata ({type(e).__name__})") from None
    return step, dict(meta)


def restore_params(path: str | os.PathLike, abstract_params: Any, what: str = "checkpoint.init_from",
                   step: int | None = None) -> tuple[int, Any]:
    """(step, parameters) of a checkpoint (the newest, or `step`), placed with the shardings of
    `abstract_params`; its optimizer state and data position are not read. Shapes are checked against the saved
    metadata first, so a mismatched model is one clear error (starting with `what`) rather than an Orbax
    traceback."""
    directory, found = locate(path)
    step = found if step is None else step
    manager = _read_only(directory)
    step, meta = _metadata(manager, directory, step)
    wanted = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}
    saved = {p.removeprefix(".params"): a for p, a in meta["arrays"].items() if p.startswith(".params")}
    for name, x in wanted.items():
        if name not in saved:
            raise CheckpointError(f"{what}: {directory / str(step)} has no parameter {name}; "
                                  f"it was saved by another model (it has {len(saved)} parameter arrays)")
        if tuple(saved[name]["shape"]) != x.shape:
            raise CheckpointError(f"{what}: parameter {name} is {tuple(saved[name]['shape'])} in "
                                  f"{directory / str(step)} but {x.shape} in this model; the model configs differ")
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=x.dtype), abstract_params)
    try:
        restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item={"params": abstract_params}, restore_args={"params": restore_args}, partial_restore=True)))
    except Exception as e:  # noqa: BLE001 - reported as one line
        _silence_abandoned_reads()
        raise CheckpointError(f"{what}: cannot read the parameters at {directory / str(step)} "
                              f"({first_line(e)})") from None
    return step, restored.state["params"]
