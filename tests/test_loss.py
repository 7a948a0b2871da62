"""The hand-written cross-entropy gradient against optax's (its slow, obvious twin); the loss over blocks of
positions (model.logits_block) against the loss over whole sequences."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from scaletrain.loss import cross_entropy
from scaletrain.model import Llama, ModelConfig
from scaletrain.train_step import loss_sum


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
    cfg = ModelConfig(vocab_size=96, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, d_ff=64,
                      dtype=jnp.float32, **variant)
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
