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

from scaletrain import config
from scaletrain.models import Llama, ModelConfig
from scaletrain.train import trainer
from scaletrain.train.loss import blocked_linear_cross_entropy, cross_entropy, linear_cross_entropy, vocab_chunk
from scaletrain.train.step import loss_sum
from tests import equivalence
from tests.conftest import tiny_overrides
from tests.numerics import assert_close, assert_trees_close


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
    # The gradient w * (softmax - onehot) is rounded where softmax = exp(z - lse) is: by EPS * (|z| + |lse|) relative
    # to it, plus a few ulps for the exp, the log and the sum of exponentials each side orders its own way. So 4
    # ulps of the logits' magnitude (7 here: 3.3e-6), the same for every entry (an entry near 0 - the label's, p near
    # 1 - carries it too; measured 0.14). A wrong one-hot, weight or softmax moves an entry by up to its weight.
    logit_scale = float(jnp.abs(logits).max())
    assert_close(jax.grad(ours)(logits), jax.grad(reference)(logits), ulps=4, scale=logit_scale)
    assert_close(jax.jit(jax.grad(ours))(logits), jax.grad(reference)(logits), ulps=4, scale=logit_scale)


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
    # The same terms in other groupings (logits a block of positions at a time, the output weight's gradient summed
    # block by block; norm: fused adds its own kernel's order), so rounding apart. The loss is a sum of 29
    # non-negative cross-entropies: 8 ulps of itself (measured: 1). Each gradient against its own array's scale: an
    # entry near 0 carries the absolute error of the sums it comes from (measured: up to 1.5 ulps of the scale, e.g.
    # 1.9e-7 on an entry of -0.0078 in an array reaching 4.7 - 2.5e-5 of the entry, which failed rtol=1e-5 on
    # another CPU); 16 ulps, 1.9e-6 of the scale. A position lost or counted twice moves them by ~1/29 of it.
    assert_close(blocked, whole, ulps=8)
    assert_trees_close(blocked_grad, whole_grad, ulps=16)


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
        # Rounding apart (the vocabulary in chunks with an online log-sum-exp, or positions in blocks; the gradient
        # formed in the forward pass): the loss, a sum of non-negative terms, against itself and each gradient
        # against its array's scale, 16 ulps (measured: at most 2; was rtol 1e-5 + 1e-5 of the scale, 84 ulps).
        assert_close(got, want, ulps=16)
        for a, b in zip(got_grads, want_grads):
            assert_close(a, b, ulps=16)


def test_vocab_chunk_divides_the_vocabulary():
    assert vocab_chunk(32000) == 2000 and vocab_chunk(128256) == 1336 and vocab_chunk(384) == 384
    assert vocab_chunk(131) == 131 and vocab_chunk(2003, 2000) == 1  # a prime: the plain path is taken


def test_fused_loss_trains_like_the_plain_path_on_8_devices(monkeypatch):
    """Three fsdp=8 steps (grad accumulation 2, masked positions) with the fused path equal the plain path's;
    the compiled step has no [batch, seq, vocab] logits."""
    # optim.eps = the learning rate (3e-3): Adam's update lr * m / (sqrt(v) + eps) moves by up to lr / eps times a
    # change in the gradient, so with the default eps (1e-8) an entry whose gradient is near 1e-8 (an embedding row
    # of a token seen once) turns a rounding difference into a visible one - measured: 1.7e-5 on one entry after
    # three steps, 45 float32 ulps of the whole table's norm, half the former tolerance. With eps = lr an update
    # moves by at most as much as its gradient: the parameters differ by their rounding.
    cfg = config.load(None, tiny_overrides("unused", steps=3) + ["mesh.fsdp=4", "mesh.data=2", "train.global_batch=16",
                                                                  "train.grad_accum_steps=2", "optim.eps=3e-3"])
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(3):
        tokens = rng.integers(0, 384, (16, 32))
        batches.append({"tokens": tokens.astype(np.int32), "targets": np.roll(tokens, -1, 1).astype(np.int32),
                        "positions": np.tile(np.arange(32, dtype=np.int32), (16, 1)),
                        "segment_ids": np.ones((16, 32), np.int32),
                        "loss_mask": (rng.random((16, 32)) > 0.2).astype(np.float32)})

    def run(fused):
        monkeypatch.setattr("scaletrain.train.loss.FUSED_LOSS", fused)
        setup = trainer.build(cfg, jax.devices())
        state = setup.init(jax.random.PRNGKey(0))
        lowered = setup.step.lower(*setup.abstract_args())
        hlo, step = lowered.as_text(), lowered.compile(equivalence.COMPILER_OPTIONS)  # as tests/equivalence.py
        losses = []
        for batch in batches:
            state, metrics = step(state, setup.put_batch(batch), setup.loss_ceiling())
            losses.append(float(metrics["loss"]))
        return losses, jax.device_get(state.params), hlo

    (fused_losses, fused_params, fused_hlo), (plain_losses, plain_params, plain_hlo) = run(True), run(False)
    logits = "tensor<8x32x384xf32>"  # one microbatch's, whole
    assert logits in plain_hlo and logits not in fused_hlo
    # Rounding apart: the losses (means of non-negative terms) and every parameter array against its scale, 16 ulps
    # (measured: at most 1.7). A wrong gradient moves the updates by a share of lr = 3e-3, 10^3 times more.
    assert_close(fused_losses, plain_losses, ulps=16)
    assert_trees_close(fused_params, plain_params, ulps=16)
