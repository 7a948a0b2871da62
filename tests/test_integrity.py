"""Garbled bytes in any file of a checkpoint never reach training: a restore gives back the saved arrays bit for
bit, or reports the step and falls back to the previous one; damaged steps are set aside, never deleted."""

import json
import random
import shutil

import jax
import numpy as np
import pytest

from scaletrain import config
from scaletrain.errors import CheckpointError
from scaletrain.store import integrity
from scaletrain.store.checkpoint import DAMAGED, Checkpointer, restore_params
from scaletrain.train import trainer
from tests import equivalence
from tests.conftest import tiny_overrides

STEPS = 2


def _setup(*overrides):
    return trainer.build(config.load(None, tiny_overrides("unused", steps=STEPS) + list(overrides)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, batches):
    """Steps 1 and 2 of fsdp=8 (compiled and started as tests/equivalence.py does), saved; the arrays each holds."""
    setup = _setup("mesh.fsdp=8")
    state, train_step = equivalence.start(setup), equivalence.compiled_step(setup)
    directory = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    ckpt = Checkpointer(directory, max_to_keep=5, async_save=False)
    arrays = {}
    for step, batch in enumerate(batches, start=1):
        state, _ = train_step(state, setup.put_batch(batch), setup.loss_ceiling())
        arrays[step] = jax.device_get(state)
        ckpt.save(step, state, {"next_sample": 8 * step}, trainer.checkpoint_metadata(setup))
    ckpt.wait()
    ckpt.close()
    return setup, directory, arrays


def _assert_equal(got, want):
    for a, b in zip(jax.tree.leaves(jax.device_get(got)), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mesh", [["mesh.data=2", "mesh.fsdp=4"], ["mesh.fsdp=4", "mesh.tensor=2"],
                                  ["mesh.fsdp=8", "params.offload=true", "optim.offload=true"]])
def test_fingerprints_do_not_depend_on_the_mesh(saved, mesh):
    setup, _, arrays = saved
    here = jax.device_put(arrays[2], setup.state_shardings)
    want = integrity.by_path(here, integrity.make(here)(here))
    other = _setup(*mesh)
    there = jax.device_put(arrays[2], other.state_shardings)
    assert integrity.by_path(there, integrity.make(there)(there)) == want


def test_one_changed_bit_changes_that_arrays_fingerprint(saved):
    _, _, arrays = saved
    fingerprint = integrity.make(arrays[2])
    want = integrity.by_path(arrays[2], fingerprint(arrays[2]))
    leaves, treedef = jax.tree.flatten(arrays[2])
    for i in range(len(leaves)):
        changed = [np.array(x) for x in leaves]
        changed[i].reshape(-1).view(np.uint8)[changed[i].nbytes // 2] ^= 1
        got = integrity.by_path(arrays[2], fingerprint(jax.tree.unflatten(treedef, changed)))
        assert integrity.mismatches(want, got) == [list(want)[i]]


def _garble(path, offset_fraction, rng):
    """Up to 2,000 bytes overwritten in place, at a fraction of the file's length; its size unchanged."""
    data = bytearray(path.read_bytes())
    width = max(1, min(2000, len(data) // 4))
    start = min(int(len(data) * offset_fraction), len(data) - width)
    data[start:start + width] = bytes(rng.getrandbits(8) for _ in range(width))
    path.write_bytes(bytes(data))


def test_garbled_bytes_in_any_file_are_caught_or_harmless(saved, tmp_path, capsys):
    setup, directory, arrays = saved
    files = sorted(p.relative_to(directory / "2") for p in (directory / "2").rglob("*") if p.is_file())
    assert len(files) >= 10 and any(f.parts[:2] == ("state", "d") for f in files)
    rng, caught_by_fingerprint, wrong = random.Random(0), 0, []
    for i, name in enumerate(files):
        # Orbax packs the arrays into its data files (d/) in an order that varies from save to save, so those are
        # garbled at more places: one of them must land on bytes Orbax reads without complaint.
        for offset in (0.0, 0.25, 0.5, 0.75, 1.0) if "d" in name.parts else (0.0, 0.5, 1.0):
            copy = tmp_path / f"{i}-{offset}"
            shutil.copytree(directory, copy)
            _garble(copy / "2" / name, offset, rng)
            ckpt = Checkpointer(copy, max_to_keep=5, async_save=False)
            step, state, data, _ = ckpt.restore_latest(setup.abstract_state)
            ckpt.set_aside_damaged()
            ckpt.close()
            warning = capsys.readouterr().err
            caught_by_fingerprint += "differs from its fingerprint" in warning
            try:
                _assert_equal(state, arrays[step])
                assert data == {"next_sample": 8 * step}
                assert (step == 1) == bool(warning)  # a damaged step is reported; a sound one is not
                assert (copy / "1").is_dir()  # the good checkpoint is kept
                if step == 1:  # set aside, not deleted
                    assert not (copy / "2").exists() and (copy.parent / DAMAGED / "2" / name).is_file()
                    shutil.rmtree(copy.parent / DAMAGED)
            except AssertionError as e:
                wrong.append(f"{name} at {offset}: {e}")
    assert not wrong, "\n".join(wrong)
    assert caught_by_fingerprint  # bytes that Orbax reads without complaint, which only the fingerprints catch


def _edit_meta(step_dir, edit):
    path = step_dir / "meta" / "metadata"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


def test_a_step_resumed_from_is_kept_and_damaged_ones_are_never_deleted(saved, tmp_path, batches, capsys):
    setup, directory, arrays = saved
    shutil.copytree(directory, tmp_path / "checkpoints")
    _edit_meta(tmp_path / "checkpoints" / "2", lambda m: m["integrity"]["state"].update(
        {".params['embed']['table']": "0" * 16}))
    ckpt = Checkpointer(tmp_path / "checkpoints", max_to_keep=2, async_save=False)
    step, state, _, _ = ckpt.restore_latest(setup.abstract_state)
    assert step == 1 and "step 2 is damaged: 1 array differs from its fingerprint" in capsys.readouterr().err
    ckpt.set_aside_damaged()
    for later in range(3, 7):
        ckpt.save(later, state, {"next_sample": 8 * later}, trainer.checkpoint_metadata(setup))
    ckpt.wait()
    ckpt.close()
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [1, 5, 6]
    assert (tmp_path / DAMAGED / "2" / "state").is_dir()


def test_init_from_refuses_damaged_parameters(saved, tmp_path):
    setup, directory, arrays = saved
    shutil.copytree(directory, tmp_path / "checkpoints")
    _edit_meta(tmp_path / "checkpoints" / "2", lambda m: m["integrity"]["state"].update(
        {".params['layers']['attn']['wq']": "0" * 16}))
    with pytest.raises(CheckpointError, match=r"is damaged: \.params\['layers'\]\['attn'\]\['wq'\] differs"):
        restore_params(tmp_path, setup.abstract_state.params)
    step, params = restore_params(tmp_path / "checkpoints" / "1", setup.abstract_state.params)
    _assert_equal(params, arrays[1].params)


def test_a_checkpoint_without_fingerprints_is_restored_with_a_warning(saved, tmp_path, capsys):
    """Saved by a scaletrain without fingerprints (or with another kind of them): usable, and said to be unverified."""
    setup, directory, arrays = saved
    shutil.copytree(directory, tmp_path / "checkpoints")
    _edit_meta(tmp_path / "checkpoints" / "2", lambda m: m.pop("integrity"))
    ckpt = Checkpointer(tmp_path / "checkpoints", max_to_keep=5, async_save=False)
    step, state, _, _ = ckpt.restore_latest(setup.abstract_state)
    ckpt.close()
    assert step == 2 and "restored unverified" in capsys.readouterr().err
    _assert_equal(state, arrays[2])
