"""Chat SFT end to end, against transformers: a tiny random Hugging Face Llama (float32) with the chat tokenizer of
tests/chat_fixtures.py, converted in once. The first step's loss of a run on chat rows equals transformers' masked
mean cross-entropy (labels -100 outside the assistant mask, the token mean over the batch, each conversation run
alone) for three chat templates and with several conversations packed into a row. Then the whole recipe through the
command line: `data prepare` a chat corpus with an eval split, train with the held-out loss logged (it falls),
killed (SIGKILL) and resumed bitwise, exported with `convert to-hf`, and transformers generating an answer to a
chat prompt with the export."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

from scaletrain.__main__ import main
from scaletrain.data import loader
from scaletrain.tools import inference
from tests import chat_fixtures as fx
from tests.conftest import ROOT, run_main
from tests.test_resume import _finished_checkpoints, _resumed_step

SEQ_LEN, BATCH = 128, 8
# Shared by every run of the module, so that they compile one train step (the persistent compilation cache).
TRAIN = {"model.dtype": "float32", "model.param_dtype": "float32", "data.seq_len": SEQ_LEN,
         "train.global_batch": BATCH, "optim.learning_rate": 3e-3, "optim.warmup_steps": 0,
         "checkpoint.async_save": False}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(A random Hugging Face Llama with the chat tokenizer, its run directory from `convert from-hf`)."""
    root = tmp_path_factory.mktemp("sft")
    hf_dir = fx.write_tokenizer(root / "hf")
    vocab = fx.hf_tokenizer(hf_dir)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=vocab.bos_token_id, eos_token_id=vocab.eos_token_id),
        dtype=torch.float32)
    with torch.no_grad():  # far from the initialisation's near-uniform predictions, so that a wrong mask shows
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.2 * torch.randn_like(p))
    model.save_pretrained(hf_dir)
    assert main(["convert", "from-hf", "--hf-dir", str(hf_dir), "--out", str(root / "imported")]) == 0
    return hf_dir, root / "imported"


def _train_args(imported_run, run_dir, **extra) -> list[str]:
    sets = {"run_dir": run_dir, "checkpoint.init_from": imported_run, **TRAIN, **extra}
    return ["--config", str(imported_run / "config.yaml"), "--cpu-devices", "8"] + [
        a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _reference_loss(model, hf, text: str, rows: list[dict], conversations: list[list[dict]]) -> tuple[float, set]:
    """transformers' masked mean cross-entropy over the conversations the rows hold (each found by its tokens, run
    alone), and which conversations they are."""
    known = {}
    for i, messages in enumerate(conversations):
        out = hf.apply_chat_template(messages, chat_template=text, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        known[tuple(out["input_ids"])] = i, np.asarray(out["assistant_masks"])
    total, count, found = 0.0, 0, set()
    for row in rows:
        for segment in np.unique(row["segment_ids"][row["segment_ids"] > 0]):
            ids = tuple(int(t) for t in row["tokens"][row["segment_ids"] == segment])
            i, mask = known[ids]  # a KeyError: a row holds tokens that are no conversation's
            labels = torch.tensor(np.where(mask == 1, ids, -100))[None]
            with torch.no_grad():
                loss = model(torch.tensor(ids)[None], labels=labels).loss
            n = int((mask[1:] == 1).sum())  # labels are shifted: the first token predicts nothing
            total, count = total + float(loss) * n, count + n
            found.add(i)
    return total / count, found


@pytest.mark.parametrize("name, turns, packed", [("chatml", (1, 3), False), ("llama3", (1, 3), False),
                                                  ("qwen25", (1, 3), False), ("chatml", (1, 2), True)])
def test_first_step_loss_equals_transformers_masked_cross_entropy(name, turns, packed, imported, tmp_path, capfd):
    hf_dir, imported_run = imported
    conversations = fx.conversations(40 if packed else BATCH, seed=len(name), turns=turns)
    data = fx.write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in conversations])
    text = fx.template(name, marked=True)
    (tmp_path / "template.jinja").write_text(text)
    run = tmp_path / "run"
    result = run_main(_train_args(imported_run, run, steps=1, **{
        "data.source": "files", "data.path": data, "data.format": "chat",
        "data.chat_template": tmp_path / "template.jinja"}), capfd)
    assert result.returncode == 0, result.stderr
    cfg = inference.load_config(run)
    dataset = loader.make_dataset(cfg)
    rows = [dataset[i] for i in range(BATCH)]  # the first step's batch
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    want, found = _reference_loss(model, fx.hf_tokenizer(hf_dir), text, rows, conversations)
    np.testing.assert_allclose(_records(run)[0]["loss"], want, rtol=1e-5)
    if packed:  # rows of several conversations
        assert sum(int(row["segment_ids"].max()) for row in rows) >= 2 * BATCH
    else:  # every conversation in the first batch (the rows repeat them)
        assert found == set(range(BATCH))


def test_chat_sft_recipe_prepare_train_evaluate_resume_export_generate(imported, tmp_path, capfd):
    hf_dir, imported_run = imported
    conversations = fx.conversations(128, seed=1)
    fx.write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in conversations])
    prepared = run_main(["data", "prepare", "--format", "chat", "--tokenizer", str(imported_run / "tokenizer"),
                         "--input", str(tmp_path / "chat.jsonl"), "--out", str(tmp_path / "ds"), "--eval-fraction",
                         "0.25", "--workers", "1"], capfd, module=True)
    assert prepared.returncode == 0, prepared.stderr
    assert "examples" in prepared.stdout
    run = {"steps": 6, "checkpoint.every_steps": 2, "train.eval_every_steps": 2, "train.eval_batches": 1,
           "data.source": "prepared", "data.path": tmp_path / "ds", "data.format": "chat"}
    whole = run_main(_train_args(imported_run, tmp_path / "whole", **run), capfd)
    assert whole.returncode == 0, whole.stderr
    records = _records(tmp_path / "whole")
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0]  # the held-out conversations' loss falls
    killed = subprocess.run([sys.executable, str(ROOT / "tests" / "faults.py"), "between-steps", "5",
                             *_train_args(imported_run, tmp_path / "run", **run)], cwd=ROOT,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    committed = max(_finished_checkpoints(tmp_path / "run"))
    resumed = run_main(_train_args(imported_run, tmp_path / "run", **run), capfd)
    assert resumed.returncode == 0, resumed.stderr
    assert _resumed_step(resumed) == committed < 5
    losses = [(r["step"], r["loss"], r.get("eval_loss")) for r in _records(tmp_path / "run")]
    assert losses == [(r["step"], r["loss"], r.get("eval_loss")) for r in records]  # bit for bit
    # Out to transformers, which answers a chat prompt with the tuned model.
    assert main(["convert", "to-hf", "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    prompt = tok.apply_chat_template(conversations[0][:-1], add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]
    assert tok.decode(out[0]).startswith(tok.decode(prompt["input_ids"][0]))
