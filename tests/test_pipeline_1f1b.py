"""The 1F1B pipeline (pipeline_1f1b.py) trains exactly like one device and like GPipe: alone and with data, fsdp
and tensor parallelism, with as many microbatches as stages and with more; nothing in a bubble reaches the loss.
Its compiled step holds less than GPipe's by the planner's ratio, and gathering once takes every batch-axis
collective out of the loop."""

import pytest

from scaletrain.planner import hlo, memory
from tests import equivalence
from tests.test_pipeline import MODEL, _setup, assert_bubbles_reach_nothing, assert_like_one_device

STEPS = 3


@pytest.fixture(scope="module")
@equivalence.computed_once
def reference(batches):
    return equivalence.reference(batches, *MODEL)


CASES = {
    "1f1b pipeline=2": ["mesh.pipeline=2", "pipeline.schedule=1f1b"],
    "1f1b pipeline=4 microbatches=8": ["mesh.pipeline=4", "pipeline.schedule=1f1b", "pipeline.microbatches=8"],
    "1f1b pipeline=4 data=2": ["mesh.pipeline=4", "mesh.data=2", "pipeline.schedule=1f1b"],
    "1f1b pipeline=2 data=2 fsdp=2 gather once": ["mesh.pipeline=2", "mesh.data=2", "mesh.fsdp=2",
                                                  "pipeline.schedule=1f1b", "pipeline.gather_weights=once",
                                                  "pipeline.microbatches=2"],
    # Blocked attention: the stage's own sharding constraints, inside shard_map over the pipeline axis.
    "1f1b pipeline=2 fsdp=2 tensor=2 microbatches=4": ["mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2",
                                                      "pipeline.schedule=1f1b", "pipeline.microbatches=4",
                                                      "model.attention_block=16"],
}


@pytest.mark.parametrize("case", CASES)
def test_1f1b_equals_one_device(batches, reference, case):
    assert_like_one_device(batches, reference, CASES[case])


def test_nothing_in_a_bubble_reaches_the_loss_or_a_gradient(batches, reference, monkeypatch):
    assert_bubbles_reach_nothing(batches, reference, monkeypatch, "1f1b")


def test_1f1b_equals_gpipe(batches):
    """The same pipeline, scheduled 1F1B by hand (pipeline_1f1b.py) or GPipe by jax.grad: the same sums, in
    another order - losses and parameters within 1e-6, gradient norms and Adam moments within 1e-5."""
    mesh = ("mesh.pipeline=2", "mesh.fsdp=2", "pipeline.microbatches=4")
    gpipe = equivalence.reference(batches, *MODEL, *mesh)
    one_f_one_b = equivalence.run(batches, *MODEL, *mesh, "pipeline.schedule=1f1b")
    equivalence.assert_same(one_f_one_b, gpipe, loss=1e-6, params=1e-6)


def test_1f1b_holds_less_than_gpipe_by_about_the_predicted_ratio(monkeypatch):
    """At 8 microbatches over 2 stages a GPipe stage keeps 8 stage inputs and the whole batch's logits, a 1F1B
    stage 3 stage inputs (2 P - 1) and one microbatch's logits: the compiled steps' memory (arguments and
    temporaries) falls by about the ratio the planner predicts. The plain loss path, whose logits the planner
    counts (the CPU's fused one never writes them)."""
    monkeypatch.setattr("scaletrain.train.loss.FUSED_LOSS", False)
    shape = ("mesh.pipeline=2", "remat.policy=full", "pipeline.microbatches=8", "model.num_layers=8",
             "train.global_batch=64", "data.seq_len=128", "model.d_model=128", "model.num_heads=8", "model.d_ff=256")

    def compiled_and_predicted(schedule):
        setup = _setup(*shape, f"pipeline.schedule={schedule}")
        compiled = equivalence.compiled_step(setup).memory_analysis()
        predicted = memory.predict(setup.cfg, dict(setup.mesh.shape)).total
        return compiled.argument_size_in_bytes + compiled.temp_size_in_bytes, predicted

    (gpipe, gpipe_predicted), (one_f_one_b, predicted) = map(compiled_and_predicted, ("gpipe", "1f1b"))
    assert one_f_one_b < gpipe
    assert abs(one_f_one_b / gpipe - predicted / gpipe_predicted) <= 0.15, (one_f_one_b, gpipe, predicted,
                                                                           gpipe_predicted)
    # The planner counts whole logits once - the TPU's compiles write their gradient over them (docs/planner.md) -
    # and a full-remat layer's gate and up gradients once (the TPU's 8B compile); this CPU compile of the whole
    # batch's logits comes out 12.1% above the plan (10.7% before the second count, 0.1 before the first).
    assert abs(gpipe_predicted / gpipe - 1) <= 0.13


def test_gathering_once_moves_every_batch_axis_collective_out_of_the_loop():
    """pipeline.gather_weights=once: the 1F1B loop runs per device along data and fsdp too, so no collective over
    them runs per tick - FSDP's gathers happen once on the way in, every gradient reduction once on the way out.
    Per use (the default), FSDP gathers and reduces inside the loop, and data parallelism's reductions still
    wait for the end (the loop runs per device along `data`, whose devices hold the same weights)."""
    def batch_axis_collectives(*overrides):
        setup = _setup("mesh.pipeline=2", "mesh.data=2", "mesh.fsdp=2", "pipeline.schedule=1f1b",
                       "pipeline.microbatches=2", *overrides)
        devices = setup.mesh.devices.size
        assert devices == 8
        text = equivalence.compiled_step(setup).as_text()
        return [c for c in hlo.inventory(text, setup.mesh) if {"data", "fsdp"} & set(c.axes)]

    per_use = batch_axis_collectives()
    assert any(c.loops and "fsdp" in c.axes for c in per_use)
    assert not any(c.loops and c.axes == ("data",) for c in per_use), [c for c in per_use if c.loops]
    once = batch_axis_collectives("pipeline.gather_weights=once")
    assert once and not any(c.loops for c in once), [c for c in once if c.loops]
