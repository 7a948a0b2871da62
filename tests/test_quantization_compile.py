"""model.quantization without training against a reference (tests/test_quantization.py trains): what the config
refuses, the low-precision dots in the compiled TPU step and the CUDA lowering, the plan's int8 roofline, and a
resume that switches modes."""

import json
import math
import re
from collections import Counter

import pytest

from scaletrain import config
from scaletrain.errors import ConfigError
from scaletrain.planner import aot
from scaletrain.train import trainer
from tests.conftest import lower_for_cuda, tiny_overrides

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


def _dots(hlo: str) -> Counter:
    """The compiled TPU program's matmuls (convolutions) by the dtypes of their two operands."""
    types = dict(re.findall(r"(%[\w.\-]+) = (\w+)\[", hlo))
    found = re.findall(r"= \w+\[[^=]* convolution\((%[\w.\-]+), (%[\w.\-]+)\)", hlo)
    return Counter((types.get(a), types.get(b)) for a, b in found)


def _collectives(hlo: str, kinds: str, shapes: set[tuple[int, ...]]) -> Counter:
    """The compiled program's collectives of `kinds` (a regex; asynchronous ones too) whose output is shaped like
    one of `shapes` (size-1 dims aside), by dtype."""
    found = re.findall(rf"= \(?(\w+)\[([\d,]+)\][^=]* (?:{kinds})(?:-start)?\(", hlo)
    return Counter(t for t, dims in found if tuple(int(n) for n in dims.split(",") if n != "1") in shapes)


@pytest.mark.parametrize("topology, mode, low, gathered, scattered", [
    ("v5p:2x2x1", "int8", {("s8", "s8")}, "s8", {}),  # XLA gathers the rounded activations for the weight gradients
    ("tpu7x:2x2x1", "fp8", {("f8e4m3fn", "f8e4m3fn"), ("f8e5m2", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2")}, "f8e4m3fn",
     {"bf16": 7}),
])
def test_the_compiled_tpu_step_multiplies_and_gathers_in_low_precision(topology, mode, low, gathered, scattered):
    """Each of a layer's 7 projections is 3 low-precision dots (forward, input and weight gradients): 21 in the
    layer loop's body. Attention's own products and the output head (not in model.quantized_matmuls by default)
    stay in bf16 / float32. FSDP gathers those 7 weights rounded (a byte an element, half bf16's bytes), once for
    the forward pass and once for the backward, and no bf16 copy of them; where it reduce-scatters their
    gradients, it does so in bf16 (the dot writes bf16: asked for its float32 accumulator, XLA scattered that)."""
    cfg = config.load("configs/llama_tiny.yaml", [f"model.quantization={mode}", "model.dtype=bfloat16"])
    setup = trainer.build(cfg, aot.devices_for(topology))
    hlo = setup.step.lower(*setup.abstract_args()).compile().as_text()
    dots = _dots(hlo)
    assert sum(n for kinds, n in dots.items() if kinds in low) == 21, dots
    assert sum(n for kinds, n in dots.items() if kinds not in low) >= 4, dots  # attention and the head
    m, devices = cfg.model, setup.mesh.devices.size
    q, kv, f, d = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.d_ff, m.d_model
    gathers = _collectives(hlo, "all-gather|collective-permute", {(d, q), (d, kv), (q, d), (d, f), (f, d)})
    assert gathers == {gathered: 14}, gathers
    d = d // devices  # FSDP's shard of a weight
    shards = _collectives(hlo, "reduce-scatter|all-reduce|collective-permute", {(d, q), (d, kv), (q, d), (d, f),
                                                                                 (f, d)})
    assert shards == scattered, shards


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
    from scaletrain.facts import flops, hardware
    from scaletrain.models import ModelConfig
    from scaletrain.planner import roofline

    def plan(mode):
        return roofline.plan(config.load("configs/llama3_8b.yaml", [f"model.quantization={mode}"]), "v5p:4x4x2")

    bf16, int8 = plan("none"), plan("int8")
    m = config.load("configs/llama3_8b.yaml", []).model
    d, h, f = m.d_model, m.head_dim, m.d_ff
    layer = d * (m.num_heads + 2 * m.num_kv_heads) * h + m.num_heads * h * d + 3 * d * f
    assert int8["quantized_flops"] == pytest.approx(6 * int8["tokens_per_step"] * m.num_layers * layer)
    # The same count as the model's parameters say it (their operand annotations: MFU's share, flops.py).
    count = flops.param_count(ModelConfig.from_config(config.load("configs/llama3_8b.yaml", [
        "model.quantization=int8"]).model))
    assert int8["quantized_flops"] == pytest.approx(6 * int8["tokens_per_step"] * count.quantized)
    assert bf16["quantized_flops"] == 0
    chip = hardware.spec("v5p")
    saved = int8["quantized_flops"] * (1 / chip.bf16_flops - 1 / chip.int8_ops) / 32
    assert int8["time_s"]["compute"] == pytest.approx(bf16["time_s"]["compute"] - saved)
    assert int8["time_s"]["compute"] < 0.65 * bf16["time_s"]["compute"]


def test_mfu_divides_by_the_peak_the_quantized_step_could_attain():
    """MFU's peak weighs the chip's low-precision rate by the share of the FLOPs that run at it, so a quantized
    step's MFU stays a fraction: against the bf16 peak alone, the int8 8B plan on a v6e-64 claimed 147%. fp8 on a
    chip without float8 matrix units (v5p) is planned at the bf16 rate."""
    import types

    from scaletrain.facts import flops, hardware
    from scaletrain.models import ModelConfig
    from scaletrain.planner import roofline

    sets = ["remat.policy=save_dots", "train.grad_accum_steps=2"]
    share = flops.quantized_share(ModelConfig.from_config(config.load("configs/llama3_8b.yaml", [
        "model.quantization=int8"]).model), 8192)
    assert 0.81 < share < 0.82  # all but attention's own products and the output head
    v6e = hardware.spec("v6e")
    assert v6e.mixed_peak("int8", share) == pytest.approx(1 / ((1 - share) / 9.2e14 + share / 1.84e15))
    for mode in ("none", "int8"):
        r = roofline.plan(config.load("configs/llama3_8b.yaml", [f"model.quantization={mode}", *sets]), "v6e:8x8")
        assert r["mfu_upper_bound"] <= 1.0, (mode, r["mfu_upper_bound"])
        assert r["mfu_upper_bound"] == pytest.approx(r["step_flops"] / (64 * r["step_time_s"] * v6e.mixed_peak(
            mode, share if mode == "int8" else 0.0)))
    # What the trainer divides by: the same mixed peak, and its note says so.
    chips = [types.SimpleNamespace(device_kind="TPU v6 lite", platform="tpu")] * 4
    assert hardware.peak_flops(chips, None, "int8", share) == pytest.approx(4 * v6e.mixed_peak("int8", share))
    assert hardware.peak_note(chips, None, "int8", share) == (
        "MFU against v6e's bf16 peak 920 TFLOP/s and its int8 peak 1840 for the 81% of the FLOPs model.quantization "
        "rounds (1551 TFLOP/s) x 4 chips (hardware.yaml)")
    v5p = {mode: roofline.plan(config.load("configs/llama3_8b.yaml", [f"model.quantization={mode}"]), "v5p:4x4x2")
           for mode in ("none", "fp8", "int8")}
    assert v5p["fp8"]["time_s"]["compute"] == pytest.approx(v5p["none"]["time_s"]["compute"])
    assert v5p["int8"]["time_s"]["compute"] < 0.65 * v5p["none"]["time_s"]["compute"]


def test_the_plan_gathers_quantized_weights_in_a_byte():
    """FSDP's gathers as the compiled step makes them (the test above): float32 weights cast to bf16 before they
    travel, the quantized ones rounded to int8 before (a byte an element); their gradients come back in bf16."""
    from scaletrain.planner import roofline

    def layer_bytes(mode, dtype="bfloat16"):
        cfg = config.load("configs/llama3_8b.yaml", [f"model.quantization={mode}", f"model.dtype={dtype}"])
        return {c["what"]: c["full_bytes"] for c in roofline.plan(cfg, "v5p:4x4x2")["collectives"]
                if c["what"].startswith("layer")}

    m = config.load("configs/llama3_8b.yaml", []).model
    d, h, f = m.d_model, m.head_dim, m.d_ff
    matrices = d * (m.num_heads + 2 * m.num_kv_heads) * h + m.num_heads * h * d + 3 * d * f
    gains = 4 * 2 * d  # the two norms' float32 gains travel as they are
    assert layer_bytes("none", "float32") == dict.fromkeys(
        ["layer weights, forward", "layer weights, backward", "layer gradients"], 4 * matrices + gains)
    assert layer_bytes("none") == dict.fromkeys(
        ["layer weights, forward", "layer weights, backward", "layer gradients"], 2 * matrices + gains)
    assert layer_bytes("int8") == {"layer weights, forward": matrices + gains,
                                   "layer weights, backward": matrices + gains,
                                   "layer gradients": 2 * matrices + gains}


@pytest.mark.parametrize("per_tensor", [False, True], ids=["channel", "tensor"])
def test_the_quantized_matmul_and_its_gradients_follow_the_written_math(per_tensor):
    """Quantization.dot against its slow twin in numpy, the four steps of docs/quantization.md: the int8 forward
    with row and column scales (one each with model.quantization_scale=tensor), and the gradients with the
    forward operands' scales moved onto the incoming gradient before it is rounded."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from scaletrain.models.quantize import Quantization

    rng = np.random.default_rng(0)
    x, w, g = rng.normal(size=(16, 32)), rng.normal(size=(32, 8)) * 0.1, rng.normal(size=(16, 8))

    def scale(a, axis):
        return np.max(np.abs(a), axis=None if per_tensor else axis, keepdims=True) / 127

    def q(a, s):
        return np.round(a / s)

    sx, sw = scale(x, 1), scale(w, 0)
    y = (q(x, sx) @ q(w, sw)) * sx * sw
    g1 = g * sw
    dx = (q(g1, scale(g1, 1)) @ q(w, sw).T) * scale(g1, 1)
    g2 = g * sx
    dw = (q(x, sx).T @ q(g2, scale(g2, 0))) * scale(g2, 0)

    quant = Quantization("int8", per_tensor)
    got_y, vjp = jax.vjp(quant.dot, jnp.float32(x), jnp.float32(w))
    got_dx, got_dw = vjp(jnp.float32(g))
    for got, want in ((got_y, y), (got_dx, dx), (got_dw, dw)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(y, x @ w, rtol=1e-3)  # the rounding shows


def test_the_quantized_grouped_matmul_follows_the_written_math():
    """Quantization.ragged_dot against numpy, expert by expert: rows scaled per row, each expert's weights per
    column, the weight gradient's incoming gradient rounded per expert and column; padding rows past the groups
    give and take nothing."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from scaletrain.models.quantize import Quantization

    rng = np.random.default_rng(1)
    sizes = [5, 0, 7, 3]
    rows = sum(sizes) + 2  # two padding rows
    x, w, g = rng.normal(size=(rows, 16)), rng.normal(size=(4, 16, 8)) * 0.1, rng.normal(size=(rows, 8))

    def scale(a, axis):
        return np.maximum(np.max(np.abs(a), axis=axis, keepdims=True), 1e-30) / 127

    y, dx, dw = np.zeros((rows, 8)), np.zeros((rows, 16)), np.zeros_like(w)
    sx = scale(x, 1)
    start = 0
    for e, n in enumerate(sizes):
        r = slice(start, start + n)
        start += n
        sw = scale(w[e], 0)
        qw = np.round(w[e] / sw)
        y[r] = (np.round(x[r] / sx[r]) @ qw) * sx[r] * sw
        g1 = g[r] * sw
        s1 = scale(g1, 1)
        dx[r] = (np.round(g1 / s1) @ qw.T) * s1
        if n:
            g2 = g[r] * sx[r]
            s2 = scale(g2, 0)
            dw[e] = (np.round(x[r] / sx[r]).T @ np.round(g2 / s2)) * s2

    group_sizes = jnp.array(sizes, jnp.int32)
    got_y, vjp = jax.vjp(lambda a, b: Quantization("int8").ragged_dot(a, b, group_sizes), jnp.float32(x),
                         jnp.float32(w))
    got_dx, got_dw = vjp(jnp.float32(g))
    for got, want in ((got_y, y), (got_dx, dx), (got_dw, dw)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
