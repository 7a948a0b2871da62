"""The hand-written cross-entropy gradient against optax's (its slow, obvious twin); the loss over blocks of
positions (model.logits_block) against the loss over whole sequences; the CPU's fused output projection + loss
(loss.linear_cross_entropy) against the logits followed by cross_entropy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from scaletrain import config, train_step, trainer
from scaletrain.loss import blocked_linear_cross_entropy, cross_entropy, linear_cross_entropy, vocab_chunk
from scaletrain.model import Llama, ModelConfig
from scaletrain.train_step import loss_sum
from tests.conftest import tiny_overrides


def test_value_and_gradient_match_optax():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 5, 11)) * 3, jnp.float32)
    labels = jnp.asarray(rng.integers(0, 11, (2, 5)), jnp.int32)
    weights = jnp.asarray(rng.random((2, 5)), jnp.float32)

    def ours(x):
        return jnp.sum(cross_entropy(x, labels) * weights)

    def reference(x):
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(x, labels) * weights)

    np.testing.assert_allclose(ours(logits), reference(logits), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(ours)(logits), jax.grad(reference)(logits), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(jax.jit(jax.grad(ours))(logits), jax.grad(reference)(logits), rtol=1e-5, atol=1e-7)


def test_stable_for_large_logits():
    logits = jnp.asarray([[1e4, 0.0, -1e4]], jnp.float32)
    loss, grad = jax.value_and_grad(lambda x: cross_entropy(x, jnp.asarray([1])).sum())(logits)
    assert np.isfinite(loss) and np.allclose(loss, 1e4)
    np.testing.assert_allclose(grad, [[1.0, -1.0, 0.0]], atol=1e-6)


@pytest.mark.parametrize("variant", [{}, {"tie_embeddings": True}, {"norm": "deferred"}, {"norm": "fused"}])
def test_logits_blocks_give_the_whole_sequences_loss_and_gradient(variant):
    cfg = ModelConfig.from_config(None, vocab_size=96, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                  head_dim=8, d_ff=64, dtype=jnp.float32, **variant)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 96, (2, 16))
    batch = {"tokens": jnp.asarray(tokens, jnp.int32), "targets": jnp.asarray(np.roll(tokens, -1, 1), jnp.int32),
             "positions": jnp.tile(jnp.arange(16, dtype=jnp.int32), (2, 1)),
             "segment_ids": jnp.ones((2, 16), jnp.int32), "loss_mask": jnp.asarray(rng.random((2, 16)) > 0.2,
                                                                                     jnp.float32)}

    def loss_and_grad(block):
        graphdef, params = nnx.split(Llama(dataclasses.replace(cfg, logits_block=block), nnx.Rngs(0)))
        params = nnx.to_pure_dict(params)
        compiled = jax.jit(jax.value_and_grad(lambda p: loss_sum(graphdef, p, batch)[0])).lower(params).compile()
        return compiled(params), compiled.as_text()

    ((whole, whole_grad), whole_hlo), ((blocked, blocked_grad), blocked_hlo) = loss_and_grad(0), loss_and_grad(4)
    # The whole sequences' logits exist in one program only; the other has them 4 positions at a time.
    assert "f32[2,16,96]" in whole_hlo and "f32[2,16,96]" not in blocked_hlo and "f32[2,4,96]" in blocked_hlo
    np.testing.assert_allclose(blocked, whole, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(blocked_grad), jax.tree.leaves(whole_grad)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# The two fused output projections + losses, each with its block parameter: loss.linear_cross_entropy over
# vocabulary chunks (the CPU's path) and loss.blocked_linear_cross_entropy over positions (model.logits_block's).
FUSED = [(linear_cross_entropy, size) for size in (48, 16, 8)] + [(blocked_linear_cross_entropy, size)
                                                                 for size in (6, 3, 1)]


@pytest.mark.parametrize("fused_loss, size", FUSED, ids=[f"{f.__name__}-{n}" for f, n in FUSED])
@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_fused_projection_and_loss_match_logits_then_loss(fused_loss, size, scale):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 6, 16)) * scale, jnp.float32)
    w = jnp.asarray(rng.normal(size=(16, 48)) * 0.3, jnp.float32)
    labels = jnp.asarray(rng.integers(0, 48, (2, 6)), jnp.int32)
    weights = jnp.asarray(rng.random((2, 6)) > 0.3, jnp.float32)

    def fused(x, w, weights):
        return fused_loss(x, w, labels, weights, size)

    def plain(x, w, weights):
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(x @ w, labels) * weights)

    want, want_grads = jax.value_and_grad(plain, argnums=(0, 1, 2))(x, w, weights)
    for fn in (fused, jax.jit(fused)):
        got, got_grads = jax.value_and_grad(fn, argnums=(0, 1, 2))(x, w, weights)
        assert np.isfinite(got)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        for a, b in zip(got_grads, want_grads):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))


def test_vocab_chunk_divides_the_vocabulary():
    assert vocab_chunk(32000) == 2000 and vocab_chunk(128256) == 1336 and vocab_chunk(384) == 384
    assert vocab_chunk(131) == 131 and vocab_chunk(2003, 2000) == 1  # a prime: the plain path is taken


def test_fused_loss_trains_like_the_plain_path_on_8_devices(monkeypatch):
    """Three fsdp=8 steps (grad accumulation 2, masked positions) with the fused path equal the plain path's;
    the compiled step has no [batch, seq, vocab] logits."""
    cfg = config.load(None, tiny_overrides("unused", steps=3) + ["mesh.fsdp=4", "mesh.data=2", "train.global_batch=16",
                                                                  "train.grad_accum_steps=2"])
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(3):
        tokens = rng.integers(0, 384, (16, 32))
        batches.append({"tokens": tokens.astype(np.int32), "targets": np.roll(tokens, -1, 1).astype(np.int32),
                        "positions": np.tile(np.arange(32, dtype=np.int32), (16, 1)),
                        "segment_ids": np.ones((16, 32), np.int32),
                        "loss_mask": (rng.random((16, 32)) > 0.2).astype(np.float32)})

    def run(fused):
        monkeypatch.setattr(train_step, "FUSED_LOSS", fused)
        setup = trainer.build(cfg, jax.devices())
        state = setup.init(jax.random.PRNGKey(0))
        hlo = setup.step.lower(setup.abstract_state, setup.abstract_batch()).as_text()
        losses = []
        for batch in batches:
            state, metrics = setup.step(state, setup.put_batch(batch))
            losses.append(float(metrics["loss"]))
        return losses, jax.device_get(state.params), hlo

    (fused_losses, fused_params, fused_hlo), (plain_losses, plain_params, plain_hlo) = run(True), run(False)
    logits = "tensor<8x32x384xf32>"  # one microbatch's, whole
    assert logits in plain_hlo and logits not in fused_hlo
    np.testing.assert_allclose(fused_losses, plain_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(fused_params), jax.tree.leaves(plain_params)):
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b)
