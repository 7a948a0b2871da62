"""model.quantization (docs/quantization.md): int8 and fp8 matmuls train like the unquantized model, shard like it
(a quantized run on 8 devices equals its own one-device run), compile to low-precision dots on TPU, and leave the
checkpoint as it was (a run switches quantization at resume)."""

import json
import math
import re
from collections import Counter

import pytest

from scaletrain import config
from scaletrain.errors import ConfigError
from scaletrain.planner import aot
from scaletrain.train import trainer
from tests import equivalence
from tests.conftest import lower_for_cuda, tiny_overrides

STEPS = 4
# One dense block and one mixture-of-experts block: every quantizable group but the output head in one model.
MOE = ["model.num_experts=4", "model.experts_per_token=2", "model.moe_d_ff=64", "model.moe_every=2"]


@pytest.mark.parametrize("overrides, says", [
    (["model.quantization=int8", "model.norm=fused"], "model.norm=fused"),
    (["model.quantization=int8", "model.quantized_matmuls=attention,mlps"], "unknown matmul group"),
    (["model.quantization=fp8", "model.quantized_matmuls="], "quantizes no matmul"),
    (["model.quantization=int4"], "model.quantization must be one of none, int8, fp8"),
])
def test_a_config_it_cannot_train_is_refused(overrides, says):
    with pytest.raises(ConfigError, match=says):
        config.load(None, tiny_overrides("unused") + overrides)


def test_the_fused_norm_pairs_with_quantized_experts_alone():
    """The fused kernel sits before attention and the MLP only: quantizing just the experts leaves it be."""
    config.load(None, tiny_overrides("unused") + MOE + ["model.quantization=int8", "model.norm=fused",
                                                         "model.quantized_matmuls=experts"])


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
    plain = equivalence.reference(batches, *model)
    assert max(abs(a / b - 1) for a, b in zip(want.grad_norms, plain.grad_norms)) > 1e-3


def test_a_quantized_pipeline_rounds_per_microbatch(batches):
    """A weight gradient's column scales are taken over the tokens of one microbatch, so a quantized run rounds
    as its microbatches say, whatever the mesh: GPipe's 4 microbatches over 2 stages and fsdp 2 follow one device
    accumulating 4 microbatches as closely as the meshes above follow one device. (Against one device without
    accumulation its first gradient norm stands 1.5e-5 off.)"""
    batches = batches[:2]
    want = equivalence.reference(batches, "model.quantization=int8", "train.grad_accum_steps=4")
    got = equivalence.run(batches, "model.quantization=int8", "mesh.pipeline=2", "pipeline.microbatches=4",
                          "mesh.fsdp=2")
    equivalence.assert_same(got, want, params=1e-2, mu=5e-2)


def test_rematerialised_quantized_layers_equal_kept_ones(batches):
    """The recomputed forward pass rounds the same numbers the same way: under full remat and under save_dots
    (which keeps the dots' outputs, not the quantized matmuls' internals) two steps equal remat none within 1e-5,
    parameters included."""
    batches = batches[:2]
    want = equivalence.reference(batches, "model.quantization=int8")
    for policy in ("full", "save_dots"):
        equivalence.assert_same(equivalence.run(batches, "model.quantization=int8", f"remat.policy={policy}"), want)


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


def _dots(hlo: str) -> Counter:
    """The compiled TPU program's matmuls (convolutions) by the dtypes of their two operands."""
    types = dict(re.findall(r"(%[\w.\-]+) = (\w+)\[", hlo))
    found = re.findall(r"= \w+\[[^=]* convolution\((%[\w.\-]+), (%[\w.\-]+)\)", hlo)
    return Counter((types.get(a), types.get(b)) for a, b in found)


@pytest.mark.parametrize("topology, mode, low", [
    ("v5p:2x2x1", "int8", {("s8", "s8")}),
    ("tpu7x:2x2x1", "fp8", {("f8e4m3fn", "f8e4m3fn"), ("f8e5m2", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2")}),
])
def test_the_compiled_tpu_step_multiplies_in_low_precision(topology, mode, low):
    """Each of a layer's 7 projections is 3 low-precision dots (forward, input and weight gradients): 21 in the
    layer loop's body. Attention's own products and the output head (not in model.quantized_matmuls by default)
    stay in bf16 / float32."""
    cfg = config.load("configs/llama_tiny.yaml", [f"model.quantization={mode}", "model.dtype=bfloat16"])
    setup = trainer.build(cfg, aot.devices_for(topology))
    dots = _dots(setup.step.lower(setup.abstract_state, setup.abstract_batch()).compile().as_text())
    assert sum(n for kinds, n in dots.items() if kinds in low) == 21, dots
    assert sum(n for kinds, n in dots.items() if kinds not in low) >= 4, dots  # attention and the head


def test_a_run_switches_quantization_at_resume(tmp_path):
    """The checkpoint holds the master weights alone, whatever the mode: a run trained in int8 resumes without."""
    run = tmp_path / "run"

    def train(steps, mode):
        cfg = config.load(None, tiny_overrides(run, steps=steps, **{"model.quantization": mode, "mesh.fsdp": -1,
                                                                     "checkpoint.async_save": False}))
        assert trainer.run(cfg) == 0

    train(2, "int8")
    train(3, "none")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records)


def test_the_fp8_matmuls_lower_for_a_gpu():
    """No GPU here: the quantized training matmul (forward and both gradients) lowered for CUDA multiplies float8
    operands - e4m3 forward, e5m2 gradients (H100 and later run them at twice the bf16 rate)."""
    import jax
    import jax.numpy as jnp

    from scaletrain.models.quantize import Quantization

    def loss(x, w):
        return jnp.sum(Quantization("fp8").dot(x, w).astype(jnp.float32) ** 2)

    shapes = (jax.ShapeDtypeStruct((256, 128), jnp.bfloat16), jax.ShapeDtypeStruct((128, 512), jnp.bfloat16))
    text = lower_for_cuda(jax.grad(loss, argnums=(0, 1)), *shapes)
    dots = re.findall(r"stablehlo.dot_general.*", text)
    assert len(dots) == 3, dots
    assert all("f8E4M3FN" in d for d in dots) and sum("f8E5M2" in d for d in dots) == 2, dots


def test_the_plan_times_the_quantized_matmuls_at_the_int8_peak():
    """The roofline's compute time: the attention and MLP projections' training FLOPs (6 per weight and token:
    nothing recomputed under the 8B config's remat none) at v5p's int8 peak, the rest at its bf16 peak."""
    from scaletrain.facts import hardware
    from scaletrain.planner import roofline

    def plan(mode):
        return roofline.plan(config.load("configs/llama3_8b.yaml", [f"model.quantization={mode}"]), "v5p:4x4x2")

    bf16, int8 = plan("none"), plan("int8")
    m = config.load("configs/llama3_8b.yaml", []).model
    d, h, f = m.d_model, m.head_dim, m.d_ff
    layer = d * (m.num_heads + 2 * m.num_kv_heads) * h + m.num_heads * h * d + 3 * d * f
    assert int8["quantized_flops"] == pytest.approx(6 * int8["tokens_per_step"] * m.num_layers * layer)
    assert bf16["quantized_flops"] == 0
    chip = hardware.spec("v5p")
    saved = int8["quantized_flops"] * (1 / chip.bf16_flops - 1 / chip.int8_ops) / 32
    assert int8["time_s"]["compute"] == pytest.approx(bf16["time_s"]["compute"] - saved)
    assert int8["time_s"]["compute"] < 0.65 * bf16["time_s"]["compute"]
