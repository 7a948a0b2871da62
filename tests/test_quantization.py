"""model.quantization (docs/quantization.md) trained: int8 and fp8 matmuls train like the unquantized model, shard
like it (a quantized run on 8 devices follows its own one-device run), recompute alike under remat and round per
microbatch in a pipeline. tests/test_quantization_compile.py holds the rest."""

import math

import pytest

from tests import equivalence

STEPS = 4
# One dense block and one mixture-of-experts block: every quantizable group but the output head in one model.
MOE = ["model.num_experts=4", "model.experts_per_token=2", "model.moe_d_ff=64", "model.moe_every=2"]


@pytest.mark.parametrize("mode, mesh, model", [
    ("int8", ["mesh.fsdp=4", "mesh.tensor=2"], []),
    ("fp8", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], []),
    ("int8", ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"], MOE),
])
def test_a_quantized_run_on_8_devices_equals_its_one_device_run(batches, mode, mesh, model):
    """Every scale is a maximum over whole rows, columns or experts, across the devices that share them, so a
    sharded matmul rounds bitwise as the one-device matmul does: two steps' losses and gradient norms agree within
    1e-5. The parameters and Adam's moment agree within 1e-2 and 5e-2 only: a mesh sums in another order, and a
    one-ulp difference in a quantizer's input that crosses a rounding boundary moves that value by a whole step
    (1/127 of its row's range in int8) - elementwise noise a sharding bug would dwarf (a scale taken over one
    device's shard, a gradient scaled by 2). Quantized and unquantized runs differ far more than 1e-5 (their
    gradient norms by 1e-3 or more), so the equality is not the unquantized run's."""
    batches = batches[:2]
    overrides = [*model, f"model.quantization={mode}", "model.quantized_matmuls=attention,mlp,experts,output"]
    want = equivalence.reference(batches, *overrides)
    equivalence.assert_same(equivalence.run(batches, *overrides, *mesh), want, params=1e-2, mu=5e-2)
    if not model:  # the unquantized reference of the dense model (the mixture's costs a compile more)
        plain = equivalence.reference(batches)
        assert max(abs(a / b - 1) for a, b in zip(want.grad_norms, plain.grad_norms)) > 1e-3


@pytest.mark.parametrize("steps, pipeline", [
    (2, ["mesh.fsdp=2"]),
    (1, ["pipeline.schedule=1f1b", "model.attention=flash", "optim.offload=true", "mesh.data=2", "mesh.tensor=2"]),
], ids=["gpipe-fsdp", "1f1b-flash-offload-data-tensor"])
def test_a_quantized_pipeline_rounds_per_microbatch(batches, steps, pipeline):
    """A weight gradient's column scales are taken over the tokens of one microbatch, so a quantized run rounds
    as its microbatches say, whatever the mesh: 4 microbatches over 2 stages follow one device accumulating 4
    microbatches as closely as the meshes above follow one device - GPipe with fsdp 2, and 1F1B with flash
    attention, the optimizer state in host memory, data 2 and tensor 2. 1F1B runs each stage per data shard
    (shard_map), where the quantizer takes the scales over rows across the data devices itself: without that its
    first gradient norm stood 3.8e-5 off. One step only for 1F1B: its stages' forward passes are
    compiled apart from the reference's, a last-bit difference that crosses a rounding boundary moves a value by
    a whole step, attention spreads it over the tokens, and after an update the gradient norms part by 1e-4.
    (Against one device without accumulation GPipe's first gradient norm stands 1.5e-5 off.)"""
    batches = batches[:steps]
    model = [o for o in pipeline if o.startswith("model.")]
    want = equivalence.reference(batches, "model.quantization=int8", "train.grad_accum_steps=4", *model)
    got = equivalence.run(batches, "model.quantization=int8", "mesh.pipeline=2", "pipeline.microbatches=4",
                          *pipeline)
    equivalence.assert_same(got, want, params=1e-2, mu=5e-2)


def test_rematerialised_quantized_layers_equal_kept_ones(batches):
    """The recomputed forward pass rounds the same numbers the same way: under full remat two steps equal remat
    none within 1e-5, parameters included."""
    batches = batches[:2]
    want = equivalence.reference(batches, "model.quantization=int8")
    equivalence.assert_same(equivalence.run(batches, "model.quantization=int8", "remat.policy=full"), want)


@pytest.fixture(scope="module")
def thirty_batches(stdlib_dataset):
    from scaletrain.data import loader as data

    it = data.BatchIterator(stdlib_dataset, global_batch=8)
    return [next(it) for _ in range(30)]


def test_quantized_training_follows_the_unquantized_loss(thirty_batches):
    """The tiny model, 30 steps of the built-in corpus in float32: int8 and fp8 end within 2% of the unquantized
    loss, every step finite (docs/quantization.md has the 300-step run)."""
    def losses(*overrides):
        return equivalence.reference(thirty_batches, *overrides, "optim.learning_rate=1e-2").losses

    plain = losses()
    assert plain[-1] < 0.8 * plain[0]  # it learned something for the rounding to spoil
    for mode in ("int8", "fp8"):
        quantized = losses(f"model.quantization={mode}")
        assert all(math.isfinite(x) for x in quantized), mode
        assert quantized[-1] == pytest.approx(plain[-1], rel=0.02), mode
        assert quantized != plain, mode
