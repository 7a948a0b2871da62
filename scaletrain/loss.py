"""Next-token cross-entropy with a hand-written gradient.

The gradient of softmax cross-entropy is softmax(logits) - onehot(label). Written as one custom VJP, XLA makes
it a single elementwise pass over the [tokens, vocab] logits, with the one-hot built by comparison instead of
the scatter that differentiating the label gather would produce (on CPU that scatter and its relayout cost as much as the
output projection's matmuls). `optax.softmax_cross_entropy_with_integer_labels` is its slow twin in tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _is_label(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return jax.lax.broadcasted_iota(labels.dtype, logits.shape, logits.ndim - 1) == labels[..., None]


@jax.custom_vjp
def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """-log softmax(logits)[label] per position; logits [..., V] float32, labels [...] int32."""
    return _forward(logits, labels)[0]


def _forward(logits, labels):
    lse = jax.nn.logsumexp(logits, axis=-1)
    # A masked sum rather than a gather: with the vocabulary sharded (tensor parallelism) each device sums
    # its own slice and only [tokens] partial sums are all-reduced; full-vocab logits never meet on one device.
    label_logit = jnp.sum(jnp.where(_is_label(logits, labels), logits, 0.0), axis=-1)
    return lse - label_logit, (logits, labels, lse)


def _backward(residuals, g):
    logits, labels, lse = residuals
    probs = jnp.exp(logits - lse[..., None])
    dlogits = g[..., None] * (probs - _is_label(logits, labels).astype(logits.dtype))
    return dlogits, None


cross_entropy.defvjp(_forward, _backward)
