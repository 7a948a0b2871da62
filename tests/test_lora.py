"""LoRA (models/lora.py, train/trainable.py): the adapters train alike on every mesh of 8 devices and on one (4
updates: loss, gradient norm, the adapters and their Adam moments), the base stays bitwise what it was, and nothing
but the adapters gets optimizer state. End to end from a converted Hugging Face Llama: checkpoints hold the
adapters alone (the base is read back from checkpoint.init_from), a resumed run equals an uninterrupted one, and
both exports - merged weights, a PEFT adapter - give transformers our logits."""

import json

import jax
import numpy as np
import pytest
import torch
import transformers

from scaletrain.__main__ import main
from scaletrain.store.checkpoint import read_metadata
from tests import equivalence
from tests.conftest import converted_llama, tiny_overrides

STEPS = 4
LORA = ["lora.rank=4", "lora.alpha=8", "lora.base_dtype=float32", "optim.weight_decay=0.01"]
MOE = ["model.num_experts=4", "model.moe_d_ff=64"]
# One run per feature set that can be combined: the sequence split over context, fsdp x tensor and the state in host
# memory train together in one run.
MESHES = {
    "context=2 x fsdp=2 x tensor=2, optimizer and parameters offloaded": (
        [], ["mesh.context=2", "mesh.fsdp=2", "mesh.tensor=2", "params.offload=true"]),
    "data=2 x fsdp=2 x tensor=2, zero1": ([], ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                                               "sharding.preset=zero1"]),
    "pipeline=2 x fsdp=2 x tensor=2": ([], ["mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2"]),
    "1f1b pipeline=2 x data=4": ([], ["mesh.pipeline=2", "mesh.data=4", "pipeline.schedule=1f1b"]),
    "1f1b pipeline=2 x fsdp=2 x tensor=2, gathered once": ([], ["mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2",
                                                                "pipeline.schedule=1f1b",
                                                                "pipeline.gather_weights=once"]),
    "moe expert=2 x fsdp=2 x tensor=2": (MOE, ["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"]),
}


@pytest.fixture(scope="module")
@equivalence.computed_once
def references(batches):
    return {"dense": equivalence.reference(batches, *LORA), "moe": equivalence.reference(batches, *LORA, *MOE)}


def _leaves(tree) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("mesh", MESHES)
def test_adapters_train_alike_on_every_mesh(mesh, batches, references):
    model, layout = MESHES[mesh]
    want = references["moe" if model else "dense"]
    got = equivalence.run(batches, *LORA, *model, *layout)
    equivalence.assert_same(got, want)  # every parameter (the base's too) and every Adam moment
    assert set(_leaves(got.mu)) == {p.removeprefix(".params") for p in _leaves(got.params) if "_lora" in p}


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_the_base_is_unchanged_and_the_adapters_move(model, references):
    trained = _leaves(references[model].params)
    initial = _leaves(equivalence.initial_state(*LORA, *(MOE if model == "moe" else [])).params)
    for path, value in trained.items():
        if "_lora" in path:
            assert not np.array_equal(value, initial[path]), f"{path} did not train"
        else:
            assert np.array_equal(value, initial[path]), f"{path} changed"
    adapted = {p.split("'")[-4] for p in trained if "_lora" in p}
    assert adapted == {"wq_lora", "wk_lora", "wv_lora", "wo_lora", "w_gate_lora", "w_up_lora", "w_down_lora"}


def test_targets_choose_the_adapted_projections():
    """The parameters a run builds (its state's shapes: nothing to compile), adapters on the projections named."""
    from scaletrain.train import trainer

    setup = trainer.build(equivalence.load_config(1, *LORA, "lora.targets=q_proj,down_proj"), jax.devices()[:1])
    adapted = {p.split("'")[-4] for p in _leaves(setup.abstract_state.params) if "_lora" in p}
    assert adapted == {"wq_lora", "w_down_lora"}


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """(a tiny Hugging Face Llama's folder, its run directory from `convert from-hf`)."""
    root = tmp_path_factory.mktemp("lora")
    converted_llama(root)
    return root


def _train(root, run, steps, *extra) -> list[float]:
    overrides = tiny_overrides(root / run, steps=steps) + [
        f"checkpoint.init_from={root / 'base'}", *LORA, "checkpoint.every_steps=2", "data.source=synthetic",
        "model.vocab_size=384", "optim.schedule_steps=6", *extra]
    assert main(["train", "--config", str(root / "base" / "config.yaml"),
                 *[a for o in overrides for a in ("--set", o)]]) == 0
    lines = (root / run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if "event" not in json.loads(line)]


def test_lora_from_a_converted_model_end_to_end(hf_run, tmp_path, capfd):
    import shutil

    root = hf_run
    whole = _train(root, "whole", 6, "mesh.fsdp=4", "mesh.tensor=2")
    _, meta = read_metadata(root / "whole" / "checkpoints")
    saved = [p for p in meta["arrays"] if p.startswith(".params")]
    assert saved and all("_lora" in p for p in saved)  # the base is at checkpoint.init_from
    assert meta["base"] == str(root / "base")
    # The run as if stopped after its step-4 save, resumed: the steps after it again, bitwise.
    shutil.copytree(root / "whole", root / "resumed")
    shutil.rmtree(root / "resumed" / "checkpoints" / "6")
    capfd.readouterr()
    assert _train(root, "resumed", 6, "mesh.fsdp=4", "mesh.tensor=2") == whole
    assert "resumed at step 4" in capfd.readouterr().out

    tokens = np.random.RandomState(0).randint(0, 384, (2, 16)).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    assert main(["logits", "--run-dir", str(root / "resumed"), "--tokens", str(tmp_path / "tokens.npy"), "--out",
                 str(tmp_path / "ours.npy")]) == 0
    ours = np.load(tmp_path / "ours.npy")
    assert main(["convert", "to-hf", "--run-dir", str(root / "resumed"), "--out", str(tmp_path / "merged")]) == 0
    assert main(["convert", "to-hf", "--run-dir", str(root / "resumed"), "--out", str(tmp_path / "adapter"),
                 "--peft"]) == 0
    import peft

    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
        base = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
        before = base(torch.tensor(tokens)).logits.numpy()
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
        for name, got in (("merged", merged(torch.tensor(tokens)).logits.numpy()),
                          ("PEFT", adapted(torch.tensor(tokens)).logits.numpy())):
            np.testing.assert_allclose(got, ours, rtol=0, atol=1e-5, err_msg=name)
    assert np.abs(before - ours).max() > 1e-3  # the adapters changed the model


def test_an_int8_base_is_read_back_rounded_and_exports_merged(hf_run, tmp_path):
    """An int8 base left out of the checkpoints is read from checkpoint.init_from and rounded again, as the run
    rounded it: `logits` computes what the run trained, and the merged export (int8 base x scale + the adapters)
    gives transformers the same logits."""
    root = hf_run
    _train(root, "int8", 2, "lora.base_dtype=int8")
    tokens = np.random.RandomState(1).randint(0, 384, (2, 16)).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    assert main(["logits", "--run-dir", str(root / "int8"), "--tokens", str(tmp_path / "tokens.npy"), "--out",
                 str(tmp_path / "ours.npy")]) == 0
    assert main(["convert", "to-hf", "--run-dir", str(root / "int8"), "--out", str(tmp_path / "merged")]) == 0
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
        np.testing.assert_allclose(merged(torch.tensor(tokens)).logits.numpy(), np.load(tmp_path / "ours.npy"),
                                   rtol=0, atol=1e-5)


def test_dropout_trains_alike_on_a_mesh_and_drops_each_layer_its_own(batches):
    """lora.dropout's masks are a hash of the token (row, segment, position), the layer and the projection: the same
    on every mesh and pipeline layout - here a circular one over fsdp, which keeps its layers out of order -, and
    they change training."""
    cfg = [*LORA, "lora.dropout=0.3", "model.num_layers=4"]
    want = equivalence.reference(batches, *cfg)
    # A mask that differed would move the parameters by O(1e-1); the reduction order's rounding leaves B of an
    # adapter (from zero, through Adam) up to 2.4e-5 apart after 4 updates.
    equivalence.assert_same(equivalence.run(batches, *cfg, "mesh.fsdp=2", "mesh.pipeline=2",
                                            "pipeline.schedule=circular", "pipeline.repeats=2"), want, params=5e-5)
    plain = equivalence.reference(batches, *LORA, "model.num_layers=4")
    assert want.losses[0] == plain.losses[0]  # B = 0: the adapters add nothing yet
    assert want.losses[1] != plain.losses[1]


def test_dropout_masks():
    import jax.numpy as jnp

    from scaletrain.models import lora

    seeds = lora.token_seeds(jnp.uint32(7), jnp.ones((4, 64), jnp.int32), jnp.tile(jnp.arange(64), (4, 1)))
    x = jnp.ones((4, 64, 256), jnp.float32)

    def dropped(layer, site):
        with lora.dropping(lora.Dropout(seeds, jnp.uint32(layer), 0.25)):
            return np.asarray(lora._dropped(x, site))

    a = dropped(0, 0)
    assert set(np.unique(a)) == {0.0, np.float32(1 / 0.75)}
    assert abs((a == 0).mean() - 0.25) < 0.01  # 65536 draws
    assert np.array_equal(a, dropped(0, 0))  # recomputed alike (remat)
    for other in (dropped(1, 0), dropped(0, 1)):  # another layer, another projection
        assert abs(((a == 0) & (other == 0)).mean() - 0.25 ** 2) < 0.01
    assert np.array_equal(np.asarray(lora._dropped(x, 0)), np.asarray(x))  # outside a training step: none


@pytest.mark.parametrize("overrides, says", [
    (MOE + ["lora.dropout=0.1"], "a mixture's experts"),
    (["lora.dropout=0.1", "mesh.pipeline=2", "pipeline.schedule=1f1b"], "does not carry the layers' dropout seeds"),
    (["mesh.pipeline=2", "pipeline.schedule=zero_bubble"], "LoRA's frozen base has none"),
])
def test_refusals(overrides, says):
    from scaletrain.errors import ConfigError
    from scaletrain.train import trainer

    cfg = equivalence.load_config(1, *LORA, *overrides)
    with pytest.raises(ConfigError, match=says):
        trainer.build(cfg, jax.devices()[:2 if "mesh.pipeline=2" in overrides else 1])


def test_a_1f1b_pipeline_forms_no_gradient_of_the_base():
    """The 1F1B program differentiates the adapters alone: its compiled step's temporaries are fewer bytes than the
    base's float32 gradient would take (wide MLPs make the weights outweigh the tiny batch's activations)."""
    from scaletrain.train import trainer

    # The step compiled, not run: its memory is the claim.
    cfg = equivalence.load_config(1, *LORA, "mesh.pipeline=2", "mesh.data=4", "pipeline.schedule=1f1b",
                                  "model.d_model=256", "model.d_ff=1024")
    setup = trainer.build(cfg, jax.devices()[:8])
    temporaries = equivalence.compiled_step(setup).memory_analysis().temp_size_in_bytes
    base = sum(x.size * 4 for x in jax.tree.leaves(setup.parts.split(setup.abstract_state.params)[1]))
    assert temporaries < 0.5 * base, (temporaries, base)


INT8 = ["lora.rank=4", "lora.alpha=8", "lora.base_dtype=int8"]


def test_an_int8_base_is_rounded_per_column_and_trains_alike_on_a_mesh(batches, references):
    """lora.base_dtype int8: the stack's projections stored as int8 beside per-column float32 scales (a byte a
    weight), dequantized as each layer runs - the same training on every mesh, and within rounding of a float32
    base's."""
    import jax.numpy as jnp

    from scaletrain.models import lora

    w = np.random.RandomState(0).normal(size=(2, 64, 4, 16)).astype(np.float32)
    q = lora.quantized({"wq": w, "wq_scale": np.ones((2, 1, 4, 16), np.float32)})
    assert q["wq"].dtype == jnp.int8 and np.abs(np.asarray(q["wq"])).max() == 127
    back = np.asarray(lora.dequantized(q, jnp.float32)["wq"])
    assert np.all(np.abs(back - w) <= np.asarray(q["wq_scale"]) / 2 + 1e-7)

    want = equivalence.reference(batches, *INT8)
    equivalence.assert_same(equivalence.run(batches, *INT8, "mesh.fsdp=4", "mesh.tensor=2"), want)
    stored = _leaves(want.params)
    assert stored["['layers']['attn']['wq']"].dtype == np.int8
    assert stored["['embed']['table']"].dtype == jnp.bfloat16  # the rest of the base: bfloat16
    float_base = references["dense"].losses
    np.testing.assert_allclose(want.losses, float_base, rtol=1e-3)
