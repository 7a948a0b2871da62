"""The zero-bubble pipeline (pipeline_zb.py: each layer's backward cut into its input and weight gradients by
backward_split.py, the weight gradients run where 1F1B's stages would idle) trains exactly like one device: on 2
stages and 4, with data, fsdp and tensor parallelism, with flash attention and with a mixture of experts; nothing
in a bubble reaches the loss. The cut gives a layer's own vjp; the schedule's table is the bubble the planner
counts."""

import pytest

from tests import equivalence
from tests.test_pipeline import MODEL, assert_bubbles_reach_nothing, assert_like_one_device

STEPS = 3
ZB = "pipeline.schedule=zero_bubble"


@pytest.fixture(scope="module")
@equivalence.computed_once
def reference(batches):
    return equivalence.reference(batches, *MODEL)


CASES = {
    "pipeline=4 data=2": ["mesh.pipeline=4", "mesh.data=2", ZB, "pipeline.microbatches=4"],
    "pipeline=2 data=2 fsdp=2 gather once": ["mesh.pipeline=2", "mesh.data=2", "mesh.fsdp=2", ZB,
                                             "pipeline.gather_weights=once", "pipeline.microbatches=2"],
    "pipeline=2 fsdp=2 tensor=2 microbatches=4": ["mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2", ZB,
                                                  "pipeline.microbatches=4", "model.attention_block=16"],
}


@pytest.mark.parametrize("case", CASES)
def test_zero_bubble_equals_one_device(batches, reference, case):
    assert_like_one_device(batches, reference, CASES[case])


def test_nothing_in_a_bubble_reaches_the_loss_or_a_gradient(batches, reference, monkeypatch):
    assert_bubbles_reach_nothing(batches, reference, monkeypatch, ZB)
