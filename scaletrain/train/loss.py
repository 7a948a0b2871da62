"""Next-token cross-entropy with a hand-written gradient.

The gradient of softmax cross-entropy is softmax(logits) - onehot(label). Written as one custom VJP, XLA makes
it a single elementwise pass over the [tokens, vocab] logits, with the one-hot built by comparison instead of
the scatter that differentiating the label gather would produce (on CPU that scatter and its relayout cost as
much as the output projection's matmuls). `optax.softmax_cross_entropy_with_integer_labels` is its slow twin in
tests.

`linear_cross_entropy` goes one step further, for CPUs (`head_loss` decides where): the output projection and
the loss together, a chunk of the vocabulary at a time, with the gradient formed in the forward pass, so that the
[tokens, vocab] logits are never written and read back as a whole. `cross_entropy` of the logits is its twin.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from scaletrain.models import quantize
from scaletrain.parallel import context
from scaletrain.parallel.sharding import active_device, ways

# The CPU's fast path for the output projection + loss (linear_cross_entropy); False: always the plain path, its
# slow twin in tests.
FUSED_LOSS = True


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


# The output projection and the loss in one pass over vocabulary chunks: the CPU's fast path (`head_loss`).


def vocab_chunk(vocab: int, target: int = 2000) -> int:
    """The largest divisor of `vocab` up to `target`: the width of one chunk of the output projection."""
    return max(c for c in range(1, min(vocab, target) + 1) if vocab % c == 0)


def _per_device(x_btd, w, labels_bt, weights_bt, chunk):
    """This device's summed loss terms, d loss / d x and its partial d loss / d w, with the output projection
    done `chunk` vocabulary columns at a time so that no [tokens, vocab] array but the exponentials is written.

    Pass 1 computes each chunk's logits, keeps exp(logits - chunk max) and folds the chunk into a running
    log-sum-exp (online softmax) and the label's logit. Pass 2 turns each kept chunk into its gradient
    weights * (softmax - onehot) while it is in cache and multiplies it at once into d x and d w's columns."""
    b, t, d = x_btd.shape
    x, labels, weights = x_btd.reshape(b * t, d), labels_bt.reshape(-1), weights_bt.reshape(-1).astype(jnp.float32)
    n, vocab = x.shape[0], w.shape[1]
    w = w.astype(x.dtype)
    column = jax.lax.broadcasted_iota(labels.dtype, (n, chunk), 1)

    def columns(i):
        return jax.lax.dynamic_slice_in_dim(w, i * chunk, chunk, axis=1)

    def first(carry, i):
        m, s, label_logit = carry
        z = jnp.dot(x, columns(i), preferred_element_type=jnp.float32)
        z_max = jnp.max(z, axis=-1)
        e = jnp.exp(z - z_max[:, None])
        m_new = jnp.maximum(m, z_max)
        s = s * jnp.exp(m - m_new) + jnp.sum(e, axis=-1) * jnp.exp(z_max - m_new)
        label_logit = label_logit + jnp.sum(jnp.where(column + i * chunk == labels[:, None], z, 0.0), axis=-1)
        return (m_new, s, label_logit), (e, z_max)

    zeros = jnp.zeros((n,), jnp.float32)
    (m, s, label_logit), (exps, maxes) = jax.lax.scan(
        first, (jnp.full((n,), -jnp.inf, jnp.float32), zeros, zeros), jnp.arange(vocab // chunk))
    lse = m + jnp.log(s)

    def second(carry, xs):
        dx, dw = carry
        e, z_max, i = xs
        g = e * (jnp.exp(z_max - lse) * weights)[:, None]
        g = g - jnp.where(column + i * chunk == labels[:, None], weights[:, None], 0.0)
        dx = dx + jax.lax.dot_general(g, columns(i), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        dw_i = jax.lax.dot_general(x, g, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return (dx, jax.lax.dynamic_update_slice_in_dim(dw, dw_i, i * chunk, axis=1)), None

    (dx, dw), _ = jax.lax.scan(second, (jnp.zeros((n, d), jnp.float32), jnp.zeros((d, vocab), jnp.float32)),
                               (exps, maxes, jnp.arange(vocab // chunk)))
    return (lse - label_logit).reshape(b, t), dx.reshape(b, t, d), dw.reshape(1, 1, d, vocab)


def _linear_cross_entropy_parts(x_btd, w, labels_bt, weights_bt, chunk):
    from scaletrain.parallel.sharding import local

    fn = local(functools.partial(_per_device, chunk=chunk),
               (("batch", "seq", "embed"), (None, None), ("batch", "seq"), ("batch", "seq")), ("batch", "seq"))
    ce, dx, dw = fn(x_btd, w, labels_bt, weights_bt)  # dw: one partial sum per data shard, summed here
    return jnp.sum(ce * weights_bt), (ce, dx.astype(x_btd.dtype), jnp.sum(dw, axis=(0, 1)).astype(w.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def linear_cross_entropy(x_btd: jax.Array, w: jax.Array, labels_bt: jax.Array, weights_bt: jax.Array,
                         chunk: int) -> jax.Array:
    """sum(weights * cross_entropy(x @ w, labels)) for x [b, t, d], w [d, vocab] (vocab a multiple of `chunk`,
    vocab_chunk), without the [b, t, vocab] logits: their gradient is formed chunk by chunk in the forward pass
    (the loss is the last thing computed, so its cotangent is one scalar that the backward pass only scales
    by). Per device: a sharded vocabulary is not supported. `cross_entropy` of `x @ w` is its slow twin."""
    return _linear_cross_entropy_parts(x_btd, w, labels_bt, weights_bt, chunk)[0]


def _lce_forward(x_btd, w, labels_bt, weights_bt, chunk):
    return _linear_cross_entropy_parts(x_btd, w, labels_bt, weights_bt, chunk)


def _lce_backward(chunk, residuals, g):
    ce, dx, dw = residuals
    return g * dx, g * dw, None, g * ce


linear_cross_entropy.defvjp(_lce_forward, _lce_backward)


# The output projection and the loss a block of positions at a time, the gradient formed in the forward pass: the
# path of model.logits_block (`head_loss`), for accelerators. XLA partitions it, any vocabulary sharding
# included.


def _blocked_parts(x_btd, w, labels_bt, weights_bt, block, unroll):
    """The summed loss, and the residuals of its gradient: each position's loss term, d loss / d x and d loss /
    d w. The output projection's weight is gathered once (placed per the activation rules, which never split
    `embed`), not once per block; each block's weight gradient is reduced in the compute dtype into an
    accumulator placed as the gradient will be (a reduce-scatter under FSDP), not all-reduced whole; no block's
    logits are computed twice. float32 logits and softmax, as `cross_entropy`."""
    from scaletrain.parallel.sharding import constrain

    d, dtype, shards = x_btd.shape[2], x_btd.dtype, ways("seq")
    w_dv = constrain(w.astype(dtype), ("embed", "vocab"))

    def split(a):  # each step a block of every context shard's positions
        return context.blocks(a, shards, block)

    def one(dw_dv, xs):
        x_btd, labels_bt, weights_bt = xs
        logits = constrain(jnp.dot(x_btd, w_dv, preferred_element_type=jnp.float32), ("batch", "seq", "vocab"))
        lse = jax.nn.logsumexp(logits, axis=-1)
        is_label = _is_label(logits, labels_bt)
        label_logit = jnp.sum(jnp.where(is_label, logits, 0.0), axis=-1)
        dlogits = ((jnp.exp(logits - lse[..., None]) - is_label) * weights_bt[..., None]).astype(dtype)
        dx_btd = jnp.einsum("btv,dv->btd", dlogits, w_dv, preferred_element_type=jnp.float32).astype(dtype)
        dw_block = jnp.einsum("btd,btv->dv", x_btd, dlogits, preferred_element_type=dtype)
        dw_dv = dw_dv + constrain(dw_block, ("embed", "vocab"), "grads").astype(jnp.float32)
        return dw_dv, (lse - label_logit, dx_btd)

    dw0 = constrain(jnp.zeros((d, w.shape[1]), jnp.float32), ("embed", "vocab"), "grads")
    dw_dv, (ce, dx) = jax.lax.scan(one, dw0, (split(x_btd), split(labels_bt), split(weights_bt)), unroll=unroll)
    ce_bt, dx_btd = (context.unblocks(a, shards) for a in (ce, dx))
    return jnp.sum(ce_bt * weights_bt), (ce_bt, dx_btd, dw_dv.astype(w.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def blocked_linear_cross_entropy(x_btd: jax.Array, w: jax.Array, labels_bt: jax.Array, weights_bt: jax.Array,
                                 block: int, unroll: bool = False) -> jax.Array:
    """sum(weights * cross_entropy(x @ w, labels)) for x [b, t, d] (t a multiple of `block`), w [d, vocab], the
    [b, t, vocab] logits existing one block of positions at a time and each computed once (`unroll`: the block
    loop unrolled, for XLA's cost estimate). `cross_entropy` of `x @ w` is its slow twin."""
    return _blocked_parts(x_btd, w, labels_bt, weights_bt, block, unroll)[0]


def _blocked_forward(x_btd, w, labels_bt, weights_bt, block, unroll):
    return _blocked_parts(x_btd, w, labels_bt, weights_bt, block, unroll)


def _blocked_backward(block, unroll, residuals, g):
    ce_bt, dx_btd, dw_dv = residuals
    return (g * dx_btd).astype(dx_btd.dtype), g * dw_dv, None, g * ce_bt


blocked_linear_cross_entropy.defvjp(_blocked_forward, _blocked_backward)


def head_loss(graphdef: nnx.GraphDef, params: Any, x_btd: jax.Array, targets_bt: jax.Array,
              mask_bt: jax.Array) -> jax.Array:
    """The summed loss of `hidden`'s stream (Llama.final_stream's) through the output projection.

    With model.logits_block, the float32 logits - at Llama 3's vocabulary the largest activation by far - exist
    one block of positions at a time: blocked_linear_cross_entropy forms each block's gradient as it goes
    (an untied output projection of the normalised stream); otherwise each block's projection and loss is a
    checkpointed step of a scan, and the backward pass recomputes that block's logits."""
    model = nnx.merge(graphdef, params)

    def block_loss(params, x_btd, targets_bt, mask_bt):
        return jnp.sum(cross_entropy(nnx.merge(graphdef, params).logits(x_btd), targets_bt) * mask_bt)

    block, seq = model.cfg.logits_block, x_btd.shape[1] // ways("seq")  # positions per context shard
    if (not block or block >= seq) and _fused_loss(model, x_btd):
        return linear_cross_entropy(x_btd, model.lm_head[...], targets_bt, mask_bt.astype(jnp.float32),
                                    vocab_chunk(model.cfg.vocab_size))
    if not block or block >= seq:
        return block_loss(params, x_btd, targets_bt, mask_bt)

    if projects_the_stream(model.cfg):
        return blocked_linear_cross_entropy(x_btd, model.lm_head[...], targets_bt, mask_bt.astype(jnp.float32),
                                            block, model.cfg.unroll_loops)

    def blocks(a):  # each step a block of every context shard's positions
        return context.blocks(a, ways("seq"), block)

    recomputed = jax.checkpoint(block_loss)
    total, _ = jax.lax.scan(lambda total, xs: (total + recomputed(params, *xs), None), jnp.zeros((), jnp.float32),
                            (blocks(x_btd), blocks(targets_bt), blocks(mask_bt)), unroll=model.cfg.unroll_loops)
    return total


def token_losses(graphdef: nnx.GraphDef, params: Any, x_btd: jax.Array, targets_bt: jax.Array) -> jax.Array:
    """Each position's cross-entropy [b, t] of `hidden`'s stream (Llama.final_stream's) through the output
    projection: what a loss that is not a masked sum of them (DPO's, per sequence) reads. With model.logits_block
    the logits exist a block of positions at a time, each block recomputed in the backward pass."""
    model = nnx.merge(graphdef, params)

    def block_losses(params, x_btd, targets_bt):
        return cross_entropy(nnx.merge(graphdef, params).logits(x_btd), targets_bt)

    block, seq = model.cfg.logits_block, x_btd.shape[1] // ways("seq")
    if not block or block >= seq:
        return block_losses(params, x_btd, targets_bt)

    def blocks(a):  # each step a block of every context shard's positions
        return context.blocks(a, ways("seq"), block)

    recomputed = jax.checkpoint(block_losses)
    _, losses = jax.lax.scan(lambda _, xs: (None, recomputed(params, *xs)), None, (blocks(x_btd), blocks(targets_bt)),
                             unroll=model.cfg.unroll_loops)
    return context.unblocks(losses, ways("seq"))


def projects_the_stream(cfg) -> bool:
    """Whether the logits are `hidden`'s stream times lm_head, nothing else (untied, the final norm applied
    before, the head not quantized: the fused losses multiply in the compute dtype; not soft-capped): what the
    fused losses compute. FUSED_LOSS False keeps the plain paths, their twins in tests."""
    return (FUSED_LOSS and not cfg.tie_embeddings and cfg.norm == "standard"
            and quantize.for_group(cfg, "output") is None and not cfg.final_logit_softcap)


def _fused_loss(model, x_btd) -> bool:
    """Whether the whole sequences' loss takes loss.linear_cross_entropy: on CPU, where it saves the passes
    over the [tokens, vocab] logits (10-25% over the projection's matmuls per device, docs/benchmarks.md), for a
    float32 untied output projection of the standard-norm stream over an unsharded vocabulary. Elsewhere (TPU,
    GPU) whole sequences take the plain path - its logits stay one fused XLA pass, and no measurement there
    backs the change - and model.logits_block the blocked fused one."""
    cfg = model.cfg
    return (projects_the_stream(cfg) and active_device().platform == "cpu" and x_btd.dtype == jnp.float32
            and ways("vocab") == 1 and vocab_chunk(cfg.vocab_size) >= 128)
