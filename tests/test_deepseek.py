"""DeepSeek-V3 (models/deepseek) against transformers' DeepseekV3ForCausalLM, on a tiny random model with every option
on: a query latent (q_lora_rank > 0), expert groups, sigmoid scores with the selection bias, shared experts, a dense
first layer, YaRN (an attention factor on cos/sin and the magnitude in the softmax scale), interleaved RoPE. Its
logits equal transformers' (float32) through XLA's attention and the flash kernel; HF -> scaletrain -> HF is
bit-exact (a multi-token prediction tensor its config.json does not name skipped, as transformers skips it; the MTP
layer imported: tests/test_mtp.py) and the config built for export reads back into transformers with the same logits;
block-FP8 weights are dequantized on import; greedy decoding through the KV cache is the argmax of the full forward
pass; the router bias moves by exactly model.router_bias_update_rate's rule and by nothing else; 4 updates on meshes
of 8 devices (fsdp x tensor x expert 2; expert 4 x 2 pipeline stages in tests/test_mtp.py) equal one device.

The transformers model is built and converted once (module-scoped fixtures)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from scaletrain import config as config_lib
from scaletrain import models as model_lib
from scaletrain.__main__ import main
from scaletrain.config import MESH_AXES
from scaletrain.errors import ConfigError, UserError
from scaletrain.models.deepseek import hf as deepseek_hf
from scaletrain.tools import hf
from scaletrain.tools.generate import generate_tokens
from scaletrain.train import layout
from tests import equivalence

STEPS = 4
VOCAB = 320  # the byte tokenizer's ids fit: config.yaml names it for a model without a tokenizer
HF_KEYS = dict(
    vocab_size=VOCAB, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8, routed_scaling_factor=2.5,
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4,
    topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1, norm_topk_prob=True, rope_interleave=True,
    max_position_embeddings=256, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                         beta_fast=32, beta_slow=1, mscale=0.8, mscale_all_dim=1.0))
TOKENS = np.random.RandomState(0).randint(0, VOCAB, (2, 16))
# A multi-token prediction layer's tensor (num_hidden_layers = 3) in a checkpoint whose config.json names none
# (num_nextn_predict_layers 0; transformers' config says 1 by default, and drops the layer when it saves).
MTP_TENSOR = "model.layers.3.eh_proj.weight"


def _logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float().numpy()


def randomised(model):
    """`model` with every weight far from its initialisation, norms and selection biases included."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.1 * torch.randn_like(p))
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8))
    return model


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(a tiny random DeepseekV3ForCausalLM's folder, with an MTP tensor added, and its float32 logits)."""
    torch.manual_seed(0)
    model = randomised(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF_KEYS)).float().eval())
    folder = tmp_path_factory.mktemp("deepseek") / "hf"
    model.save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    save_file(weights | {MTP_TENSOR: np.ones((48, 96), np.float32)}, folder / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 0}))
    return folder, _logits(model)


@pytest.fixture(scope="module")
def converted(source):
    run = source[0].parent / "run"
    assert main(["convert", "from-hf", "--hf-dir", str(source[0]), "--out", str(run)]) == 0
    return run


def _scaletrain_logits(run, tmp_path, *overrides) -> np.ndarray:
    np.save(tmp_path / "tokens.npy", TOKENS)
    sets = [a for o in ("model.dtype=float32", *overrides) for a in ("--set", o)]
    assert main(["logits", "--run-dir", str(run), "--tokens", str(tmp_path / "tokens.npy"), "--out",
                 str(tmp_path / "logits.npy"), *sets]) == 0
    return np.load(tmp_path / "logits.npy")


def test_config_reads_every_option(converted):
    m = config_lib.load(converted / "config.yaml").model
    assert (m.family, m.kv_lora_rank, m.q_lora_rank, m.head_dim, m.rope_head_dim, m.v_head_dim) == (
        "deepseek", 16, 24, 24, 8, 12)
    assert (m.router_score, m.router_groups, m.router_topk_groups, m.router_scale, m.shared_experts,
            m.first_dense_layers, m.router_correction_bias, m.rope_interleave, m.rope_softmax_mscale) == (
        "sigmoid", 4, 2, 2.5, 2, 1, True, True, True)
    assert (m.rope_scaling, m.rope_mscale, m.rope_mscale_all_dim) == ("yarn", 0.8, 1.0)


@pytest.mark.parametrize("attention", ["xla", "flash"])
def test_logits_equal_transformers(source, converted, tmp_path, attention):
    want = source[1]
    got = _scaletrain_logits(converted, tmp_path, f"model.attention={attention}")
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_interleaved_rope_is_a_weight_permutation():
    """Hugging Face's pairs (2i, 2i + 1) rotated are scaletrain's split halves rotated after the permutation;
    to_hf undoes it exactly."""
    m = config_lib.load(None, ["model.family=deepseek", "model.num_experts=4", "model.kv_lora_rank=8",
                               "model.num_kv_heads=4", "model.rope_head_dim=8", "model.rope_interleave=true"]).model
    x = np.random.RandomState(1).randn(4, 2, 32).astype(np.float32)
    ours = deepseek_hf.permute(m, ("layers", "attn", "wq_b"), x, to_hf=False)
    np.testing.assert_array_equal(ours[..., :24], x[..., :24])
    np.testing.assert_array_equal(ours[..., 24:], x[..., [24, 26, 28, 30, 25, 27, 29, 31]])
    np.testing.assert_array_equal(deepseek_hf.permute(m, ("layers", "attn", "wq_b"), ours, to_hf=True), x)
    np.testing.assert_array_equal(deepseek_hf.permute(m, ("layers", "attn", "wo"), x, to_hf=False), x)


def test_to_hf_round_trip_is_bit_exact(source, converted, tmp_path):
    out = tmp_path / "back"
    assert main(["convert", "to-hf", "--run-dir", str(converted), "--out", str(out)]) == 0
    original, back = load_file(source[0] / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(original) - set(back) == {MTP_TENSOR} and set(back) <= set(original)
    for name, array in back.items():
        np.testing.assert_array_equal(array, original[name], err_msg=name)
    # The config built from the run's keys (not the one kept from the conversion) reads back the same model.
    built = hf.hf_config(config_lib.load(converted / "config.yaml").model)
    assert hf.model_keys(built, "built") == hf.model_keys(json.loads((source[0] / "config.json").read_text()), "x") \
        | {"rope_truncate": True}
    (out / "config.json").write_text(json.dumps(built))
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    np.testing.assert_allclose(_logits(model), source[1], rtol=0, atol=1e-6 * np.abs(source[1]).max())


def test_block_fp8_weights_are_dequantized(source, tmp_path):
    """A checkpoint of float8_e4m3 weights with a float32 weight_scale_inv per 128 x 128 block (DeepSeek-V3's hub
    files) reads as the weights times their blocks' scales."""
    from safetensors.torch import save_file as save_torch

    folder = tmp_path / "fp8"
    folder.mkdir()
    weights = {n: torch.from_numpy(w) for n, w in load_file(source[0] / "model.safetensors").items()}
    name = "model.layers.0.mlp.gate_proj.weight"  # [80, 48]: one block
    big = "model.embed_tokens.weight"  # [320, 48]: three blocks down
    fp8 = {n: weights[n].to(torch.float8_e4m3fn) for n in (name, big)}
    scales = {name: torch.tensor([[0.5]]), big: torch.tensor([[2.0], [0.25], [4.0]])}
    save_torch(weights | fp8 | {n + "_scale_inv": s for n, s in scales.items()}, folder / "model.safetensors",
               metadata={"format": "pt"})
    (folder / "config.json").write_text((source[0] / "config.json").read_text())
    assert main(["convert", "from-hf", "--hf-dir", str(folder), "--out", str(tmp_path / "run")]) == 0
    assert main(["convert", "to-hf", "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "back")]) == 0
    back = load_file(tmp_path / "back" / "model.safetensors")
    np.testing.assert_array_equal(back[name], fp8[name].float().numpy() * 0.5)
    rows = np.repeat(scales[big].numpy()[:, 0], 128)[:320, None]
    np.testing.assert_array_equal(back[big], fp8[big].float().numpy() * rows)


def test_greedy_decoding_is_the_argmax_of_the_forward_pass(converted):
    m = config_lib.load(converted / "config.yaml").model
    cfg = model_lib.ModelConfig.from_config(m, dtype=jnp.float32, init_std=0.3)
    graphdef = model_lib.abstract(cfg)[0]
    params = model_lib.init_params(cfg, jax.random.PRNGKey(0))
    routed = params["layers"]["mlp"]["routed"]
    routed["router_bias"] = 0.3 * jax.random.normal(jax.random.PRNGKey(1), routed["router_bias"].shape)
    prompt = jnp.asarray(TOKENS[:1, :6])
    tokens, n = generate_tokens(graphdef, params, prompt, jax.random.PRNGKey(0), -1, 10, 0.0, 1.0)
    sequence = jnp.concatenate([prompt, tokens], axis=1)
    logits = nnx.merge(graphdef, params)(sequence, jnp.arange(16)[None], jnp.ones_like(sequence))
    expected = np.asarray(logits[0, 5:-1].argmax(-1))
    np.testing.assert_array_equal(np.asarray(tokens[0]), expected)
    assert int(n[0]) == 10 and len(set(expected.tolist())) > 1


def test_routing_by_hand():
    """Sigmoid scores; a token keeps its best 2 of 4 groups, each scored by the sum of its top two biased scores;
    the bias decides the choice (expert 5's 0.55 + 0.1 over expert 4's 0.6), never the weights - the unbiased
    scores renormalised, times the scale; the balance statistics read the scores normalised over the experts (so
    router_aux_loss is DeepSeek's sequence-wise balance loss)."""
    from scaletrain.models.routing import Routing

    scores = np.array([0.9, 0.1, 0.8, 0.05, 0.6, 0.55, 0.2, 0.2])
    logits = jnp.log(scores / (1 - scores))[None]  # sigmoid(logits) = scores
    bias = jnp.array([0, 0, 0, 0, 0, 0.1, 0, 0])
    routing = Routing("sigmoid", groups=4, topk_groups=2, scale=2.0, norm_topk=True)
    top_e, weights, probs = routing.select(logits, 2, bias)
    # groups (top-2 sums, biased): {0,1} 1.0, {2,3} 0.85, {4,5} 1.25, {6,7} 0.4 -> groups 2 and 0, so not
    # expert 2 (0.8), which a plain top 2 would take
    assert sorted(np.asarray(top_e[0]).tolist()) == [0, 5]
    np.testing.assert_allclose(np.asarray(weights[0])[np.argsort(np.asarray(top_e[0]))],
                               2.0 * np.array([0.9, 0.55]) / 1.45, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(probs[0]), scores / scores.sum(), rtol=1e-6)


# --- training: the router bias and meshes ------------------------------------------------------------------------

DEEPSEEK = ["model.family=deepseek", "model.num_layers=3", "model.num_kv_heads=4", "model.head_dim=24",
            "model.rope_head_dim=8", "model.v_head_dim=16", "model.q_lora_rank=16", "model.kv_lora_rank=16",
            "model.first_dense_layers=1", "model.num_experts=8", "model.experts_per_token=2", "model.moe_d_ff=32",
            "model.shared_experts=1", "model.router_score=sigmoid", "model.router_groups=4",
            "model.router_topk_groups=2", "model.router_scale=2.5", "model.router_correction_bias=true",
            "model.router_bias_update_rate=0.01", "model.rope_scaling=yarn", "model.rope_scaling_factor=4",
            "model.rope_original_max_position=16", "model.rope_mscale=1", "model.rope_mscale_all_dim=1",
            "model.rope_softmax_mscale=true",
            # Some of the latent attention's output weights get gradients near Adam's default eps (1e-8) at step 1,
            # where the update g / (|g| + eps) turns rounding-level differences into 4e-5 relative ones.
            "optim.eps=1e-6"]


@pytest.fixture(scope="module")
@equivalence.computed_once
def reference(batches):
    return equivalence.reference(batches, *DEEPSEEK)


def test_router_bias_update_is_its_rule():
    """after_update moves each mixture's bias by rate x sign(mean load - load), centred, with the loads of the
    step's layers in canonical order read through the stack's memory order; nothing when the update was dropped."""
    cfg = model_lib.ModelConfig.from_config(equivalence.load_config(1, *DEEPSEEK).model)
    model = nnx.eval_shape(lambda: model_lib.FAMILIES["deepseek"].decoder(cfg, nnx.Rngs(0)))
    load = jnp.array([[5.0, 1, 3, 3, 0, 2, 4, 6], [3, 3, 3, 3, 3, 3, 3, 3]])  # means 3: ties move nothing
    bias = jnp.arange(16.0).reshape(2, 8)
    params = {"layers": {"mlp": {"routed": {"router_bias": bias, "router": 7}, "shared": 8}, "attn": 9}, "embed": 1}
    aux = {"router": {"load": load}}
    sign = np.array([[-1, 1, 0, 0, 1, 1, -1, -1], [0] * 8])
    want = bias + 0.01 * (sign - sign.mean(-1, keepdims=True))
    moved = model.after_update(params, aux, jnp.bool_(True))
    np.testing.assert_allclose(moved["layers"]["mlp"]["routed"]["router_bias"], want, rtol=0, atol=1e-7)
    assert moved["layers"]["mlp"]["routed"]["router"] == 7 and moved["layers"]["attn"] == 9 and moved["embed"] == 1
    swapped = model.after_update(params, aux, jnp.bool_(True), np.array([1, 0]))  # the stack kept reversed
    np.testing.assert_allclose(swapped["layers"]["mlp"]["routed"]["router_bias"], bias + (want - bias)[::-1],
                               atol=1e-7)
    kept = model.after_update(params, aux, jnp.bool_(False))
    np.testing.assert_array_equal(kept["layers"]["mlp"]["routed"]["router_bias"], bias)


def test_training_moves_the_router_bias_by_the_rule_alone(reference):
    """After 4 updates of a run (weight decay 0.1, learning rate > 0) each bias is a sum of 4 centred steps of
    rate x {-1, 0, 1} (so a multiple of rate / experts, summing to 0 per layer): Adam's moments of it stay 0
    (no gradient) and weight decay leaves it alone."""
    bias = reference.params["layers"]["mlp"]["routed"]["router_bias"]
    units = bias * 8 / 0.01
    np.testing.assert_allclose(units, np.round(units), atol=1e-3)
    assert np.any(bias != 0) and np.all(np.abs(bias) <= 4 * 0.01 * 2 * 7 / 8 + 1e-6)  # sign - mean(sign)
    np.testing.assert_allclose(bias.sum(-1), 0, atol=1e-7)
    assert np.all(reference.mu["layers"]["mlp"]["routed"]["router_bias"] == 0)


def test_a_mesh_trains_like_one_device(batches, reference):
    """fsdp 2 x tensor 2 x expert 2; expert 4 x 2 pipeline stages with the multi-token prediction modules on:
    tests/test_mtp.py."""
    equivalence.assert_same(equivalence.run(batches, *DEEPSEEK, "mesh.fsdp=2", "mesh.tensor=2", "mesh.expert=2"),
                            reference)


def test_fsdp_splits_every_weight_matrix():
    """Latent attention's expansions (wq_b, wkv_b) have no `embed` dim: FSDP splits their latent instead, or every
    device would keep them whole (12 GiB a chip at DeepSeek-V3 671B)."""
    cfg = config_lib.load(None, [*DEEPSEEK, "mesh.fsdp=8"])
    axes = {a: getattr(cfg.mesh, a) for a in MESH_AXES}
    lay = layout.of(cfg, axes)
    params = lay.shardings(layout.abstract_mesh(axes))[0]
    matrices = [(jax.tree_util.keystr(path), s.spec) for path, s in jax.tree_util.tree_flatten_with_path(params)[0]
                if len(s.spec) - ("layers" in jax.tree_util.keystr(path)) >= 2]
    assert any("wkv_b" in p for p, _ in matrices)
    assert [(p, spec) for p, spec in matrices if "fsdp" not in jax.tree.leaves(tuple(spec))] == []


@pytest.mark.parametrize("overrides, message", [
    (["model.family=deepseek", "model.num_experts=4"], "model.family=deepseek attends through latents"),
    (["model.kv_lora_rank=8", "model.rope_head_dim=8", "model.head_dim=8"], "rope_head_dim=8 must be even, > 0 and <"),
    (["model.kv_lora_rank=8", "model.rope_head_dim=8"], "must equal model.num_heads"),
    (["model.num_experts=6", "model.router_groups=4"], "divisible by model.router_groups"),
    (["model.num_experts=8", "model.router_groups=4", "model.router_topk_groups=1", "model.experts_per_token=3"],
     "exceeds the experts"),
    (["model.router_bias_update_rate=0.001"], "needs model.router_correction_bias=true"),
    (["model.first_dense_layers=1"], "needs a mixture of experts"),
])
def test_bad_combinations_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_lib.load(None, overrides)


def test_unrepresentable_hf_configs_are_refused(source):
    base = json.loads((source[0] / "config.json").read_text())
    for key, value in (("scoring_func", "softmax"), ("topk_method", "greedy"), ("index_topk", 2048)):
        with pytest.raises(UserError, match=f"{key}={value}|DeepSeek-V3.2's sparse attention indexer"):
            hf.model_keys(base | {key: value}, "config.json")
