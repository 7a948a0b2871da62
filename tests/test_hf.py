"""Hugging Face checkpoints in and out (scaletrain/tools/hf.py), against transformers: tiny random Llama (untied, GQA),
Llama 3 (llama3 RoPE scaling, tied, head_dim != hidden / heads), Mistral, Qwen3 (QK norms), Mixtral and Qwen3-MoE
(mixtures of experts) models, converted through the command line. scaletrain's logits equal transformers'
(float32); HF -> scaletrain -> HF is bit-exact and loads back into transformers; sharded files in and out; bad
input is one `error:` line. Also: folding a mixture of experts' norm gains (convert fold-norms) keeps its logits.

Each model is converted once (module-scoped fixtures) and its logits computed once: the module compiles six
forward passes."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
import yaml
from flax import nnx
from safetensors.numpy import load_file, save_file

from scaletrain import config as config_lib
from scaletrain import models as model_lib
from scaletrain.__main__ import main
from scaletrain.errors import CheckpointError
from scaletrain.store import storage
from scaletrain.store.checkpoint import check_resumable
from scaletrain.tools import hf, inference
from tests.conftest import tiny_overrides
from tests.numerics import assert_close

VOCAB = 320  # at least the byte tokenizer's 259 ids, which config.yaml names where a model comes without a tokenizer
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
MODELS = {
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=False, rope_theta=10000.0)),
    # Wavelengths from 2 pi to far beyond original_max_position: every band of the llama3 scaling is used.
    "llama3": (transformers.LlamaConfig, dict(
        head_dim=32, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16, rms_norm_eps=1e-5)),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=48, norm_topk_prob=True)),
}
TOKENS = np.random.RandomState(0).randint(0, VOCAB, (2, 16))


def _random_model(name: str) -> transformers.PreTrainedModel:
    """Weights far from their initialisation, norm gains included, so that a swapped or transposed tensor shows."""
    config_class, extra = MODELS[name]
    torch.manual_seed(len(name))
    model = transformers.AutoModelForCausalLM.from_config(config_class(**SMALL, **extra), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.1 * torch.randn_like(p))
    return model.eval()


def _logits(model: transformers.PreTrainedModel) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float().numpy()


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf")


@pytest.fixture(scope="module")
def source(workdir):
    """name -> (Hugging Face folder, transformers' float32 logits of TOKENS), made on first use."""
    made = {}

    def get(name: str) -> tuple[Path, np.ndarray]:
        if name not in made:
            model, folder = _random_model(name), workdir / f"hf_{name}"
            model.save_pretrained(folder)
            if name == "llama":
                _write_tokenizer(folder)
            made[name] = folder, _logits(model)
        return made[name]

    return get


@pytest.fixture(scope="module")
def converted(source, workdir):
    """name -> its run directory, converted through the command line on first use."""
    made = {}

    def get(name: str) -> Path:
        if name not in made:
            run = workdir / f"run_{name}"
            assert main(["convert", "from-hf", "--hf-dir", str(source(name)[0]), "--out", str(run)]) == 0
            made[name] = run
        return made[name]

    return get


def _scaletrain_logits(run: Path, tmp_path: Path) -> np.ndarray:
    np.save(tmp_path / "tokens.npy", TOKENS)
    assert main(["logits", "--run-dir", str(run), "--tokens", str(tmp_path / "tokens.npy"), "--out",
                 str(tmp_path / "logits.npy"), "--set", "model.dtype=float32"]) == 0
    return np.load(tmp_path / "logits.npy")


def _assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), np.abs(got - want).max()


def _assert_same_tensors(got: Path, want: Path) -> None:
    """The same tensor names, dtypes, shapes and bytes, whatever files they are spread over."""
    def tensors(folder: Path) -> dict[str, np.ndarray]:
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    a, b = tensors(got), tensors(want)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name


def _loaded_logits(folder: Path) -> np.ndarray:
    return _logits(transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())


@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_transformers(name, converted, source, tmp_path):
    _assert_close(_scaletrain_logits(converted(name), tmp_path), source(name)[1])


@pytest.mark.parametrize("name", MODELS)
def test_round_trip_is_bit_exact_and_loads_in_transformers(name, converted, source, tmp_path):
    folder, logits = source(name)
    out = tmp_path / "out"
    assert main(["convert", "to-hf", "--run-dir", str(converted(name)), "--out", str(out)]) == 0
    _assert_same_tensors(out, folder)
    assert (out / "config.json").read_bytes() == (folder / "config.json").read_bytes()
    np.testing.assert_array_equal(_loaded_logits(out), logits)


def test_tokenizer_files_go_with_the_run(converted, source, tmp_path):
    run, folder = converted("llama"), source("llama")[0]
    copied = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
    for name in copied:
        assert (run / "tokenizer" / name).read_bytes() == (folder / name).read_bytes()
    assert "tokenizer: tokenizer\n" in (run / "config.yaml").read_text()  # RUN_DIR/tokenizer
    assert hf.to_hf(str(run), str(tmp_path / "out")) == 0
    for name in copied:
        assert (tmp_path / "out" / name).read_bytes() == (folder / name).read_bytes()


@pytest.mark.parametrize("name, architecture", [("llama3", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM"),
                                                ("mixtral", "MixtralForCausalLM"),
                                                ("qwen3_moe", "Qwen3MoeForCausalLM")])
def test_config_built_from_the_run(name, architecture, converted, source, tmp_path):
    """A run with no kept config.json (trained in scaletrain) gets one built from its config.yaml."""
    run = tmp_path / "run"
    shutil.copytree(converted(name), run, ignore=shutil.ignore_patterns("hf"))
    assert hf.to_hf(str(run), str(tmp_path / "out")) == 0
    built = json.loads((tmp_path / "out" / "config.json").read_text())
    assert built["architectures"] == [architecture]
    _assert_same_tensors(tmp_path / "out", source(name)[0])
    _assert_close(_loaded_logits(tmp_path / "out"), source(name)[1])


def test_rope_settings_of_earlier_transformers(converted, source, tmp_path):
    """transformers 4 wrote rope_theta and rope_scaling where transformers 5 writes rope_parameters."""
    folder = tmp_path / "legacy"
    shutil.copytree(source("llama3")[0], folder)
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config |= {"rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["convert", "from-hf", "--hf-dir", str(folder), "--out", str(tmp_path / "run")]) == 0
    model = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]
    assert model == yaml.safe_load((converted("llama3") / "config.yaml").read_text())["model"]
    assert model["rope_scaling"] == "llama3" and model["rope_theta"] == 500000.0


def test_sharded_in_and_out(source, tmp_path):
    """A checkpoint sharded by transformers, converted in; exported in several files with an index."""
    folder = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(source("llama")[0]).save_pretrained(folder,
                                                                                          max_shard_size="100KB")
    assert len(list(folder.glob("*.safetensors"))) > 1 and (folder / hf.INDEX_FILE).is_file()
    assert main(["convert", "from-hf", "--hf-dir", str(folder), "--out", str(tmp_path / "run")]) == 0
    assert hf.to_hf(str(tmp_path / "run"), str(tmp_path / "out"), shard_bytes=60_000) == 0
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "out" / hf.INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(files)
    _assert_same_tensors(tmp_path / "out", source("llama")[0])
    np.testing.assert_array_equal(_loaded_logits(tmp_path / "out"), source("llama")[1])


def test_bfloat16_round_trip_is_bit_exact(tmp_path):
    folder = tmp_path / "bf16"
    _random_model("qwen3").to(torch.bfloat16).save_pretrained(folder)
    assert main(["convert", "from-hf", "--hf-dir", str(folder), "--out", str(tmp_path / "run")]) == 0
    assert main(["convert", "to-hf", "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    _assert_same_tensors(tmp_path / "out", folder)
    assert load_file(tmp_path / "out" / "model.safetensors")["model.norm.weight"].dtype.name == "bfloat16"


def test_a_converted_run_is_not_resumed(converted):
    """Its checkpoint has parameters only: training in its directory is refused, pointing at init_from."""
    run = converted("llama")
    with pytest.raises(CheckpointError, match="parameters-only checkpoint .* checkpoint.init_from="):
        check_resumable(storage.path(run) / "checkpoints", {}, str(run))


def _without(name: str):
    def change(folder: Path) -> None:
        tensors = load_file(folder / "model.safetensors")
        del tensors[name]
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return change


def _reshaped(name: str):
    def change(folder: Path) -> None:
        tensors = load_file(folder / "model.safetensors")
        tensors[name] = tensors[name][:-1]
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return change


def _configured(**keys):
    def change(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **keys}))
    return change


def _garbled(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")


@pytest.mark.parametrize("base, change, message", [
    ("llama", _without("model.layers.1.mlp.up_proj.weight"),
     "no tensor model.layers.1.mlp.up_proj.weight (expected [128, 64])"),
    ("llama", _reshaped("model.layers.0.self_attn.k_proj.weight"),
     "tensor model.layers.0.self_attn.k_proj.weight is F32 [31, 64]; expected [32, 64]"),
    ("llama", _garbled, "model.safetensors: cannot read it as safetensors"),
    ("llama", _configured(architectures=["GPT2LMHeadModel"]), "architecture GPT2LMHeadModel is not supported"),
    ("llama", _configured(attention_bias=True), "LlamaForCausalLM with attention_bias=true is not supported"),
    ("mistral", _configured(sliding_window=4096), "MistralForCausalLM with sliding_window=4096"),
    ("qwen3", _configured(use_sliding_window=True), "Qwen3ForCausalLM with use_sliding_window=true"),
    ("llama", _configured(rope_parameters={"rope_type": "dynamic", "factor": 4.0}), "with rope_type dynamic"),
    ("llama", _configured(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
     "with rope_type yarn without factor and original_max_position_embeddings"),
    ("mixtral", _without("model.layers.1.block_sparse_moe.experts.3.w2.weight"),
     "no tensor model.layers.1.block_sparse_moe.experts.3.w2.weight (expected [64, 128])"),
    ("mixtral", _configured(sliding_window=4096), "MixtralForCausalLM with sliding_window=4096"),
    ("mixtral", _configured(architectures=["Qwen2MoeForCausalLM"]), "architecture Qwen2MoeForCausalLM is not"),
    ("qwen3_moe", _configured(norm_topk_prob=False), "Qwen3MoeForCausalLM with norm_topk_prob=false"),
    ("qwen3_moe", _configured(decoder_sparse_step=2), "Qwen3MoeForCausalLM with decoder_sparse_step=2"),
    ("qwen3_moe", _configured(mlp_only_layers=[1]), "Qwen3MoeForCausalLM with mlp_only_layers [1]"),
])
def test_bad_checkpoints_are_one_error_line(base, change, message, source, tmp_path, capsys):
    folder = tmp_path / "bad"
    shutil.copytree(source(base)[0], folder)
    change(folder)
    capsys.readouterr()
    assert main(["convert", "from-hf", "--hf-dir", str(folder), "--out", str(tmp_path / "run")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("base, key, value", [("llama", "norm_weights", "folded"), ("mixtral", "moe_every", 2)])
def test_what_hugging_face_cannot_hold_is_refused(base, key, value, converted, tmp_path, capsys):
    """Folded norms; dense layers between the mixtures of experts (Mixtral has a mixture in every layer)."""
    run = tmp_path / "run"
    shutil.copytree(converted(base), run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["model"][key] = value
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    capsys.readouterr()
    assert main(["convert", "to-hf", "--run-dir", str(run), "--out", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: model.{key}={value}"), lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("moe_every", [1, 2])
def test_folding_a_mixture_of_experts_keeps_its_logits(moe_every):
    """`convert fold-norms` (inference.fold): a mixture of experts' mlp_norm gain goes into its router and each
    expert's w_gate and w_up; with moe_every 2 the dense blocks of each group fold too (two groups, so that a gain
    misplaced on the experts' axis shows). Gains far from 1, the same logits within 1e-5, for standard and fused
    norms."""
    moe = {"model.num_experts": 4, "model.moe_d_ff": 48, "model.moe_every": moe_every,
           "model.num_layers": 2 * moe_every}  # two mixtures of experts
    cfg = config_lib.load(None, tiny_overrides("unused", **moe))
    model_cfg = model_lib.ModelConfig.from_config(cfg.model)
    rng = np.random.RandomState(0)  # random weights from the shapes alone: no (slow, eager) initialisation
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: (1 + 0.5 * rng.randn(*x.shape) if "scale" in jax.tree_util.keystr(p) else
                      0.05 * rng.randn(*x.shape)).astype(np.float32), model_lib.abstract(model_cfg)[1])
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 32), 0, cfg.model.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(32), tokens.shape)

    def logits(model_cfg, params):
        graphdef = model_lib.abstract(model_cfg)[0]
        forward = jax.jit(lambda params: nnx.merge(graphdef, params)(tokens, positions, jnp.ones_like(tokens)))
        return np.asarray(forward(params))

    folded = inference.fold(params, False)
    assert "scale" not in str(jax.tree_util.tree_structure(folded))
    want = logits(model_cfg, params)
    for norm in ("standard", "fused"):
        folded_cfg = model_lib.ModelConfig.from_config(cfg.model, norm_weights="folded", norm=norm)
        # Folding rounds each gain x weight once, then the same sums in each order (router and experts included):
        # 32 ulps of the logits' scale (measured: 6; was atol 1e-5, ~50 ulps). A misplaced gain moves them ~10%.
        assert_close(logits(folded_cfg, folded), want, ulps=32)


def test_in_and_out_of_a_bucket(source, bucket, tmp_path):
    run = f"{bucket}/hf_llama"
    assert main(["convert", "from-hf", "--hf-dir", str(source("llama")[0]), "--out", run]) == 0
    assert main(["convert", "to-hf", "--run-dir", run, "--out", str(tmp_path / "out")]) == 0
    _assert_same_tensors(tmp_path / "out", source("llama")[0])
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (source("llama")[0] / "tokenizer.json").read_bytes()


def test_a_moved_run_keeps_its_tokenizer_and_trains_on_every_device(converted, tmp_path, capsys):
    """config.yaml names the tokenizer relative to the run directory and leaves mesh.fsdp to fill the devices: a
    copied or moved run still finds its tokenizer - to generate, and to fine-tune from (`--config
    RUN_DIR/config.yaml`) on this machine's 8 devices. A tokenizer named by an absolute path, as runs converted
    before wrote it, is used as it is."""
    run = converted("llama")
    written = yaml.safe_load((run / "config.yaml").read_text())
    assert (written["data"]["tokenizer"], written["mesh"]["fsdp"]) == ("tokenizer", -1)
    moved, hidden = tmp_path / "moved", tmp_path / "hidden"
    shutil.copytree(run, moved)
    run.rename(hidden)  # the original gone, as after a move
    try:
        capsys.readouterr()
        assert main(["generate", "--run-dir", str(moved), "--prompt", "hello world", "--max-new-tokens", "2"]) == 0
        # Refused at the data, after the mesh (fsdp=8) and after the tokenizer loaded: nothing is compiled.
        assert main(["train", "--config", str(moved / "config.yaml"), "--set", f"run_dir={tmp_path / 'tuned'}",
                     "--set", f"checkpoint.init_from={moved}", "--set", "data.source=prepared",
                     "--set", f"data.path={tmp_path / 'none'}"]) == 2
        assert f"'{tmp_path / 'none'}' is not a prepared dataset" in capsys.readouterr().err
    finally:
        hidden.rename(run)
    written["data"]["tokenizer"] = str(run / "tokenizer")
    (moved / "config.yaml").write_text(yaml.safe_dump(written))
    assert inference.load_config(moved).data.tokenizer == str(run / "tokenizer")
