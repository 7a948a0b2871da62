"""train.eval_every_steps: the held-out loss, logged as eval_loss, equals the loss of the checkpoint's model on the
eval split's first batches computed plainly on one device."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scaletrain import config, data, inference, trainer
from scaletrain import model as model_lib
from scaletrain import tokenizer
from scaletrain.checkpoint import restore_params
from scaletrain.errors import DataError
from scaletrain.loss import cross_entropy
from scaletrain.prepare import prepare
from tests.conftest import tiny_overrides

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jovial kings".split()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    rng = np.random.RandomState(0)
    for i in range(100):
        (root / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS, rng.randint(20, 80))))
    prepare(tokenizer.load("bytes"), [str(root / "*.txt")], str(root / "ds"), "text", 0.25, 1)
    return root / "ds"


def overrides(run, ds, **extra):
    return tiny_overrides(run, steps=4, **{"mesh.fsdp": -1, "data.source": "prepared", "data.path": ds,
                                           "train.eval_every_steps": 2, "train.eval_batches": 2,
                                           "checkpoint.every_steps": 4, "checkpoint.async_save": False, **extra})


def test_eval_loss_is_logged_and_is_the_held_out_loss_of_the_model(tmp_path, dataset):
    run = tmp_path / "run"
    assert trainer.run(config.load(None, overrides(run, dataset))) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    # The step-4 evaluation, recomputed from the step-4 checkpoint on one device, without the trainer.
    cfg = inference.load_config(run)
    setup = inference.one_device_setup(cfg)
    _, params = restore_params(str(run), setup.abstract_state.params, step=4)
    model = nnx.merge(model_lib.abstract(setup.model_cfg)[0], params)
    eval_windows = data.make_eval_dataset(cfg)
    w = {k: np.stack([eval_windows[i][k] for i in range(2 * cfg.train.global_batch)]) for k in eval_windows[0]}
    logits = jax.jit(model)(*(jnp.asarray(w[k]) for k in ("tokens", "positions", "segment_ids")))
    expected = jnp.sum(cross_entropy(logits, jnp.asarray(w["targets"])) * w["loss_mask"]) / np.sum(w["loss_mask"])
    np.testing.assert_allclose(records[-1]["eval_loss"], float(expected), rtol=1e-5)
    # Held-out data is other data: its loss is not the training loss of the same step.
    assert records[-1]["eval_loss"] != records[-1]["loss"]


def test_an_eval_split_smaller_than_a_batch_is_refused(tmp_path, dataset):
    cfg = config.load(None, overrides(tmp_path / "run", dataset, **{"train.global_batch": 1024}))
    with pytest.raises(DataError, match="fewer than one batch of train.global_batch=1024"):
        trainer.run(cfg)
    assert not (tmp_path / "run").exists()
