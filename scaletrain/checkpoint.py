"""Orbax checkpoints: the training state and the data position, saved asynchronously, restored into any mesh.

Restore targets are abstract arrays carrying the *current* run's shardings, so Orbax reads each shard
straight into place. A newest checkpoint that cannot be read is reported and the previous one is used.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from scaletrain.errors import CheckpointError


class Checkpointer:
    def __init__(self, directory: Path, max_to_keep: int, async_save: bool):
        self.manager = ocp.CheckpointManager(
            Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                                 create=True),
            item_names=("state", "data", "meta"),
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
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped, and said so
                reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                print(f"warning: checkpoint at step {step} is unreadable ({reason}); trying an older one",
                      file=sys.stderr)
                self.unreadable.add(step)
                continue
            return step, restored.state, dict(restored.data)
        if steps:
            raise CheckpointError(f"no readable checkpoint in {self.manager.directory} (tried steps "
                                  f"{', '.join(map(str, steps))}); move the directory away to start afresh")
        return None

    def wait(self) -> None:
        """Block until every save is durable on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def read_metadata(directory: Path, step: int | None = None) -> tuple[int, dict]:
    """(step, metadata) of the newest checkpoint, or of `step`: what `ckpt inspect` prints."""
    manager = ocp.CheckpointManager(Path(directory).absolute(), item_names=("state", "data", "meta"),
                                    options=ocp.CheckpointManagerOptions(read_only=True, create=False))
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

