"""The fine-tuning recipe end to end (configs/llama3_1b_finetune.yaml at a tiny size): a Hugging Face Llama and its
tokenizer converted in, a corpus prepared with that tokenizer, training from the imported weights with the
held-out loss every few steps, and the result converted back into a folder transformers loads. eval_loss equals
the loss of the step's checkpoint on the eval split's first batches, computed plainly on one device."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from scaletrain import config
from scaletrain import models as model_lib
from scaletrain.__main__ import main
from scaletrain.data import loader as data
from scaletrain.errors import DataError
from scaletrain.store.checkpoint import restore_params
from scaletrain.tools import inference
from scaletrain.train import trainer
from scaletrain.train.loss import cross_entropy
from tests.conftest import ROOT

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jovial kings".split()
RECIPE = ROOT / "configs" / "llama3_1b_finetune.yaml"


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(a Hugging Face Llama with a BPE tokenizer, its run directory from `convert from-hf`, a corpus prepared
    with the run's tokenizer and a quarter of its documents held out)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("finetune")
    rng = np.random.RandomState(0)
    texts = [" ".join(rng.choice(WORDS, rng.randint(20, 80))) for _ in range(100)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=0, eos_token_id=1), dtype=torch.float32)
    hf_model.save_pretrained(root / "hf")
    tok.save(str(root / "hf" / "tokenizer.json"))
    (root / "hf" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    assert main(["convert", "from-hf", "--hf-dir", str(root / "hf"), "--out", str(root / "imported")]) == 0
    for i, text in enumerate(texts):
        (root / f"doc{i:03d}.txt").write_text(text)
    assert main(["data", "prepare", "--tokenizer", str(root / "imported" / "tokenizer"), "--input",
                 str(root / "doc*.txt"), "--out", str(root / "corpus"), "--eval-fraction", "0.25", "--workers",
                 "1"]) == 0
    return root


def recipe(root, run, **extra) -> list[str]:
    """The recipe's config at the imported model's size, on this machine's 8 devices."""
    values = {"run_dir": run, "steps": 4, "model.vocab_size": 320, "model.d_model": 64, "model.num_layers": 2,
              "model.num_heads": 4, "model.num_kv_heads": 2, "model.head_dim": 16, "model.d_ff": 128,
              "model.tie_embeddings": False, "model.rope_theta": 10000.0, "model.rope_scaling": "none",
              "model.norm_eps": 1e-6, "model.dtype": "float32", "model.attention": "xla", "remat.policy": "none",
              "data.path": root / "corpus", "data.tokenizer": root / "imported" / "tokenizer", "data.seq_len": 32,
              "train.global_batch": 8, "train.eval_every_steps": 2, "train.eval_batches": 2,
              "checkpoint.every_steps": 4, "checkpoint.async_save": False, "checkpoint.init_from": root / "imported",
              "optim.learning_rate": 1e-3, "optim.warmup_steps": 1, **extra}
    return [f"{k}={v}" for k, v in values.items()]


def test_fine_tune_an_imported_model_with_evaluation_and_export_it(imported, tmp_path):
    import torch
    import transformers

    run = tmp_path / "run"
    assert trainer.run(config.load(RECIPE, recipe(imported, run))) == 0
    # The run keeps its own copy of the tokenizer and names it relative to itself: moved, or once the imported
    # run is gone, it still generates and converts.
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["tokenizer"] == "tokenizer"
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == (imported / "hf" / "tokenizer.json").read_bytes()
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
    assert records[-1]["eval_loss"] != records[-1]["loss"]  # held-out data is other data
    # Fine-tuned from the imported weights (not from a fresh initialisation), and back out to transformers.
    assert main(["convert", "to-hf", "--run-dir", str(run), "--out", str(tmp_path / "out")]) == 0
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    original = transformers.AutoModelForCausalLM.from_pretrained(imported / "hf", dtype=torch.float32)
    with torch.no_grad():
        moved = [float((a - b).abs().max()) for a, b in zip(tuned.parameters(), original.parameters())]
    assert 0 < max(moved) < 0.01  # 4 Adam steps of at most 1e-3 each; a fresh initialisation would differ by ~0.1
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (imported / "hf" / "tokenizer.json").read_bytes()


def test_an_eval_split_smaller_than_a_batch_is_refused(imported, tmp_path):
    cfg = config.load(RECIPE, recipe(imported, tmp_path / "run", **{"train.global_batch": 1024}))
    with pytest.raises(DataError, match="fewer than one batch of train.global_batch=1024"):
        trainer.run(cfg)
    assert not (tmp_path / "run").exists()
