import numpy as np
import pytest

from scaletrain import config, optim
from scaletrain.model import ModelConfig, abstract


def test_weight_decay_skips_norms_and_embeddings_unless_asked():
    cfg = config.load(None, [])
    _, _, logical = abstract(ModelConfig.from_config(cfg.model))
    mask = optim.decay_mask(cfg.optim, logical)
    assert mask["layers"]["attn"]["wq"] and mask["layers"]["mlp"]["w_down"]
    assert not mask["layers"]["attn_norm"]["scale"] and not mask["final_norm"]["scale"]
    assert not mask["embed"]["table"] and not mask["lm_head"]
    both = config.load(None, ["optim.decay_norms=true", "optim.decay_embeddings=true"])
    mask = optim.decay_mask(both.optim, logical)
    assert mask["final_norm"]["scale"] and mask["embed"]["table"]


def test_warmup_then_cosine_to_the_floor():
    cfg = config.load(None, ["optim.learning_rate=1.0", "optim.warmup_steps=10", "optim.min_lr_ratio=0.1"])
    lr = optim.schedule(cfg.optim, 110)
    assert float(lr(0)) == 0.0
    assert float(lr(5)) == pytest.approx(0.5)
    assert float(lr(10)) == pytest.approx(1.0)
    assert float(lr(60)) == pytest.approx(0.55, rel=1e-4)
    assert float(lr(110)) == pytest.approx(0.1)
    assert np.all(np.diff([float(lr(s)) for s in range(10, 111)]) <= 1e-7)
