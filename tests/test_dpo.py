"""DPO equals TRL's DPOTrainer (trl pinned with the test extras; its loss as of 0.29): on a tiny Hugging Face Llama
and a tiny Qwen3-MoE (router_aux_loss_coef 0), converted in with `convert from-hf`, the per-sequence log-probs, the
loss and every gradient of one batch of pairs agree within 1e-5 in float32 - for beta 0.1 and 0.5, the ipo and
hinge losses, and with LoRA against TRL + PEFT, whose reference is the model with its adapters off as ours is.
TRL tokenizes the pairs; ours are laid out from its token ids, one pair a row.

Then, on scaletrain's side alone: DPO trains alike on a mesh of 8 devices and on one (3 updates), cDPO's label
smoothing is the formula, and a DPO config without a reference is one error line."""

import copy
import json
import re

import jax
import numpy as np
import peft
import pytest
import torch
import transformers
import trl

from scaletrain import config
from scaletrain import models as model_lib
from scaletrain.__main__ import main
from scaletrain.train import objective as objective_lib
from scaletrain.train import trainer
from scaletrain.train.step import terms, with_reference
from tests import equivalence
from tests.conftest import converted_llama

WORDS = [f"w{i}" for i in range(60)]
VOCAB = 64  # [UNK], <s>, </s>, then the words
SEQ = 32
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, bos_token_id=1, eos_token_id=2, pad_token_id=0)
MODELS = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                    norm_topk_prob=True, router_aux_loss_coef=0.0)),
}
PAIRS = 4
# One float32 step on one device, the model as converted; the router's z-loss off like TRL's (no aux loss).
OURS = ["model.dtype=float32", "model.param_dtype=float32", f"data.seq_len={SEQ}", f"train.global_batch={PAIRS}",
        "train.objective=dpo", "data.format=preference", "data.source=synthetic", "model.router_z_loss=0",
        "lora.base_dtype=float32", "optim.warmup_steps=0", "steps=3"]


def _tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "[UNK]"}))
    return transformers.AutoTokenizer.from_pretrained(folder)


def _pairs(seed: int) -> list[dict]:
    rng = np.random.RandomState(seed)

    def text(lo, hi):
        return " ".join(rng.choice(WORDS, rng.randint(lo, hi)))

    return [{"prompt": text(2, 6) + " ", "chosen": text(2, 6), "rejected": text(1, 6)} for _ in range(PAIRS)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (Hugging Face folder, run directory of `convert from-hf`, tokenizer)."""
    root = tmp_path_factory.mktemp("dpo")
    made = {}
    for name, (config_class, extra) in MODELS.items():
        torch.manual_seed(len(name))
        model = transformers.AutoModelForCausalLM.from_config(config_class(**SMALL, **extra), dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(1 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.2 * torch.randn_like(p))
        model.save_pretrained(root / name)
        tokenizer = _tokenizer(root / name)
        assert main(["convert", "from-hf", "--hf-dir", str(root / name), "--out", str(root / f"run_{name}")]) == 0
        made[name] = root / name, root / f"run_{name}", tokenizer
    return made


def _rows(examples: list[dict]) -> dict[str, np.ndarray]:
    """TRL's tokenized pairs as scaletrain's rows: segment 1 prompt + chosen, segment 2 prompt + rejected, the
    loss mask on the targets that are completion tokens."""
    rows = {k: np.zeros((len(examples), SEQ), dt) for k, dt in
            (("tokens", np.int32), ("targets", np.int32), ("positions", np.int32), ("segment_ids", np.int32),
             ("loss_mask", np.float32))}
    for r, ex in enumerate(examples):
        start = 0
        for segment, completion in ((1, ex["chosen_ids"]), (2, ex["rejected_ids"])):
            seq = list(ex["prompt_ids"]) + list(completion)
            end = start + len(seq)
            rows["tokens"][r, start:end] = seq
            rows["targets"][r, start:end - 1] = seq[1:]
            rows["positions"][r, start:end] = np.arange(len(seq))
            rows["segment_ids"][r, start:end] = segment
            rows["loss_mask"][r, start + len(ex["prompt_ids"]) - 1:end - 1] = 1
            start = end
    return rows


def _trl(folder, tokenizer, dataset, beta: float, loss: str, lora: dict | None):
    """(TRL's trainer, its model): the reference a copy of the model, or with `lora` the adapters off."""
    from datasets import Dataset

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    args = trl.DPOConfig(output_dir=str(folder / "trl"), beta=beta, loss_type=[loss], use_cpu=True, bf16=False,
                         gradient_checkpointing=False, report_to=[], max_length=None, dataset_num_proc=None,
                         per_device_train_batch_size=PAIRS)
    if lora is None:
        trainer_ = trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args,
                                  train_dataset=Dataset.from_list(dataset), processing_class=tokenizer)
    else:
        trainer_ = trl.DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(dataset),
                                  processing_class=tokenizer, peft_config=peft.LoraConfig(**lora))
    return trainer_, trainer_.model


def _trl_values(trainer_, model):
    """(per-sequence log-probs [chosen..., rejected...], loss, {name: gradient}) of TRL's first batch."""
    examples = [trainer_.train_dataset[i] for i in range(PAIRS)]
    batch = trainer_.data_collator(examples)
    model.train()
    loss = trainer_.compute_loss(model, batch)
    loss.backward()
    with torch.no_grad():  # TRL's sum over completion tokens, from the logits
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        per_sequence = (logprobs * batch["completion_mask"][:, 1:]).sum(1).numpy()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return examples, per_sequence, float(loss), grads


def _ours(run, examples, overrides, lora_weights=None):
    """(per-sequence log-probs [chosen..., rejected...], loss, gradient tree) of scaletrain on one device, the
    adapters set to `lora_weights` where given."""
    cfg = config.load(run / "config.yaml", [f"checkpoint.init_from={run}", f"run_dir={run}-ours", *OURS, *overrides])
    setup = trainer.build(cfg, jax.devices()[:1])
    state, _ = trainer._initial_state(cfg, setup)
    params = jax.device_get(state.params)
    if lora_weights is not None:
        params = lora_weights(params)
    batch = _rows(examples)
    objective = objective_lib.of(cfg)
    kind = objective_lib.reference_kind(cfg)
    parts, graphdef, runner = setup.parts, model_lib.abstract(setup.model_cfg)[0], setup.runner
    add = with_reference(kind, graphdef, runner, parts, lambda p: p)

    def loss_and_grads(params, reference, batch):
        batch = add(params, reference, batch)
        trained, frozen = parts.split(params)
        (total, sums), grads = jax.value_and_grad(
            lambda t: terms(graphdef, parts.join(t, frozen), batch, runner, objective), has_aux=True)(trained)
        count = sums["count"]
        logprobs = -runner.token_losses(graphdef, params, batch)
        per_sequence = [np.sum(logprobs * batch["loss_mask"] * (batch["segment_ids"] == s), axis=1) for s in (1, 2)]
        return jax.numpy.concatenate(per_sequence), sums["loss"] / count, jax.tree.map(lambda g: g / count, grads)

    per_sequence, loss, grads = jax.jit(loss_and_grads)(params, state.reference, batch)
    return np.asarray(per_sequence), float(loss), jax.device_get(grads), setup


def _close(got, want, what, rtol=1e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    diff, norm = np.linalg.norm(got - want), np.linalg.norm(want)
    assert diff <= rtol * max(norm, 1e-30), f"{what}: relative difference {diff / norm:.3g} > {rtol:g}"


def _hf_grad_to_ours(setup, arch, grads_hf: dict, ours: dict, lora: bool):
    """Each TRL gradient beside ours, as (name, ours, theirs in our layout)."""
    from scaletrain.tools.hf import tensors

    out = []
    for t in tensors(setup.abstract_state.params, arch):
        node = ours
        for key in t.path[:-1]:
            node = node.get(key, {})
        if lora:
            adapter = node.get(t.path[-1] + "_lora")
            name = "base_model.model." + t.name.removesuffix(".weight")
            if adapter is None:
                continue
            a_hf, b_hf = grads_hf[f"{name}.lora_A.default.weight"], grads_hf[f"{name}.lora_B.default.weight"]
            a, b = np.asarray(adapter["a"])[t.index], np.asarray(adapter["b"])[t.index]
            out += [(f"{name}.lora_A", a, a_hf.T.reshape(a.shape)), (f"{name}.lora_B", b, b_hf.T.reshape(b.shape))]
        else:
            mine = np.asarray(node[t.path[-1]])[t.index]
            out.append((t.name, mine, t.to_scaletrain(_expert_grad(grads_hf, t.name))))
    return out


def _expert_grad(grads_hf: dict, name: str) -> np.ndarray:
    """The gradient of checkpoint tensor `name`: transformers 5 keeps a mixture's experts in two parameters,
    gate_up_proj [experts, 2 x f, d] and down_proj [experts, d, f], where checkpoints have one tensor an expert."""
    if ".experts." not in name:
        return grads_hf[name]
    layer, expert, proj = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)_proj\.weight", name).groups()
    if proj == "down":
        return grads_hf[f"{layer}.down_proj"][int(expert)]
    gate_up = grads_hf[f"{layer}.gate_up_proj"][int(expert)]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if proj == "gate" else gate_up[half:]


CASES = {
    "llama beta=0.1": ("llama", 0.1, "sigmoid"),
    "llama beta=0.5": ("llama", 0.5, "sigmoid"),
    "llama ipo": ("llama", 0.1, "ipo"),
    "llama hinge": ("llama", 0.1, "hinge"),
    "qwen3_moe beta=0.1": ("qwen3_moe", 0.1, "sigmoid"),
}


@pytest.mark.parametrize("case", CASES)
def test_log_probs_loss_and_gradients_equal_trl(case, models):
    name, beta, loss_type = CASES[case]
    folder, run, tokenizer = models[name]
    trainer_, model = _trl(folder, tokenizer, _pairs(0), beta, loss_type, None)
    examples, per_sequence, loss, grads_hf = _trl_values(trainer_, model)
    got_seq, got_loss, grads, setup = _ours(run, examples, [f"dpo.beta={beta}", f"dpo.loss={loss_type}"])
    _close(got_seq, per_sequence, "per-sequence log-probs")
    _close(got_loss, loss, "loss")
    arch = "LlamaForCausalLM" if name == "llama" else "Qwen3MoeForCausalLM"
    compared = _hf_grad_to_ours(setup, arch, grads_hf, grads, lora=False)
    assert len(compared) == len(grads_hf) + (3 * 4 - 2) * SMALL["num_hidden_layers"] * (name == "qwen3_moe")
    for what, mine, theirs in compared:
        _close(mine, theirs, f"gradient of {what}")


def test_lora_dpo_equals_trl_with_peft(models):
    """TRL + PEFT's reference is the model with its adapters disabled; ours the base with the adapters at zero.
    B is set away from zero (in both) so that the policy differs from the reference and A has a gradient."""
    folder, run, tokenizer = models["llama"]
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "gate_proj", "up_proj", "down_proj"])
    trainer_, model = _trl(folder, tokenizer, _pairs(1), 0.1, "sigmoid", lora)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn_like(p))
    weights = {n: p.detach().numpy().copy() for n, p in model.named_parameters() if "lora_" in n}
    examples, per_sequence, loss, grads_hf = _trl_values(trainer_, model)

    def set_adapters(params):
        from scaletrain.tools.hf import tensors

        for t in tensors(params, "LlamaForCausalLM"):
            node = params
            for key in t.path[:-1]:
                node = node[key]
            adapter = node.get(t.path[-1] + "_lora")
            if adapter is None:
                continue
            name = "base_model.model." + t.name.removesuffix(".weight")
            for ours, theirs in (("a", "lora_A"), ("b", "lora_B")):
                value = np.asarray(adapter[ours]).copy()
                value[t.index] = weights[f"{name}.{theirs}.default.weight"].T.reshape(value.shape[1:])
                adapter[ours] = value
        return params

    got_seq, got_loss, grads, setup = _ours(run, examples, ["lora.rank=4", "lora.alpha=8"], set_adapters)
    _close(got_seq, per_sequence, "per-sequence log-probs")
    _close(got_loss, loss, "loss")
    assert got_loss > 0.01 + np.log(2) or got_loss < np.log(2) - 0.01  # the adapters change the policy
    compared = _hf_grad_to_ours(setup, "LlamaForCausalLM", grads_hf, grads, lora=True)
    assert len(compared) == len(grads_hf) == 2 * 7 * SMALL["num_hidden_layers"]
    for what, mine, theirs in compared:
        _close(mine, theirs, f"gradient of {what}")


def _random_rows(seed: int, rows: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.RandomState(seed)

    def ids(lo, hi):
        return list(rng.randint(3, 384, rng.randint(lo, hi)))

    return _rows([{"prompt_ids": ids(2, 8), "chosen_ids": ids(1, 7), "rejected_ids": ids(1, 7)}
                  for _ in range(rows)])


# The tiny model trained on random pairs. Its initial parameters are both the policy's start and the reference
# (the harness starts every run from the one-device init, which the reference copy is made from): checkpoint.init_from
# is required by the config but never read here.
DPO_TINY = ["train.objective=dpo", "data.format=preference", "data.source=synthetic", "checkpoint.init_from=unused"]
MESHES = {
    "fsdp=4 x tensor=2": ["mesh.fsdp=4", "mesh.tensor=2"],
    "pipeline=2 x fsdp=2 x context=2": ["mesh.pipeline=2", "mesh.fsdp=2", "mesh.context=2"],
    "lora, fsdp=4 x tensor=2": ["lora.rank=4", "mesh.fsdp=4", "mesh.tensor=2"],
}


@pytest.mark.parametrize("mesh", MESHES)
def test_dpo_trains_alike_on_a_mesh_and_one_device(mesh):
    batches = [_random_rows(s) for s in range(3)]
    lora = [o for o in MESHES[mesh] if o.startswith("lora.")]
    want = equivalence.reference(batches, *DPO_TINY, *lora)
    got = equivalence.run(batches, *DPO_TINY, *MESHES[mesh])
    # The rewards are beta x (policy - reference) of sequences whose log-probs are ~ -50: a float32 rounding of the
    # sums (~5e-6) is ~1e-5 of a reward of ~1e-3. The loss and the gradient norm hold to 1e-5.
    equivalence.assert_same(got, want, metrics=("loss", "grad_norm", "dpo_chosen_reward", "dpo_margin"),
                            dpo_chosen_reward=1e-3, dpo_margin=1e-3)
    assert want.losses[0] == pytest.approx(np.log(2), rel=1e-6)  # the policy starts as the reference
    assert want.series("dpo_margin")[-1] != 0


def test_label_smoothing_is_conservative_dpo():
    """-(1 - e) log sigmoid(beta delta) - e log sigmoid(-beta delta): at the first step (delta = 0 for every pair)
    the loss is log 2 whatever e, and its gradient (1 - 2e) times plain DPO's."""
    batches = [_random_rows(s) for s in range(1)]
    plain = equivalence.reference(batches, *DPO_TINY)
    smoothed = equivalence.run(batches, *DPO_TINY, "dpo.label_smoothing=0.2")
    assert smoothed.losses[0] == pytest.approx(np.log(2), rel=1e-6) == plain.losses[0]
    assert smoothed.grad_norms[0] == pytest.approx(0.6 * plain.grad_norms[0], rel=1e-5)


@pytest.mark.parametrize("overrides, says", [
    (["train.objective=dpo", "data.format=preference", "data.source=synthetic"], "needs a reference model"),
    (["train.objective=dpo", "data.format=text"], "DPO learns from preference rows"),
    (["train.objective=dpo", "data.format=preference", "data.source=synthetic", "checkpoint.init_from=x",
      "lora.rank=4", "dpo.reference=copy"], "no second copy"),
    (["dpo.label_smoothing=0.5"], "dpo.label_smoothing must be in"),
    (["lora.rank=4", "lora.targets=q_proj,query"], "lora.targets names no matmul 'query'"),
    (["train.objective=dpo", "data.format=preference", "data.source=synthetic", "checkpoint.init_from=runs/none"],
     "runs/none' is not a run directory"),
])
def test_bad_post_training_configs_are_one_error_line(overrides, says, capsys, tmp_path):
    code = main(["train", "--config", "configs/llama_tiny.yaml", "--set", f"run_dir={tmp_path}",
                 *[a for o in overrides for a in ("--set", o)]])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error:") and says in err and err.count("\n") == 1, err


def test_dpo_with_a_1f1b_pipeline_is_refused():
    cfg = config.load(None, [*DPO_TINY, "mesh.pipeline=2", "pipeline.schedule=1f1b"])
    with pytest.raises(config.ConfigError, match="returns summed losses"):
        trainer.build(cfg, jax.devices()[:2])


def test_precomputed_reference_log_probs_train_as_the_copy_does(tmp_path):
    """`data reference` stores the reference's log-probs in a prepared preference dataset; DPO trained from them
    (dpo.reference=precomputed: no copy, no reference forward) takes the steps a copy of the same run takes."""
    converted_llama(tmp_path)
    rng = np.random.RandomState(0)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "omega"]
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for _ in range(20):
            f.write(json.dumps({k: " ".join(rng.choice(words, rng.randint(1, 4))) for k in
                                ("prompt", "chosen", "rejected")}) + "\n")
    assert main(["data", "prepare", "--format", "preference", "--tokenizer", "bytes", "--input",
                 str(tmp_path / "pairs.jsonl"), "--out", str(tmp_path / "pairs"), "--workers", "1"]) == 0
    assert main(["data", "reference", "--run-dir", str(tmp_path / "base"), "--data", str(tmp_path / "pairs"),
                 "--out", str(tmp_path / "with_reference"), "--set", "model.dtype=float32"]) == 0

    def train(run, reference):
        overrides = ["steps=2", f"run_dir={tmp_path / run}", f"checkpoint.init_from={tmp_path / 'base'}",
                     "train.objective=dpo", "data.format=preference", "data.source=prepared",
                     f"data.path={tmp_path / 'with_reference'}", "data.seq_len=64", "train.global_batch=8",
                     "model.dtype=float32", "optim.warmup_steps=0", f"dpo.reference={reference}"]
        assert main(["train", "--config", str(tmp_path / "base" / "config.yaml"),
                     *[a for o in overrides for a in ("--set", o)]]) == 0
        return [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    copy_, precomputed = train("copy", "copy"), train("precomputed", "precomputed")
    assert copy_[0]["loss"] == pytest.approx(np.log(2), rel=1e-6)
    for a, b in zip(precomputed, copy_):
        for key in ("loss", "grad_norm", "dpo_margin"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert copy_[1]["dpo_margin"] != 0
