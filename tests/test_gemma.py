"""The gemma family (models/gemma/) against transformers: tiny random Gemma 3 (text) and Gemma 2 models with every
option non-trivial - a window shorter than the sequence, sliding and full layers, RoPE bases per layer kind with
linear scaling on the full layers, a query scalar other than head_dim, soft caps that bite, (1 + w) gains far from
1 - converted through the command line: scaletrain's logits equal transformers' (float32, 1e-5 of the largest),
with XLA and flash attention; HF -> scaletrain -> HF is bit-exact and loads back; greedy generate is the argmax of
the forward pass; 4 updates on a mesh equal one device; what Hugging Face cannot take is one error line."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from scaletrain import config as config_lib
from scaletrain import models as model_lib
from scaletrain.__main__ import main
from scaletrain.errors import ConfigError, UserError
from scaletrain.tools import hf, inference
from scaletrain.tools.generate import generate_tokens
from scaletrain.train import init_from
from tests import equivalence
from tests.test_hf import _assert_close, _assert_same_tensors

VOCAB = 320  # at least the byte tokenizer's 259 ids (config.yaml names it: the models come without a tokenizer)
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, sliding_window=6, query_pre_attn_scalar=24, rms_norm_eps=1e-6)
MODELS = {
    # Sliding, sliding, full, cycled (truncated at 4 layers); the full layers' RoPE scaled linearly.
    "gemma3": (transformers.Gemma3TextConfig, dict(
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        final_logit_softcapping=2.0)),
    "gemma2": (transformers.Gemma2Config, dict(attn_logit_softcapping=1.5, final_logit_softcapping=2.0,
                                               tie_word_embeddings=False)),
}
TOKENS = np.random.RandomState(0).randint(0, VOCAB, (2, 16))


def _random_model(name: str) -> transformers.PreTrainedModel:
    """Weights far from their initialisation (norm gains w of 1 + w around 0.2), so that a swapped or transposed
    tensor, or a gain taken as w instead of 1 + w, shows."""
    config_class, extra = MODELS[name]
    torch.manual_seed(len(name))
    model = transformers.AutoModelForCausalLM.from_config(config_class(**SMALL, **extra), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.2 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.15 * torch.randn_like(p))
    return model.eval()


def _logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float().numpy()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gemma")


@pytest.fixture(scope="module")
def source(workdir):
    """name -> (Hugging Face folder, transformers' float32 logits of TOKENS), made on first use."""
    made = {}

    def get(name: str):
        if name not in made:
            model, folder = _random_model(name), workdir / f"hf_{name}"
            model.save_pretrained(folder)
            made[name] = folder, _logits(model)
        return made[name]

    return get


@pytest.fixture(scope="module")
def converted(source, workdir):
    made = {}

    def get(name: str) -> Path:
        if name not in made:
            run = workdir / f"run_{name}"
            assert main(["convert", "from-hf", "--hf-dir", str(source(name)[0]), "--out", str(run)]) == 0
            made[name] = run
        return made[name]

    return get


def _scaletrain_logits(run: Path, tmp_path: Path, *overrides: str) -> np.ndarray:
    np.save(tmp_path / "tokens.npy", TOKENS)
    sets = [a for o in ("model.dtype=float32", *overrides) for a in ("--set", o)]
    assert main(["logits", "--run-dir", str(run), "--tokens", str(tmp_path / "tokens.npy"), "--out",
                 str(tmp_path / "logits.npy"), *sets]) == 0
    return np.load(tmp_path / "logits.npy")


def _model_keys(run: Path) -> dict:
    return inference.load_config(str(run)).model.to_dict()


def test_the_conversion_reads_every_option(converted):
    gemma3, gemma2 = _model_keys(converted("gemma3")), _model_keys(converted("gemma2"))
    assert gemma3 | {} == gemma3 and {
        "family": "gemma", "sliding_window": 6, "layer_types": "sliding,sliding,full", "rope_theta": 1e6,
        "rope_scaling": "linear", "rope_scaling_factor": 8.0, "rope_local_theta": 1e4, "qk_norm": True,
        "norm_plus_one": True, "embed_scale": True, "query_pre_attn_scalar": 24, "mlp_activation": "gelu_tanh",
        "attn_logit_softcap": 0.0, "final_logit_softcap": 2.0, "tie_embeddings": True}.items() <= gemma3.items()
    assert {"layer_types": "sliding,full", "attn_logit_softcap": 1.5, "qk_norm": False, "rope_local_theta": 0.0,
            "tie_embeddings": False}.items() <= gemma2.items()


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("attention", ["xla", "flash"])
def test_logits_equal_transformers(name, attention, converted, source, tmp_path):
    _assert_close(_scaletrain_logits(converted(name), tmp_path, f"model.attention={attention}"), source(name)[1])


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("kept", [True, False])
def test_round_trip_is_bit_exact_and_loads_in_transformers(name, kept, converted, source, tmp_path):
    """To HF with the config.json kept from the conversion, or built from config.yaml (a run trained here)."""
    folder, logits = source(name)
    run = converted(name)
    if not kept:
        run = tmp_path / "run"
        shutil.copytree(converted(name), run, ignore=shutil.ignore_patterns(hf.HF_CONFIG))
    out = tmp_path / "out"
    assert main(["convert", "to-hf", "--run-dir", str(run), "--out", str(out)]) == 0
    _assert_same_tensors(out, folder)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    if kept:
        assert (out / "config.json").read_bytes() == (folder / "config.json").read_bytes()
        np.testing.assert_array_equal(_logits(loaded), logits)
    else:
        assert json.loads((out / "config.json").read_text())["architectures"] == [type(loaded).__name__]
        _assert_close(_logits(loaded), logits)


def test_greedy_generate_is_the_argmax_of_the_logits(converted):
    """Gemma 3 decoding past its window through the KV cache, every layer kind's mask and RoPE in play."""
    cfg = inference.load_config(str(converted("gemma3")), ["model.dtype=float32"])
    _, params = init_from.restore_run_params(str(converted("gemma3")), inference.one_device_setup(cfg), "test")
    graphdef = model_lib.abstract(model_lib.ModelConfig.from_config(cfg.model))[0]
    prompt, new = jnp.asarray(TOKENS[1:, :5], jnp.int32), 10  # past the window of 6
    tokens, _ = generate_tokens(graphdef, params, prompt, jax.random.PRNGKey(0), -1, new, 0.0, 1.0)
    sequence = jnp.concatenate([prompt, tokens], axis=1)
    logits = nnx.merge(graphdef, params)(sequence, jnp.arange(sequence.shape[1])[None], jnp.ones_like(sequence))
    expected = np.asarray(logits[0, prompt.shape[1] - 1: -1].argmax(-1))
    np.testing.assert_array_equal(np.asarray(tokens[0]), expected)
    assert len(set(expected.tolist())) > 1


STEPS = 4
# Gemma's pieces on the tiny model (tests/conftest.py's): sliding and full layers with a window shorter than the
# sequence, RoPE per layer kind, soft caps, (1 + w) gains, GeGLU, a query scalar other than head_dim. Not the
# scaled embedding: an elementwise factor the mesh cannot split differently, which at this size amplifies the
# batch sum's order (a data=8 split alone moves the parameters by 2.2e-5 in norm after 4 steps).
GEMMA2 = ["model.family=gemma", "model.sliding_window=8", "model.layer_types=sliding,full",
          "model.norm_plus_one=true", "model.mlp_activation=gelu_tanh",
          "model.query_pre_attn_scalar=24", "model.attn_logit_softcap=1.5", "model.final_logit_softcap=3.0",
          "model.rope_local_theta=1000.0"]
MESHES = {
    "fsdp=8": ["mesh.fsdp=8"],
    "fsdp=4 x tensor=2": ["mesh.fsdp=4", "mesh.tensor=2"],
    "context=2 x fsdp=4, allgather": ["mesh.context=2", "mesh.fsdp=4"],
    "pipeline=2 x fsdp=4, gpipe": ["mesh.pipeline=2", "mesh.fsdp=4", "pipeline.microbatches=2"],
}


@pytest.fixture(scope="module")
def batches():
    from scaletrain.data import loader as data

    it = data.BatchIterator(data.make_dataset(config_lib.load(None, ["data.seq_len=32"])), global_batch=8)
    return [next(it) for _ in range(STEPS)]


@pytest.mark.parametrize("mesh", MESHES)
def test_a_mesh_trains_like_one_device(mesh, batches):
    """4 updates: loss, gradient norm, parameters and Adam's moment within 1e-5 of one device's."""
    equivalence.assert_same(equivalence.run(batches, *GEMMA2, *MESHES[mesh]), equivalence.reference(batches, *GEMMA2))


def test_the_tiny_config_trains_on_its_own_keys():
    cfg = config_lib.load("configs/gemma3_tiny.yaml")
    assert cfg.model.family == "gemma" and cfg.model.layer_types.count("sliding") == 5


@pytest.mark.parametrize("overrides, says", [
    (["model.norm_plus_one=true", "model.norm_weights=folded"], "use model.norm_weights=standard"),
    (["model.mlp_activation=gelu_tanh", "model.num_experts=4"], "the experts compute SwiGLU"),
    (["model.rope_local_theta=10000"], "no layer slides"),
    (["model.mlp_activation=relu"], "model.mlp_activation must be one of"),
    (["model.attn_logit_softcap=-1"], "must be >= 0"),
])
def test_a_bad_gemma_config_is_one_error(overrides, says):
    with pytest.raises(ConfigError, match=says):
        config_lib.load(None, overrides)


def test_a_model_gemma_cannot_hold_is_refused(converted, source, tmp_path, capsys):
    """Import: a config key the model lacks; export: a run whose model neither Gemma architecture represents."""
    folder = tmp_path / "bidirectional"
    shutil.copytree(source("gemma3")[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"use_bidirectional_attention": True}))
    assert main(["convert", "from-hf", "--hf-dir", str(folder), "--out", str(tmp_path / "run")]) == 2
    assert "use_bidirectional_attention=true is not supported" in capsys.readouterr().err
    cfg = config_lib.load(None, ["model.family=gemma", "model.qk_norm=true", "model.norm_plus_one=true",
                                 "model.embed_scale=true", "model.mlp_activation=gelu_tanh",
                                 "model.attn_logit_softcap=50", "model.qk_norm_eps=1e-5"])
    with pytest.raises(UserError, match="Gemma 3's attention has none"):
        hf.hf_config(cfg.model)
    llama = config_lib.load(None, ["model.norm_plus_one=true", "model.final_logit_softcap=30"])
    with pytest.raises(UserError, match="LlamaForCausalLM cannot represent model.norm_plus_one=True, "
                                        "model.final_logit_softcap=30.0"):
        hf.hf_config(llama.model)


def test_splash_with_a_window_and_a_soft_cap_compiles_for_tpu():
    """Forward and backward of Gemma 3 27B's sliding layer attention on one v5p chip (4096 tokens, window 1024, 32
    query heads sharing 16 kv heads of 128, bf16) with Gemma 2's soft cap, through Mosaic (not interpreted)."""
    from scaletrain.kernels import flash_attention as fa
    from tests.test_flash_attention import tpu_operands

    kernel, shapes, segments = tpu_operands("v5p:2x2x1", 4096, 32, 16)

    def step(q, k, v, seg):
        out, vjp = jax.vjp(lambda q, k, v: fa.flash_attention(q, k, v, seg, kernel, 1024, 50.0), q, k, v)
        return out, vjp(out)

    assert jax.jit(step).lower(*shapes, segments).compile().as_text().count("tpu_custom_call") >= 3
