"""A checkpoint saved on one mesh restores into another with identical arrays, and training goes on alike."""

import jax
import numpy as np
import pytest

from scaletrain import config
from scaletrain.errors import CheckpointError
from scaletrain.store.checkpoint import Checkpointer, restore_params
from scaletrain.train import trainer
from tests import equivalence
from tests.conftest import tiny_overrides

STEPS = 4


def _setup(devices, *overrides):
    return trainer.build(config.load(None, tiny_overrides("unused", steps=STEPS) + list(overrides)), devices)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, batches):
    """Two steps on fsdp=8, saved; then the uninterrupted run's last two losses. Every step is compiled as
    tests/equivalence.py compiles it, and starts from its initial state."""
    setup = _setup(jax.devices(), "mesh.fsdp=8")
    state, step = equivalence.start(setup), equivalence.compiled_step(setup)
    for batch in batches[:2]:
        state, _ = step(state, setup.put_batch(batch), setup.loss_ceiling())
    directory = tmp_path_factory.mktemp("ckpt")
    ckpt = Checkpointer(directory, max_to_keep=2, async_save=True)
    ckpt.save(2, state, {"next_sample": 16}, trainer.checkpoint_metadata(setup))
    ckpt.wait()
    ckpt.close()
    arrays = jax.device_get(state)
    losses = []
    for batch in batches[2:]:
        state, metrics = step(state, setup.put_batch(batch), setup.loss_ceiling())
        losses.append(float(metrics["loss"]))
    return directory, arrays, losses


@pytest.mark.parametrize("devices, mesh", [(8, ["mesh.data=2", "mesh.fsdp=4"]), (8, ["mesh.fsdp=4", "mesh.tensor=2"]),
                                           (1, []), (8, ["mesh.fsdp=8", "params.offload=true"])])
def test_restore_into_another_mesh(saved, batches, devices, mesh):
    directory, arrays, losses = saved
    setup = _setup(jax.devices()[:devices], *mesh)
    ckpt = Checkpointer(directory, max_to_keep=2, async_save=True)
    step, state, data_state, _ = ckpt.restore_latest(setup.abstract_state)
    ckpt.close()
    assert step == 2 and data_state == {"next_sample": 16}
    for got, want in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(arrays)):
        np.testing.assert_array_equal(got, want)
    assert state.params["layers"]["mlp"]["w_gate"].sharding == setup.state_shardings.params["layers"]["mlp"]["w_gate"]
    resumed, step = [], equivalence.compiled_step(setup)
    for batch in batches[2:]:
        state, metrics = step(state, setup.put_batch(batch), setup.loss_ceiling())
        resumed.append(float(metrics["loss"]))
    np.testing.assert_allclose(resumed, losses, rtol=1e-5)


def test_no_readable_checkpoint_is_an_error(tmp_path, saved):
    directory, _, _ = saved
    broken = tmp_path / "broken"
    import shutil

    shutil.copytree(directory, broken)
    for f in broken.rglob("*"):
        if f.is_file() and "state" in f.parts:
            f.write_bytes(b"garbage")
    ckpt = Checkpointer(broken, max_to_keep=2, async_save=True)
    with pytest.raises(CheckpointError, match="no readable checkpoint"):
        ckpt.restore_latest(_setup(jax.devices(), "mesh.fsdp=8").abstract_state)


def test_init_from_restores_parameters_only_into_another_mesh(saved):
    directory, arrays, _ = saved
    setup = _setup(jax.devices(), "mesh.data=2", "mesh.fsdp=4")
    for path in (directory, directory / "2"):  # the checkpoints folder (newest step) or one step's folder
        step, params = restore_params(path, setup.abstract_state.params)
        assert step == 2
        for got, want in zip(jax.tree.leaves(jax.device_get(params)), jax.tree.leaves(arrays.params)):
            np.testing.assert_array_equal(got, want)
        assert jax.tree.map(lambda x: x.sharding, params) == setup.state_shardings.params
    with pytest.raises(CheckpointError, match=r"parameter \['layers'\]\['mlp'\]\['w_down'\] is \(2, 128, 64\)"):
        restore_params(directory, _setup(jax.devices(), "mesh.fsdp=8", "model.d_ff=256").abstract_state.params)


def test_the_failures_of_abandoned_reads_are_not_reported_again(caplog):
    """After a restore fails, asyncio's report of its abandoned reads' own failures (when their tasks are
    collected) would print a traceback after the one-line warning: it is dropped."""
    import asyncio
    import gc

    from scaletrain.store import checkpoint

    checkpoint._silence_abandoned_reads()

    async def read():
        raise ValueError("a truncated file")

    loop = asyncio.new_event_loop()
    task = loop.create_task(read())
    loop.run_until_complete(asyncio.sleep(0.01))
    del task
    gc.collect()
    loop.close()
    assert "never retrieved" not in caplog.text


def test_a_closed_loop_reported_from_a_native_thread_is_not_printed(capsys):
    """Tensorstore runs a finished read's callback - the closed loop's call_soon_threadsafe - from its own thread
    and prints what it raises with PyErr_Print, that is through sys.excepthook: dropped, but nothing else is."""
    import sys

    from scaletrain.store import checkpoint

    checkpoint._silence_abandoned_reads()
    sys.excepthook(RuntimeError, RuntimeError("Event loop is closed"), None)
    assert capsys.readouterr().err == ""
    sys.excepthook(RuntimeError, RuntimeError("something else"), None)
    assert "something else" in capsys.readouterr().err
