"""GPT-OSS (the gpt_oss family, docs/gpt-oss.md) against transformers and against one device.

A tiny random GptOssForCausalLM with every piece non-trivial - attention sinks, Q/K/V/O biases, the router's logit
bias, expert biases, the clamped SwiGLU with a limit the activations cross, sliding layers (a window of 4 in a
sequence of 16) between full ones, YaRN without truncation - is converted through the command line:
its logits equal transformers' (float32, 1e-5 relative) with XLA's attention and with the flash kernel (splash,
interpreted), and to-hf gives back the same bytes. The sink's gradient through splash equals XLA's autodiff of the
plain softmax with a sink column; greedy generation is the argmax of the forward pass; MXFP4 dequantization equals
transformers' own; four updates on meshes of 8 CPU devices (fsdp x tensor x expert 2 with blocked attention,
expert 4 x context 2 on the ring, 2 GPipe stages x fsdp x expert 2) equal one device; the planner counts the
biases apart from the weights; what scaletrain cannot represent is one `error:` line."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from scaletrain import config
from scaletrain import models as model_lib
from scaletrain.__main__ import main
from scaletrain.errors import UserError
from scaletrain.facts import flops
from scaletrain.kernels import flash_attention
from scaletrain.models.attention import block_mask, dot_attention
from scaletrain.tools import hf, hf_mxfp4
from scaletrain.tools.generate import generate_tokens
from tests import equivalence

STEPS = 4
VOCAB = 320
HF = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
          layer_types=["sliding_attention", "full_attention"], sliding_window=4,
          rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                           "original_max_position_embeddings": 64, "rope_theta": 150000.0},
          swiglu_limit=0.5, swiglu_alpha=1.702)
TOKENS = np.random.RandomState(0).randint(0, VOCAB, (2, 16))
# The model.* keys of a GPT-OSS model (what from-hf sets), for the tests that build one without transformers.
FEATURES = ["model.family=gpt_oss", "model.attention_sinks=true", "model.attention_bias=true",
            "model.router_logit_bias=true", "model.expert_bias=true", "model.expert_activation=clamped_swiglu",
            "model.swiglu_limit=0.5", "model.num_experts=4", "model.experts_per_token=2", "model.moe_d_ff=32"]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, np.ndarray]:
    """A random GptOssForCausalLM's folder and transformers' float32 logits of TOKENS. Weights far from their
    initialisation (gains and biases around 1, sinks among them), so that a swapped or transposed tensor shows."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**HF), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.1 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("gpt_oss") / "hf"
    model.eval().save_pretrained(folder)
    with torch.no_grad():
        return folder, model(torch.tensor(TOKENS)).logits.numpy()


@pytest.fixture(scope="module")
def converted(source) -> Path:
    run = source[0].parent / "run"
    assert main(["convert", "from-hf", "--hf-dir", str(source[0]), "--out", str(run)]) == 0
    return run


@pytest.mark.parametrize("attention", ["xla", "flash"])
def test_logits_equal_transformers(attention, source, converted, tmp_path):
    np.save(tmp_path / "tokens.npy", TOKENS)
    assert main(["logits", "--run-dir", str(converted), "--tokens", str(tmp_path / "tokens.npy"), "--out",
                 str(tmp_path / "logits.npy"), "--set", "model.dtype=float32", "--set",
                 f"model.attention={attention}"]) == 0
    got, want = np.load(tmp_path / "logits.npy"), source[1]
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), np.abs(got - want).max()


def test_round_trip_is_bit_exact(source, converted, tmp_path):
    out = tmp_path / "out"
    assert main(["convert", "to-hf", "--run-dir", str(converted), "--out", str(out)]) == 0
    got, want = load_file(out / "model.safetensors"), load_file(source[0] / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].tobytes() == want[name].tobytes(), name


def test_a_config_built_from_the_run_loads_in_transformers(converted, tmp_path):
    """Without the kept config.json, to-hf builds one: transformers reads it as the same model (its layer kinds
    and window, YaRN untruncated, biases on)."""
    (converted / "hf" / "config.json").rename(tmp_path / "kept.json")
    try:
        assert main(["convert", "to-hf", "--run-dir", str(converted), "--out", str(tmp_path / "out")]) == 0
    finally:
        (tmp_path / "kept.json").rename(converted / "hf" / "config.json")
    built = json.loads((tmp_path / "out" / "config.json").read_text())
    assert built["architectures"] == ["GptOssForCausalLM"] and built["swiglu_limit"] == 0.5
    loaded = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert loaded.layer_types == HF["layer_types"] and loaded.sliding_window == 4
    assert {k: loaded.rope_parameters[k] for k in HF["rope_parameters"]} == HF["rope_parameters"]


def _refused(tmp_path, source, capsys, **changes) -> str:
    folder = tmp_path / "changed"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((source[0] / "model.safetensors").read_bytes())
    hf = json.loads((source[0] / "config.json").read_text()) | changes
    (folder / "config.json").write_text(json.dumps(hf))
    assert main(["convert", "from-hf", "--hf-dir", str(folder), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1
    return err


@pytest.mark.parametrize("changes, message", [
    (dict(layer_types=["chunked_attention", "full_attention"]), "layer_types chunked_attention"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 150000.0}), "rope_type dynamic"),
    (dict(attention_bias=False), "attention_bias=false"),
    (dict(quantization_config={"quant_method": "bitsandbytes"}), "quant_method bitsandbytes"),
])
def test_what_scaletrain_cannot_represent_is_one_error_line(changes, message, tmp_path, source, capsys):
    assert message in _refused(tmp_path, source, capsys, **changes)


def test_mxfp4_experts_are_dequantized_as_transformers_does(source, converted, tmp_path):
    """hf_mxfp4 against transformers' convert_moe_packed_tensors on random codes and scales; and a checkpoint whose
    experts are stored so converts to the weights they stand for."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.RandomState(1)
    blocks = rng.randint(0, 256, (4, 64, 2, 16)).astype(np.uint8)  # [E, 2f, d / 32, 16] for d 64, f 32
    scales = rng.randint(120, 132, (4, 64, 2)).astype(np.uint8)
    want = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32).numpy()
    got = hf_mxfp4.dequantize(blocks, scales)
    assert got.shape == hf_mxfp4.shape(blocks.shape) == (4, 64, 64)
    np.testing.assert_array_equal(got, want)

    tensors = load_file(source[0] / "model.safetensors")
    for i in range(HF["num_hidden_layers"]):  # layer i's gate_up_proj replaced by these codes
        name = f"model.layers.{i}.mlp.experts.gate_up_proj"
        del tensors[name]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    folder = tmp_path / "mxfp4"
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    hf = json.loads((source[0] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(hf | {"quantization_config": {"quant_method": "mxfp4"}}))
    assert main(["convert", "from-hf", "--hf-dir", str(folder), "--out", str(tmp_path / "run")]) == 0
    assert main(["convert", "to-hf", "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    exported = load_file(tmp_path / "out" / "model.safetensors")
    np.testing.assert_array_equal(exported["model.layers.1.mlp.experts.gate_up_proj"], want)
    # written unquantized, the config says so: transformers loads it as it is
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)


def test_sink_gradient_through_splash_equals_autodiff_of_the_plain_softmax():
    """Splash (interpreted) with sinks folded in by its log-sum-exp and its own backward kernels, against XLA's
    autodiff of softmax over the scores and a sink column: output and the gradients of q, k, v and the sinks, over
    two documents."""
    b, t, n, kv, h = 1, 40, 4, 2, 16
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    q, k, v = (jax.random.normal(key, (b, t, heads, h)) for key, heads in zip(keys, (n, kv, kv)))
    sinks = 2.0 * jax.random.normal(keys[3], (n,))
    d_out = jax.random.normal(keys[4], (b, t, n, h))
    segments = jnp.asarray([[1] * 25 + [2] * 15])

    def plain(q, k, v, sinks):
        mask = block_mask(segments, segments, jnp.arange(t), jnp.arange(t))
        out = dot_attention(q.reshape(b, t, kv, n // kv, h), k, v, mask, sinks_kg=sinks.reshape(kv, -1))
        return out.reshape(q.shape)

    def flash(q, k, v, sinks):
        return flash_attention.flash_attention(q, k, v, segments, flash_attention.INTERPRETED, sinks_n=sinks)

    outs, grads = [], []
    for fn in (plain, flash):
        out, vjp = jax.vjp(fn, q, k, v, sinks)
        outs.append(out)
        grads.append(vjp(d_out))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for name, got, want in zip("qkv", grads[1][:3], grads[0][:3]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(grads[1][3], grads[0][3], rtol=1e-4, atol=1e-5, err_msg="sinks")
    assert np.abs(grads[0][3]).min() > 1e-3  # every head's sink takes a share


def test_greedy_generation_is_the_argmax_of_the_forward_pass():
    """The KV-cached decode (with sinks, biases and a sliding layer) against the full forward pass, token by
    token."""
    model = config.load(None, [*FEATURES, "model.sliding_window=4", "model.layer_types=sliding,full"]).model
    cfg = model_lib.ModelConfig.from_config(model, vocab_size=VOCAB, d_model=64, num_layers=2, num_heads=4,
                                            num_kv_heads=2, head_dim=16, d_ff=32, dtype=jnp.float32)
    graphdef, shapes, _ = model_lib.abstract(cfg)
    # Random values from the shapes (init would compile a program of its own): large weights make the logits
    # decisive, so no near-tie can flip an argmax between the two paths; gains around 1, biases and sinks too.
    rng = np.random.RandomState(1)
    params = jax.tree_util.tree_map_with_path(lambda path, x: jnp.asarray(
        (1 + 0.1 * rng.normal(size=x.shape)) if path[-1].key == "scale" else 0.3 * rng.normal(size=x.shape), x.dtype),
        shapes)
    prompt = jnp.asarray(TOKENS[:1, :6], jnp.int32)
    generate = jax.jit(generate_tokens, static_argnums=(0, 4, 5, 6, 7))  # one program, not op by op
    tokens, n = generate(graphdef, params, prompt, jax.random.PRNGKey(0), -1, 10, 0.0, 1.0)
    sequence = jnp.concatenate([prompt, tokens], axis=1)
    positions = jnp.arange(sequence.shape[1])[None]
    logits = jax.jit(lambda p, *a: nnx.merge(graphdef, p)(*a))(params, sequence, positions, jnp.ones_like(sequence))
    expected = np.asarray(logits[0, prompt.shape[1] - 1:-1].argmax(-1))
    np.testing.assert_array_equal(np.asarray(tokens[0]), expected)
    assert int(n[0]) == 10 and len(set(expected.tolist())) > 1


@pytest.fixture(scope="module")
@equivalence.computed_once
def reference(batches):
    return equivalence.reference(batches, *FEATURES)


MESHES = {  # each axis in one of them, three compiles
    "fsdp=2 x tensor=2 x expert=2, blocked attention": ["mesh.fsdp=2", "mesh.tensor=2", "mesh.expert=2",
                                                        "model.attention_block=16"],
    "expert=4 x context=2 ring": ["mesh.expert=4", "mesh.context=2", "model.context_attention=ring"],
    "pipeline=2 gpipe x fsdp=2 x expert=2": ["mesh.pipeline=2", "mesh.fsdp=2", "mesh.expert=2",
                                             "pipeline.schedule=gpipe"],
}


@pytest.mark.parametrize("mesh", MESHES.values(), ids=MESHES.keys())
def test_training_on_a_mesh_equals_one_device(batches, reference, mesh):
    """Four updates (the biases and sinks start at 0 and move from the first): losses, gradient norms,
    parameters and Adam's first moment."""
    run = equivalence.run(batches, *FEATURES, *mesh)
    equivalence.assert_same(run, reference)
    assert np.abs(run.params["layers"]["attn"]["sinks"]).min() > 0


def test_the_planner_counts_biases_and_sinks_apart_from_the_weights():
    """Every bias and sink is a parameter (in the total, the memory) that no matmul multiplies: the matmul
    weights - the planner's FLOPs - are those of the same model without them; of the experts' biases a token uses
    k of E."""
    def count(*overrides):
        return flops.param_count(model_lib.ModelConfig.from_config(config.load(None, list(overrides)).model))

    plain = ["model.family=gpt_oss", "model.num_experts=4", "model.experts_per_token=2", "model.moe_d_ff=32"]
    with_them, without = count(*FEATURES), count(*plain)
    m = config.load(None, FEATURES).model
    layer = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim + m.d_model + m.num_heads  # Q/K/V/O biases, sinks
    experts = m.num_experts * (1 + 2 * m.moe_d_ff + m.d_model)  # router bias, gate/up/down biases
    assert with_them.biases == m.num_layers * (layer + experts)
    assert with_them.total - without.total == with_them.biases
    assert with_them.matmul == without.matmul
    assert with_them.active - without.active == m.num_layers * (
        layer + m.num_experts + m.experts_per_token * (2 * m.moe_d_ff + m.d_model))


def test_a_model_with_gpt_oss_pieces_is_not_exported_as_another_architecture():
    m = config.load(None, ["model.num_experts=4", "model.attention_sinks=true"]).model  # family auto: mixtral
    with pytest.raises(UserError, match="model.attention_sinks=true: Hugging Face's MixtralForCausalLM has "
                                        "attention_sinks false"):
        hf.hf_config(m)
