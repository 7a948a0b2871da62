"""Parameter and FLOP counts against hand counts."""

import jax
import pytest

from scaletrain import config
from scaletrain.facts import flops, hardware
from scaletrain.models import ModelConfig, abstract
from tests.conftest import ROOT


def _model(path):
    return ModelConfig.from_config(config.load(ROOT / "configs" / path).model)


def test_llama3_8b_has_8_03e9_parameters():
    m = _model("llama3_8b.yaml")
    # Per layer: MLP 3*4096*14336 + attention 2*4096*(32+8)*128 + two norms 2*4096.
    per_layer = 3 * 4096 * 14336 + 2 * 4096 * 40 * 128 + 2 * 4096
    hand = 32 * per_layer + 2 * 128256 * 4096 + 4096
    assert hand == 8_030_261_248
    assert flops.param_count(m).total == hand
    # Training FLOPs per token at T=8192: 6 x matmul weights + causal attention 6 T N H L.
    matmul = 32 * (3 * 4096 * 14336 + 2 * 4096 * 40 * 128) + 128256 * 4096
    assert flops.flops_per_token(m, 8192) == 6 * matmul + 6 * 8192 * 32 * 128 * 32


def test_llama3_70b_parameters():
    m = _model("llama3_70b.yaml")
    assert flops.param_count(m).total == pytest.approx(70.55e9, rel=1e-3)


def test_tiny_counts_match_the_model_itself():
    m = _model("llama_tiny.yaml")
    _, shapes, _ = abstract(m)
    assert flops.param_count(m).total == sum(x.size for x in jax.tree.leaves(shapes))
    # 4 layers of (3*128*512 + 2*128*(4+2)*32 + 2*128), two 384x128 tables, the final norm.
    assert flops.param_count(m).total == 4 * (196608 + 49152 + 256) + 2 * 384 * 128 + 128


def test_tied_output_projection_still_counts_as_a_matmul():
    import dataclasses

    m = dataclasses.replace(_model("llama_tiny.yaml"), tie_embeddings=True)
    count = flops.param_count(m)
    assert count.lm_head == 0 and count.matmul == 4 * (196608 + 49152) + 384 * 128


def test_chip_lookup_prefers_the_longest_match():
    assert hardware.chip("TPU v5 lite") == "v5e"
    assert hardware.chip("TPU v5") == "v5p"
    assert hardware.chip("NVIDIA H100 80GB HBM3") == "h100"
    assert hardware.chip("cpu") is None
