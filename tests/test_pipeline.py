"""The GPipe and circular pipelines (pipeline.py) train exactly like one device: alone and with data, fsdp and
tensor parallelism, with as many microbatches as stages and with more; nothing in a bubble reaches the loss; one
layout on disk whatever the stage count or schedule. The 1F1B pipeline's own tests: test_pipeline_1f1b.py."""

import json
import shutil

import jax
import numpy as np
import pytest

from scaletrain import config, remat
from scaletrain.parallel import pipeline
from scaletrain.store.checkpoint import Checkpointer
from scaletrain.train import trainer
from tests import equivalence
from tests.conftest import run_main, tiny_overrides

STEPS = 3
# Four layers: four stages of one layer each, or two of two. optim.eps = the learning rate (3e-3), as in
# tests/test_loss.py: with the default 1e-8 Adam moves an entry whose gradient is near 1e-8 by up to lr for a rounding
# difference in that gradient - measured on jax 0.12 (XLA sums a pipeline's gradients in another order than one
# device): one entry of wv's 8,192, its gradient 1.5e-8, moved the circular pipeline's wv by 1.1e-5 of its norm
# after one step. With eps = lr an update moves by at most as much as its gradient.
MODEL = ["model.num_layers=4", "optim.eps=3e-3"]


@pytest.fixture(scope="module")
@equivalence.computed_once
def reference(batches):
    return equivalence.reference(batches, *MODEL)


# Every case trains through NaN bubbles (`trained`). Which case covers what: gpipe alone with more microbatches
# than stages (and through NaN bubbles: the 1F1B comparison's GPipe run, tests/test_pipeline_1f1b.py); data x
# fsdp, as many microbatches as stages, each iteration rematerialised from its stage inputs under save_dots;
# fsdp x tensor with the optimizer state in host memory (gpipe's optim.offload pairing, tests/test_pairings.py);
# 4 stages with fsdp, as many microbatches as stages; circular beside data x tensor with more microbatches than
# stages and the optimizer state in host memory (its optim.offload pairing). Circular with as many microbatches as
# stages: tests/test_context.py's circular case (2 stages x 2 repeats, 2 microbatches, beside context x fsdp).
CASES = {
    "pipeline=2 microbatches=4": ["mesh.pipeline=2", "pipeline.microbatches=4"],
    "pipeline=2 data=2 fsdp=2 remat=save_dots": ["mesh.pipeline=2", "mesh.data=2", "mesh.fsdp=2",
                                                 "remat.policy=save_dots"],
    "pipeline=2 fsdp=2 tensor=2 optimizer offload": ["mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2",
                                                     "optim.offload=true"],
    "pipeline=4 fsdp=2 microbatches=4": ["mesh.pipeline=4", "mesh.fsdp=2", "pipeline.microbatches=4"],
    "circular pipeline=2 repeats=2 microbatches=4 data=2 tensor=2 optimizer offload": [
        "mesh.pipeline=2", "mesh.data=2", "mesh.tensor=2", "pipeline.schedule=circular", "pipeline.repeats=2",
        "pipeline.microbatches=4", "optim.offload=true"],
}
# Cases another test compares with (tests/test_pipeline_1f1b.py's test_1f1b_equals_gpipe): trained once per test
# run (equivalence.reference), whichever test asks first - always through NaN bubbles.
SHARED = {"pipeline=2 microbatches=4"}


def assert_like_one_device(batches, reference, overrides):
    equivalence.assert_same(equivalence.run(batches, *MODEL, *overrides), reference)


def trained(batches, monkeypatch, overrides, shared=False):
    """The tiny model with `overrides`, trained with the shift buffers (and 1F1B's kept stage inputs) starting full
    of NaN: stages idle in the bubble would compute on it, and its NaN would reach every weight's gradient through
    them (0 x NaN) were their inputs not masked. `shared`: through equivalence.reference (once per test run)."""
    monkeypatch.setattr(pipeline, "BUBBLE_FILL", float("nan"))
    return (equivalence.reference if shared else equivalence.run)(batches, *MODEL, *overrides)


@pytest.mark.parametrize("case", CASES)
def test_pipeline_equals_one_device(batches, reference, monkeypatch, case):
    equivalence.assert_same(trained(batches, monkeypatch, CASES[case], shared=case in SHARED), reference)


def assert_bubbles_reach_nothing(batches, reference, monkeypatch, *schedule):
    """The shift buffers (and 1F1B's kept stage inputs) start full of NaN: stages idle in the bubble would compute
    on it, and its NaN would reach every weight's gradient through them (0 x NaN) were their inputs not masked.
    (This module's and tests/test_pipeline_1f1b.py's cases all train so, `trained`.)"""
    monkeypatch.setattr(pipeline, "BUBBLE_FILL", float("nan"))
    assert_like_one_device(batches, reference, ["mesh.pipeline=2", *schedule, "pipeline.microbatches=4"])


def _setup(*overrides):
    cfg = config.load(None, tiny_overrides("unused", steps=STEPS) + MODEL + list(overrides))
    m = cfg.mesh
    return trainer.build(cfg, jax.devices()[:m.pipeline * m.data * m.fsdp * m.tensor])


def test_a_checkpoint_restores_across_stage_counts(tmp_path):
    """One layout on disk, [layers, ...] in canonical order, whatever the stage count or schedule: saved with 4
    stages, restored with 1, saved again, restored with 2, then into a circular schedule of 2 stages x 2 repeats
    (each stage's devices holding layers 0 and 2, or 1 and 3: pipeline.memory_order), into interleaved 1F1B's
    (the same order), into zero-bubble's of 4 stages (canonical), and back with 4 - as the trainer saves and
    restores (Setup.to_disk, from_disk)."""
    setup = _setup("mesh.pipeline=4")
    # The one-device init (the equivalence cases' start, computed once per run), placed on the 4 stages as a
    # restored checkpoint is: canonical order is GPipe's own (init is mesh-independent, test_parallel.py).
    want = equivalence.initial_state(*MODEL)
    on_disk = jax.device_put(want, setup.state_shardings)
    circular = ["mesh.pipeline=2", "mesh.fsdp=2", "pipeline.schedule=circular", "pipeline.repeats=2",
                "pipeline.microbatches=2"]
    interleaved = ["mesh.pipeline=2", "pipeline.schedule=interleaved_1f1b", "pipeline.repeats=2",
                   "pipeline.microbatches=2"]
    zero_bubble = ["mesh.pipeline=4", "pipeline.schedule=zero_bubble", "pipeline.microbatches=4"]
    for i, overrides in enumerate(([], ["mesh.pipeline=2", "mesh.fsdp=2"], circular, interleaved, zero_bubble,
                                   ["mesh.pipeline=4"])):
        ckpt = Checkpointer(tmp_path / str(i), max_to_keep=1, async_save=False)
        ckpt.save(1, on_disk, {"next_sample": 8}, trainer.checkpoint_metadata(setup))
        ckpt.wait()
        ckpt.close()
        setup = _setup(*overrides)
        ckpt = Checkpointer(tmp_path / str(i), max_to_keep=1, async_save=False)
        _, state, _, _ = ckpt.restore_latest(setup.abstract_state)
        ckpt.close()
        state = setup.from_disk(state)
        w_up = state.params["layers"]["mlp"]["w_up"]
        stages = setup.mesh.shape["pipeline"]
        assert w_up.sharding.shard_shape(w_up.shape)[0] == 4 // stages
        if overrides in (circular, interleaved):  # stage 0's devices hold canonical layers 0 and 2
            shard = w_up.addressable_shards[0]
            np.testing.assert_array_equal(np.asarray(shard.data),
                                          want.params["layers"]["mlp"]["w_up"][[0, 2]][(slice(None), *shard.index[1:])])
        on_disk = setup.to_disk(state)
        for got, expected in zip(jax.tree.leaves(jax.device_get(on_disk)), jax.tree.leaves(want)):
            np.testing.assert_array_equal(got, expected)


def test_iterations_are_rematerialised_from_their_stage_inputs(monkeypatch):
    """Under remat.policy=full a stage keeps each iteration's input, not every layer's: the compiled step's
    temporaries shrink against the same pipeline without the iterations' remat (8 microbatches, 4 layers a
    stage: about 4 layer inputs an iteration fewer)."""
    def temporaries():
        setup = _setup("mesh.pipeline=2", "remat.policy=full", "pipeline.microbatches=8", "model.num_layers=8")
        return equivalence.compiled_step(setup).memory_analysis()

    kept_inputs = temporaries()
    monkeypatch.setattr(remat, "around_stages", lambda fn, *_: fn)
    every_layer = temporaries()
    layer_input = 8 // 8 * 32 * 64 * 4  # one row of 32 tokens, d_model 64, float32
    saved = every_layer.temp_size_in_bytes - kept_inputs.temp_size_in_bytes
    assert saved >= (8 + 2 - 1) * 3 * layer_input, (kept_inputs, every_layer)


def test_a_circular_run_checkpoints_canonically_and_resumes_bitwise(tmp_path, capfd):
    """The trainer's own save and restore around a circular schedule's layer order (Setup.to_disk, from_disk,
    with asynchronous saves, the live state's arrays donated to the reordering): stopped after step 2's
    checkpoint, the run resumes to the same losses, bit for bit. Both runs in this process (conftest.run_main: no
    kill here, nothing a process of its own would prove), on its 8 devices: 2 stages x fsdp 4."""
    sets = tiny_overrides(tmp_path / "run", steps=4) + MODEL + [
        "mesh.pipeline=2", "pipeline.schedule=circular", "pipeline.repeats=2", "pipeline.microbatches=2",
        "checkpoint.every_steps=2"]
    args = ["--config", "configs/llama_tiny.yaml"] + [a for s in sets for a in ("--set", s)]
    result = run_main(args, capfd)
    assert result.returncode == 0, result.stderr
    losses = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    shutil.copytree(tmp_path / "run", tmp_path / "again")
    shutil.rmtree(tmp_path / "again" / "checkpoints" / "4")
    (tmp_path / "again" / "metrics.jsonl").write_text("\n".join(losses[:2]) + "\n")
    result = run_main([a.replace(str(tmp_path / "run"), str(tmp_path / "again")) for a in args], capfd)
    assert result.returncode == 0, result.stderr
    assert "resumed at step 2" in result.stdout
    again = (tmp_path / "again" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["loss"] for line in again] == [json.loads(line)["loss"] for line in losses]
