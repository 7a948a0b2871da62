"""Sliding-window attention layers (model.sliding_window, model.layer_types; models/window.py): a sliding layer's
query sees exactly the keys of its window; every attention path - XLA blocked, the flash kernel (splash,
interpreted), generate's KV cache - equals plain XLA attention with the window in a stack that mixes sliding and
full layers; context parallelism (all-gather, XLA and splash; XLA's ring) and a GPipe pipeline train like one device;
what cannot take a window is refused with one error line."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scaletrain import config
from scaletrain import models as model_lib
from scaletrain.data import loader as data
from scaletrain.errors import ConfigError
from scaletrain.parallel import checks
from scaletrain.tools.generate import generate_tokens
from tests import equivalence

WINDOW = 5
MIXED = dict(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, d_ff=64,
             dtype=jnp.float32, sliding_window=WINDOW, layer_types="sliding,full")


def _model(**overrides):
    cfg = model_lib.ModelConfig.from_config(None, **(MIXED | overrides))
    return model_lib.abstract(cfg)[0], model_lib.init_params(cfg, jax.random.PRNGKey(0))


def _inputs(t: int, rows: int = 2):
    """Tokens, positions and segment ids: two documents per row, the second starting mid-sequence."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (rows, t)), jnp.int32)
    cut = t // 3
    positions = jnp.asarray(np.concatenate([np.arange(cut), np.arange(t - cut)]))[None].repeat(rows, 0)
    segments = jnp.asarray(np.r_[np.ones(cut), 2 * np.ones(t - cut)], jnp.int32)[None].repeat(rows, 0)
    return tokens, positions, segments


def _logits_and_grads(graphdef, params, t):
    """The logits, and the gradient of every parameter under a loss that weighs each logit differently."""
    tokens, positions, segments = _inputs(t)

    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens, positions, segments)
        return (logits * jnp.cos(jnp.arange(logits.size, dtype=jnp.float32)).reshape(logits.shape)).sum(), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return logits, grads


@functools.cache
def _plain(t: int):
    graphdef, params = _model()
    return _logits_and_grads(graphdef, params, t)


def test_a_sliding_layer_sees_exactly_its_window():
    """One sliding layer: the logits at position q change when the token at q - WINDOW + 1 changes and not when
    the one at q - WINDOW does; without the window they change for both."""
    q = 20

    def moved(position, **overrides):
        graphdef, params = _model(**(dict(num_layers=1, layer_types="sliding") | overrides))
        tokens, positions = _inputs(32, 1)[:2]
        changed = tokens.at[0, position].set((tokens[0, position] + 1) % 64)
        logits = jax.jit(lambda t: nnx.merge(graphdef, params)(t, positions, jnp.ones_like(t))[0, q])
        return np.abs(logits(changed) - logits(tokens)).max()

    assert moved(q - WINDOW + 1) > 1e-4 and moved(q - WINDOW) == 0
    assert moved(q - WINDOW, sliding_window=0, layer_types="") > 1e-4


@pytest.mark.parametrize("path, overrides, t", [("xla blocked", dict(attention_block=8), 32),
                                                ("flash", dict(attention="flash"), 128)])
def test_each_attention_path_equals_plain_xla(path, overrides, t):
    """Mixed sliding and full layers (each flash layer picks its kernel by its kind), documents packed: the logits
    and every parameter's gradient within 1e-5 of plain XLA attention with the window."""
    got = _logits_and_grads(*_model(**overrides), t)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(_plain(t))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_decoding_through_the_cache_is_the_argmax_of_the_forward_pass():
    """Greedy decoding past the window (the cache holds every position; the mask hides the old ones) equals the
    argmax of the full forward pass at every step."""
    graphdef, params = _model(init_std=0.3)
    prompt, new = jnp.asarray([[3, 9, 27, 17, 51, 4]], jnp.int32), 10
    tokens, _ = generate_tokens(graphdef, params, prompt, jax.random.PRNGKey(0), -1, new, 0.0, 1.0)
    sequence = jnp.concatenate([prompt, tokens], axis=1)
    positions = jnp.arange(sequence.shape[1])[None]
    logits = nnx.merge(graphdef, params)(sequence, positions, jnp.ones_like(sequence))
    expected = np.asarray(logits[0, prompt.shape[1] - 1: -1].argmax(-1))
    np.testing.assert_array_equal(np.asarray(tokens[0]), expected)
    assert len(set(expected.tolist())) > 1


STEPS = 4
TRAINED = ["model.sliding_window=5", "model.layer_types=sliding,full"]
# (sequence, the model's overrides (the reference's too), the mesh's)
MESHES = {
    "context=2 x fsdp=4, xla": (32, [], ["mesh.context=2", "mesh.fsdp=4"]),
    "context=2 x fsdp=2, flash": (256, ["model.attention=flash", "train.global_batch=2"],
                                  ["mesh.context=2", "mesh.fsdp=2"]),
    "context=4 x fsdp=2, ring in tiles": (32, ["model.attention_block=4"], ["mesh.context=4", "mesh.fsdp=2",
                                                                           "model.context_attention=ring"]),
    "pipeline=2 x fsdp=4, gpipe": (32, [], ["mesh.pipeline=2", "mesh.fsdp=4", "pipeline.microbatches=2"]),
}


@functools.cache
def _batches(seq_len: int, rows: int) -> list[dict]:
    it = data.BatchIterator(data.make_dataset(config.load(None, [f"data.seq_len={seq_len}"])), global_batch=rows)
    return [next(it) for _ in range(STEPS)]


@pytest.mark.parametrize("mesh", MESHES)
def test_a_mesh_trains_like_one_device(mesh):
    seq_len, model, layout = MESHES[mesh]
    overrides = [f"data.seq_len={seq_len}", *TRAINED, *model]
    batches = _batches(seq_len, next((int(o.split("=")[1]) for o in model if o.startswith("train.global_batch=")), 8))
    # Splash's blocks sum a row's keys in another order than one device's: one norm gain's Adam moment measured
    # 1.01e-5 off in norm.
    rtol = 2e-5 if "model.attention=flash" in model else 1e-5
    equivalence.assert_same(equivalence.run(batches, *overrides, *layout), equivalence.reference(batches, *overrides),
                            rtol)


@pytest.mark.parametrize("overrides, says", [
    (["model.layer_types=sliding"], "has sliding layers but model.sliding_window=0"),
    (["model.sliding_window=8"], "no layer slides"),
    (["model.sliding_window=8", "model.layer_types=local,full"], "unknown layer type"),
    (["model.sliding_window=8", "model.layer_types=sliding,full", "model.num_layers=4", "model.num_experts=4",
      "model.moe_every=2"], "needs model.moe_every=1"),
    (["model.sliding_window=8", "model.layer_types=sliding,full", "model.num_layers=3", "model.num_experts=4",
      "model.first_dense_layers=1"], "not built with dense first layers"),
    (["model.sliding_window=8", "model.layer_types=sliding,full", "model.rope_local_theta=10000",
      "model.num_kv_heads=4", "model.kv_lora_rank=8", "model.rope_head_dim=8"], "not built for latent attention"),
])
def test_a_window_the_layers_cannot_take_is_refused(overrides, says):
    with pytest.raises(ConfigError, match=says):
        config.load(None, overrides)


@pytest.mark.parametrize("overrides, says", [
    (["mesh.pipeline=2", "pipeline.schedule=1f1b"], "does not carry the layers' indices"),
    (["mesh.pipeline=2", "pipeline.schedule=zero_bubble"], "does not carry the layers' indices"),
    (["mesh.context=2", "model.context_attention=ring", "model.attention=flash", "data.seq_len=512"],
     "the splash ring's pass masks know no window"),
    (["mesh.context=2", "model.context_attention=ring", "model.attn_logit_softcap=50"],
     "the ring's passes do not cap their scores"),
])
def test_a_runner_that_cannot_carry_the_window_is_refused(overrides, says):
    cfg = config.load(None, [*TRAINED, *overrides])
    with pytest.raises(ConfigError, match=says):
        checks.check(cfg, {a: int(cfg.mesh[a]) for a in config.MESH_AXES})


def test_the_planner_counts_a_window_below_full_attention():
    """Sliding layers' attention FLOPs: W - W (W - 1) / 2T keys a query instead of T / 2 (flash skips the rest);
    XLA executes the full layers' work all the same."""
    from scaletrain.facts import flops
    from scaletrain.planner import roofline

    full = config.load(None, ["data.seq_len=1024", "model.num_layers=4"])
    local = config.load(None, ["data.seq_len=1024", "model.num_layers=4", "model.sliding_window=128",
                               "model.layer_types=sliding,full"])
    keys = flops.attention_keys(local.model, 1024)
    assert keys == 2 * 512 + 2 * (128 - 128 * 127 / 2048) and flops.attention_keys(full.model, 1024) == 4 * 512
    assert flops.attention_flops_per_token(local.model, 1024) == pytest.approx(
        flops.attention_flops_per_token(full.model, 1024) * keys / 2048)
    executed = [roofline.attention_pass(c) * flops.attention_flops_per_token(c.model, 1024) for c in (full, local)]
    assert executed[0] == pytest.approx(executed[1])
