"""The hand-written cross-entropy gradient against optax's (its slow, obvious twin)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from scaletrain.loss import cross_entropy


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
