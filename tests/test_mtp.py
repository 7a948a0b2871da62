"""Multi-token prediction (models/mtp.py, model.mtp_depth) on the tiny DeepSeek model of tests/test_deepseek.py.

The host's lookahead arrays are checked by hand; the step's loss and gradient equal a slow twin that runs every
packed document alone, unpadded, and shifts its tokens itself; 4 updates on 8 devices - context 2 (the zig-zag
layout, documents cut inside its chunks) x expert 2 x a GPipe pipeline of 2 stages - equal one device, the
modules' router bias moving by its rule; the combinations it cannot take are refused. A checkpoint's MTP layer
(model.layers.{num_hidden_layers}.*: enorm, hnorm, eh_proj, a decoder layer, shared_head) imports into the modules,
whose logits equal a torch twin built on transformers' own DeepseekV3DecoderLayer, and exports back bit-exact; a
checkpoint without one converts without it, and a run asking for modules its init_from lacks is refused in one line."""

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
from scaletrain.errors import ConfigError
from scaletrain.models import mtp
from scaletrain.parallel import pipeline
from scaletrain.train import step as step_lib
from scaletrain.train.runner import Runner
from tests import equivalence
from tests.test_context import _packed
from tests.test_deepseek import DEEPSEEK, HF_KEYS, TOKENS, randomised

STEPS = 4
MTP = [*DEEPSEEK, "model.mtp_depth=2", "model.mtp_loss_weight=0.3"]


def _documents(batches: list[dict]) -> list[dict]:
    """test_context's packing (four documents a row, cut inside the zig-zag's chunks), each document's last
    target out of the loss: it is the next document's first token."""
    out = []
    for batch in _packed(batches):
        last = np.zeros_like(batch["segment_ids"], bool)
        last[:, :-1] = batch["segment_ids"][:, 1:] != batch["segment_ids"][:, :-1]
        out.append({**batch, "loss_mask": np.where(last, 0, batch["loss_mask"]).astype(np.float32)})
    return out


def test_lookahead_shifts_within_each_document():
    batch = {"tokens": np.array([[10, 11, 12, 13, 14, 15]]), "targets": np.array([[11, 12, 13, 14, 15, 16]]),
             "segment_ids": np.array([[1, 1, 1, 2, 2, 2]]), "loss_mask": np.array([[1, 1, 0, 1, 1, 1]], np.float32)}
    ahead = mtp.lookahead(batch, 2)
    assert set(ahead) == set(mtp.batch_keys(2))
    np.testing.assert_array_equal(ahead["mtp1_tokens"], [[11, 12, 13, 14, 15, 0]])
    np.testing.assert_array_equal(ahead["mtp1_targets"], [[12, 13, 14, 15, 16, 0]])
    np.testing.assert_array_equal(ahead["mtp1_mask"], [[1, 0, 0, 1, 1, 0]])  # 2 -> 3 crosses; 12's target is out
    np.testing.assert_array_equal(ahead["mtp2_tokens"], [[12, 13, 14, 15, 0, 0]])
    np.testing.assert_array_equal(ahead["mtp2_targets"], [[13, 14, 15, 16, 0, 0]])
    np.testing.assert_array_equal(ahead["mtp2_mask"], [[0, 0, 0, 1, 0, 0]])
    assert ahead["mtp1_tokens"].dtype == batch["tokens"].dtype and ahead["mtp2_mask"].dtype == np.float32


def _twin_sums(graphdef, params, tokens, targets, mask, weight: float) -> tuple[jax.Array, jax.Array]:
    """The objective the slow way, for one document [1, n] run alone (positions from 0, no segment ids to mask
    with): the module k at its position i fed the document's token i + k and scored on its target i + k, where that
    target exists and is in the loss. (Its next-token losses + weight / D x its modules' summed, its targets in the
    loss): the step's loss is the sum of the first over every document over the sum of the second."""
    model = nnx.merge(graphdef, params)
    depths = model.cfg.mtp_depth
    depth_def, stacked = nnx.split(model.mtp)
    n = tokens.shape[1]
    positions, ones = jnp.arange(n)[None], jnp.ones((1, n), jnp.int32)
    x, body, layers, extras = model.stack_inputs(tokens, positions, ones)
    h = pipeline.scan(body, x, layers, extras)[0]
    ce = -jnp.take_along_axis(jax.nn.log_softmax(model.logits(model.final_stream(h))), targets[..., None], -1)
    total = jnp.sum(ce[..., 0] * mask)
    for k in range(1, min(depths, n - 1) + 1):
        module = nnx.merge(depth_def, jax.tree.map(lambda a: a[k - 1], stacked))
        sin, cos = extras[0][:, :n - k], extras[1][:, :n - k]
        h, _ = module(h[:, :n - k], model.embed(tokens[:, k:], jnp.float32), sin, cos, ones[:, :n - k])
        logits = model.logits(module.final_norm(h))
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, k:, None], -1)[..., 0]
        total += weight / depths * jnp.sum(ce * mask[:, k:])
    return total, jnp.sum(mask)


def test_loss_and_gradient_equal_a_twin_that_runs_each_document_alone(batches):
    cfg = equivalence.load_config(1, *MTP, "model.router_aux_loss=0", "model.router_z_loss=0")
    model_cfg = model_lib.ModelConfig.from_config(cfg.model, dtype=jnp.float32, init_std=0.3)
    graphdef = model_lib.abstract(model_cfg)[0]
    params = model_lib.init_params(model_cfg, jax.random.PRNGKey(0))
    # Row 3's first two documents (test_context's cuts, shifted by the row: 8 tokens each), the row cut after them.
    # Of one length, the twin's documents share one compiled program (the twin's compile is most of the test).
    row = 3
    batch = _documents(batches[:1])[0]
    end = int(np.argmax(batch["segment_ids"][row] == 3))
    batch = {k: v[row:row + 1, :end] for k, v in batch.items()}

    def ours(params):
        with_ahead = {k: jnp.asarray(v) for k, v in (batch | mtp.lookahead(batch, 2)).items()}
        total, sums = step_lib.terms(graphdef, params, with_ahead, Runner())
        return total / sums["count"], sums

    (loss, sums), grads = jax.jit(jax.value_and_grad(ours, has_aux=True))(params)
    twin = jax.jit(jax.value_and_grad(lambda p, *doc: _twin_sums(graphdef, p, *doc, 0.3), has_aux=True))
    total = count = 0.0
    want_grads = jax.tree.map(lambda p: np.zeros(p.shape, np.float64), params)
    for doc in np.unique(batch["segment_ids"][0]):
        at = np.flatnonzero(batch["segment_ids"][0] == doc)
        (doc_total, doc_count), doc_grads = twin(params, *(jnp.asarray(batch[k][:, at])
                                                           for k in ("tokens", "targets", "loss_mask")))
        total, count = total + float(doc_total), count + float(doc_count)
        want_grads = jax.tree.map(lambda a, g: a + np.asarray(g, np.float64), want_grads, doc_grads)
    want, want_grads = total / count, jax.tree.map(lambda g: g / count, want_grads)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    assert float(jnp.sum(sums["aux"]["mtp"]["loss"])) > 0 and loss > sums["loss"] / sums["count"]
    # Each gradient array within 1e-5 in norm (the documents' sums run in another order: rounding-level
    # differences in single elements, as tests/equivalence.py measures parameters).
    for (path, g), w in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(want_grads)):
        assert np.linalg.norm(g - w) <= 1e-5 * np.linalg.norm(w), jax.tree_util.keystr(path)
    assert float(jnp.max(jnp.abs(grads["mtp"]["proj"]))) > 0  # the modules learn


@pytest.fixture(scope="module")
@equivalence.computed_once
def reference(batches):
    return equivalence.reference(_documents(batches), *MTP)


# One mesh takes every axis the modules meet: context 2 (the zig-zag layout, the documents cut inside its chunks;
# the fsdp preset shards the weights' embed dimension over fsdp and context alike, so the modules' weights are
# split and gathered here as under fsdp) x expert 2 x a GPipe pipeline of 2 stages - DeepSeek's one pipeline case
# (tests/test_deepseek.py leaves it here): the dense first layer on every stage, the mixtures split, the modules
# after the pipeline.
MESH = ["mesh.context=2", "mesh.expert=2", "mesh.pipeline=2", "pipeline.schedule=gpipe"]


def test_a_mesh_trains_like_one_device(batches, reference):
    equivalence.assert_same(equivalence.run(_documents(batches), *MTP, *MESH), reference,
                            metrics=("loss", "grad_norm", "mtp_loss"))


def test_the_modules_learn_and_their_router_bias_moves_by_the_rule(reference):
    first, last = reference.metrics[0], reference.metrics[-1]
    assert last["mtp_loss"] < first["mtp_loss"] - 0.1
    bias = reference.params["mtp"]["block"]["mlp"]["routed"]["router_bias"]  # [depths, experts]
    units = bias * 8 / 0.01
    np.testing.assert_allclose(units, np.round(units), atol=1e-3)
    assert np.any(bias != 0)
    np.testing.assert_allclose(bias.sum(-1), 0, atol=1e-7)
    assert np.all(reference.mu["mtp"]["block"]["mlp"]["routed"]["router_bias"] == 0)


@pytest.mark.parametrize("overrides, message", [
    (["model.mtp_depth=1"], "built for model.family=deepseek"),
    ([*MTP, "model.mtp_loss_weight=0"], "would learn nothing"),
    ([*MTP, "lora.rank=4"], "LoRA trains without"),
    ([*MTP, "train.objective=dpo", "data.format=preference", "data.source=synthetic", "dpo.reference=precomputed"],
     "adds to the next-token loss only"),
])
def test_what_it_cannot_take_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_lib.load(None, overrides)


def test_a_pipeline_that_runs_the_head_in_its_loop_is_refused():
    from scaletrain.train import trainer

    cfg = equivalence.load_config(1, *MTP, "mesh.expert=2", "mesh.pipeline=2", "pipeline.schedule=1f1b")
    with pytest.raises(ConfigError, match="model.mtp_depth=2 with pipeline.schedule=1f1b"):
        trainer.build(cfg, jax.devices()[:4])


# --- Hugging Face's MTP layer -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(a DeepSeek-V3 checkpoint of 3 layers and one MTP layer, as the hub's are laid out, and the torch modules
    the twin runs). The MTP layer's decoder layer is the fourth layer of a 4-layer model: saved by transformers,
    its tensors have the hub's names; its embedding and head repeat the model's."""
    torch.manual_seed(0)
    four = randomised(transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**HF_KEYS | {"num_hidden_layers": 4})).float().eval())
    folder = tmp_path_factory.mktemp("mtp") / "hf"
    four.save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    norms = [transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RMSNorm(48, 1e-6) for _ in range(3)]
    eh_proj = torch.nn.Linear(96, 48, bias=False)
    with torch.no_grad():
        for module in (*norms, eh_proj):
            module.weight.copy_(1 + 0.2 * torch.randn(48) if module in norms else 0.1 * torch.randn(48, 96))
    extra = {"enorm": norms[0], "hnorm": norms[1], "shared_head.norm": norms[2], "eh_proj": eh_proj}
    weights |= {f"model.layers.3.{name}.weight": m.weight.detach().numpy() for name, m in extra.items()}
    weights |= {"model.layers.3.embed_tokens.weight": weights["model.embed_tokens.weight"],
                "model.layers.3.shared_head.head.weight": weights["lm_head.weight"]}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 3, "num_nextn_predict_layers": 1}))
    return folder, four, extra


def _torch_twin(four, extra, tokens) -> np.ndarray:
    """The MTP layer's logits as vLLM and DeepSeek define them, on transformers' modules: the main model's stream
    before its final norm (the first 3 layers of `four`), the next tokens' embedding, both normed (enorm, hnorm)
    and concatenated in that order, eh_proj, the fourth decoder layer, shared_head's norm, the shared head."""
    model = four.model
    x = torch.tensor(tokens)
    with torch.no_grad():
        h = model.embed_tokens(x)
        positions = torch.arange(x.shape[1])[None]
        mask = torch.triu(torch.full((x.shape[1], x.shape[1]), -torch.inf), 1)[None, None]
        for layer in model.layers[:3]:
            h = layer(h, attention_mask=mask, position_ids=positions,
                      position_embeddings=model.rotary_emb(h, positions))
        e = model.embed_tokens(x[:, 1:])
        y = extra["eh_proj"](torch.cat([extra["enorm"](e), extra["hnorm"](h[:, :-1])], -1))
        y = model.layers[3](y, attention_mask=mask[..., :-1, :-1], position_ids=positions[:, :-1],
                            position_embeddings=model.rotary_emb(y, positions[:, :-1]))
        return four.lm_head(extra["shared_head.norm"](y)).float().numpy()


def _scaletrain_ahead(run, tokens) -> np.ndarray:
    """The converted run's first module's logits at each position (but the last): t_{i+2} predicted."""
    from scaletrain.tools import inference
    from scaletrain.train import init_from

    cfg = config_lib.load(run / "config.yaml", ["model.dtype=float32"])
    setup = inference.one_device_setup(cfg)
    _, params = init_from.restore_run_params(str(run), setup, "test")
    graphdef = model_lib.abstract(setup.model_cfg)[0]

    @jax.jit  # one program, rather than each operation compiled on its own
    def ahead(params, t):
        model = nnx.merge(graphdef, params)
        positions, ones = jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape), jnp.ones(t.shape, jnp.int32)
        x, body, layers, extras = model.stack_inputs(t, positions, ones)
        h = pipeline.scan(body, x, layers, extras)[0]
        depth_def, stacked = nnx.split(model.mtp)
        module = nnx.merge(depth_def, jax.tree.map(lambda a: a[0], stacked))
        y, _ = module(h[:, :-1], model.embed(t[:, 1:], jnp.float32), extras[0][:, :-1], extras[1][:, :-1],
                      ones[:, :-1])
        return model.logits(module.final_norm(y))

    return np.asarray(ahead(params, jnp.asarray(tokens)))


def test_a_checkpoints_mtp_layer_imports_runs_as_transformers_layer_and_exports_bit_exact(checkpoint, tmp_path):
    folder, four, extra = checkpoint
    run = tmp_path / "run"
    assert main(["convert", "from-hf", "--hf-dir", str(folder), "--out", str(run)]) == 0
    assert config_lib.load(run / "config.yaml").model.mtp_depth == 1
    want = _torch_twin(four, extra, TOKENS)
    np.testing.assert_allclose(_scaletrain_ahead(run, TOKENS), want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert main(["convert", "to-hf", "--run-dir", str(run), "--out", str(tmp_path / "back")]) == 0
    original, back = load_file(folder / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert set(back) == set(original)
    for name, array in back.items():
        np.testing.assert_array_equal(array, original[name], err_msg=name)
    built = json.loads((tmp_path / "back" / "config.json").read_text())
    assert built["num_nextn_predict_layers"] == 1 and built["num_hidden_layers"] == 3


def test_a_checkpoint_without_its_mtp_layer_converts_without_it_and_a_run_asking_for_it_is_refused(
        checkpoint, tmp_path, capsys):
    folder, _, _ = checkpoint
    bare = tmp_path / "hf"
    bare.mkdir()
    weights = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("model.layers.3.")},
              bare / "model.safetensors", metadata={"format": "pt"})
    (bare / "config.json").write_text((folder / "config.json").read_text())  # still names one MTP layer
    assert main(["convert", "from-hf", "--hf-dir", str(bare), "--out", str(tmp_path / "run")]) == 0
    assert "converted without it (model.mtp_depth=0)" in capsys.readouterr().out
    assert config_lib.load(tmp_path / "run" / "config.yaml").model.mtp_depth == 0
    code = main(["train", "--config", str(tmp_path / "run" / "config.yaml"), "--set", "model.mtp_depth=1",
                 "--set", f"run_dir={tmp_path / 'tuned'}", "--set", f"checkpoint.init_from={tmp_path / 'run'}",
                 "--set", "steps=1", "--set", "data.seq_len=16", "--set", "train.global_batch=8"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("error:") == 1 and "model.mtp_depth=1" in err and "Traceback" not in err


def test_the_planner_counts_each_module_as_a_mixture_layer_its_projection_and_a_head():
    """A module's FLOPs per token are one more mixture layer's (the stack's one layer longer: attention included),
    its 2d x d projection's and the output head's again; its parameters are the model's `mtp` subtree."""
    from scaletrain.facts import flops

    def model(depth: int, layers: int = 3):
        return model_lib.ModelConfig.from_config(config_lib.load(
            "configs/deepseek_tiny.yaml", [f"model.mtp_depth={depth}", f"model.num_layers={layers}"]).model)

    base, ahead, longer = model(0), model(1), model(0, layers=4)
    d, vocab, seq = base.d_model, base.vocab_size, 256
    layer = flops.flops_per_token(longer, seq) - flops.flops_per_token(base, seq)
    np.testing.assert_allclose(flops.flops_per_token(ahead, seq) - flops.flops_per_token(base, seq),
                               layer + 6 * (2 * d * d + d * vocab), rtol=1e-12)
    modules = sum(x.size for x in jax.tree.leaves(model_lib.abstract(ahead)[1]["mtp"]))
    assert flops.param_count(ahead).total - flops.param_count(base).total == modules
