"""model.quantization (docs/quantization.md) trained: int8 and fp8 matmuls train like the unquantized model, shard
like it (a quantized run on 8 devices follows its own one-device run), recompute alike under remat and round per
microbatch in a pipeline. tests/test_quantization_compile.py holds the rest."""

import math

import pytest

from tests import equivalence

STEPS = 4
# One dense block and one mixture-of-experts block: every quantizable group but the output head in one model.
MOE = ["model.num_experts=4", "model.experts_per_token=2", "model.moe_d_ff=64", "model.moe_every=2"]


# fp8 on data x fsdp x tensor (the dense model); int8 on the mixture (a dense block and an expert block) over
# context x expert x tensor - [batch, seq] rows, not flattened: the sequence stays split. The expert block's scales
# across fsdp x expert x tensor from one input: test_a_quantized_mixture_of_experts_rounds_alike_on_every_mesh.
@pytest.mark.parametrize("mode, mesh, model", [
    ("fp8", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], []),
    ("int8", ["mesh.context=2", "mesh.expert=2", "mesh.tensor=2"], MOE),
])
def test_a_quantized_run_on_8_devices_equals_its_one_device_run(batches, mode, mesh, model):
    """Every scale is a maximum over whole rows, columns or experts, across the devices that share them, so a
    sharded matmul rounds as the one-device matmul does: the first step's loss and gradient norm agree within
    1e-5. The parameters and Adam's moment agree within 2e-2 and 5e-2 only: a mesh sums in another order, and a
    one-ulp difference in a quantizer's input that crosses a rounding boundary moves that value by a whole step
    (1/127 of its row's range in int8), which Adam's normalised update makes visible in near-zero gradients
    (the expert block's weights stood 0.9e-2 off here) - noise a gradient scaled by 2 would dwarf; the scales'
    maxima across devices are proven exactly by the expert block's test below, from one input. One step: a
    second starts from those parameters, where which values cross a boundary depends on the CPU's summation
    order (a second step's gradient norm stood 7e-5 off on one machine and within 1e-5 on another). Quantized and
    unquantized runs differ far more than 1e-5 (their gradient norms by 1e-3 or more), so the equality is not the
    unquantized run's."""
    batches = batches[:1]
    overrides = [*model, f"model.quantization={mode}", "model.quantized_matmuls=attention,mlp,experts,output"]
    want = equivalence.reference(batches, *overrides)
    equivalence.assert_same(equivalence.run(batches, *overrides, *mesh), want, params=2e-2, mu=5e-2)
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


def test_a_quantized_mixture_of_experts_rounds_alike_on_every_mesh():
    """The expert block alone, int8, from the same input on fsdp 2 x expert 2 x tensor 2 and on one device: its
    output and every gradient within 1e-5. With one input no upstream sum can move a value across a rounding
    boundary, so each scale - a maximum over an expert's rows across the devices that hold them, over its columns
    across `tensor` - must be the one-device scale: taken over one device's rows instead, the gradients miss by
    1e-3 and more. (Trained, the same block agrees only within rounding noise: the test above.)"""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from scaletrain import config
    from scaletrain.models import ModelConfig
    from scaletrain.models.mixtral.moe import MoE
    from scaletrain.parallel import mesh as mesh_lib
    from scaletrain.parallel import sharding

    cfg = ModelConfig.from_config({"d_model": 64, "num_experts": 4, "experts_per_token": 2, "moe_d_ff": 64,
                                   "dtype": "float32", "quantization": "int8"})
    graphdef, params = nnx.split(MoE(cfg, nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    x, cotangent = (jnp.asarray(rng.normal(size=(8, 32, 64)), jnp.float32) for _ in range(2))

    def loss(params, x):
        out, _ = nnx.merge(graphdef, params)(x, lambda h: h)
        return jnp.sum(out * cotangent)

    def grads(mesh_overrides, devices):
        mesh = mesh_lib.make_mesh(config.load(None, mesh_overrides).mesh, jax.devices()[:devices])
        with sharding.use_rules(mesh, sharding.rules_for("fsdp", True, True)):
            return jax.device_get(jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x))

    (want_loss, want), (got_loss, got) = grads([], 1), grads(["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"], 8)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.max(np.abs(b)), err_msg=jax.tree_util.keystr(path))
