"""YaRN RoPE (model.rope_scaling: yarn) against transformers' rope init function: the inverse frequencies and the
attention factor on cos/sin, for DeepSeek's settings (both mscales: factor 1 on cos/sin, the magnitude in the
softmax scale), GPT-OSS's (fractional ramp bounds, the magnitude on cos/sin) and an explicit attention factor."""

from __future__ import annotations

import numpy as np
import pytest

from scaletrain import config as config_lib
from scaletrain.errors import ConfigError
from scaletrain.models import ModelConfig, rope

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CASES = {
    "deepseek": dict(head_dim=64, theta=10000.0, rope=dict(factor=40.0, original_max_position_embeddings=4096,
                                                           beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
    "gpt_oss": dict(head_dim=64, theta=150000.0, rope=dict(factor=32.0, original_max_position_embeddings=4096,
                                                           beta_fast=32.0, beta_slow=1.0, truncate=False)),
    "explicit": dict(head_dim=16, theta=500.0, rope=dict(factor=4.0, original_max_position_embeddings=64,
                                                         beta_fast=8.0, beta_slow=2.0, attention_factor=1.25)),
}


@pytest.mark.parametrize("case", CASES)
def test_yarn_matches_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    c = CASES[case]
    hf = transformers.PretrainedConfig(hidden_size=c["head_dim"] * 4, num_attention_heads=4, head_dim=c["head_dim"],
                                       max_position_embeddings=1 << 17,
                                       rope_parameters={"rope_type": "yarn", "rope_theta": c["theta"], **c["rope"]})
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    r = c["rope"]
    cfg = ModelConfig.from_config(dict(
        head_dim=c["head_dim"], rope_theta=c["theta"], rope_scaling="yarn", rope_scaling_factor=r["factor"],
        rope_original_max_position=r["original_max_position_embeddings"], rope_beta_fast=float(r["beta_fast"]),
        rope_beta_slow=float(r["beta_slow"]), rope_truncate=r.get("truncate", True), rope_mscale=r.get("mscale", 0.0),
        rope_mscale_all_dim=r.get("mscale_all_dim", 0.0), rope_attention_factor=r.get("attention_factor", 0.0)))
    np.testing.assert_allclose(cfg.inverse_frequencies(), want_freq.numpy(), rtol=2e-7)
    assert cfg.rope_scale == pytest.approx(want_factor, rel=1e-12)
    # the ramp is partial in every case: some frequencies scaled, some kept, some between
    plain = rope.inverse_frequencies(c["head_dim"], c["theta"])
    ratio = plain / cfg.inverse_frequencies()
    assert ratio.min() == pytest.approx(1) and ratio.max() == pytest.approx(r["factor"], rel=1e-6)
    assert np.any((ratio > 1.01) & (ratio < r["factor"] * 0.99))


def test_yarn_softmax_mscale():
    """DeepSeek: softmax scale head_dim**-0.5 x mscale(factor, mscale_all_dim)**2 (1.369**2 at factor 40), only
    where model.rope_softmax_mscale says so."""
    keys = dict(head_dim=192, rope_scaling="yarn", rope_scaling_factor=40.0, rope_mscale=1.0, rope_mscale_all_dim=1.0)
    on = ModelConfig.from_config(keys | dict(rope_softmax_mscale=True))
    off = ModelConfig.from_config(keys)
    mscale = 0.1 * np.log(40.0) + 1
    assert on.softmax_scale == pytest.approx(192 ** -0.5 * mscale ** 2)
    assert off.softmax_scale == pytest.approx(192 ** -0.5)


def test_yarn_bad_betas_refused():
    with pytest.raises(ConfigError, match="rope_beta_fast"):
        config_lib.load(None, ["model.rope_scaling=yarn", "model.rope_beta_fast=1", "model.rope_beta_slow=2"])
