"""`generate`: the KV-cached decode loop against the full forward pass, sampling, and the command line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scaletrain import model as model_lib
from scaletrain.generate import generate_tokens, pick

PROMPT = np.array([256, 72, 101, 108, 108, 111], np.int32)
NEW = 12


def tiny(**overrides):
    # A large init scale makes the logits decisive, so no near-tie can flip an argmax between the two paths.
    fields = dict(vocab_size=259, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, d_ff=128,
                  init_std=0.3, dtype=jnp.float32, qk_norm=True, rope_scaling="llama3", rope_theta=500000.0)
    return model_lib.ModelConfig(**(fields | overrides))


@pytest.fixture(scope="module")
def model():
    cfg = tiny()
    graphdef = model_lib.abstract(cfg)[0]
    return graphdef, model_lib.init_params(cfg, jax.random.PRNGKey(0))


def full_logits(graphdef, params, tokens_t):
    tokens_bt = jnp.asarray(tokens_t, jnp.int32)[None]
    positions = jnp.arange(tokens_bt.shape[1], dtype=jnp.int32)[None]
    return np.asarray(nnx.merge(graphdef, params)(tokens_bt, positions, jnp.ones_like(tokens_bt))[0])


def test_greedy_is_the_argmax_of_the_full_forward_pass_at_every_step(model):
    graphdef, params = model
    tokens, n = generate_tokens(graphdef, params, jnp.asarray(PROMPT), jax.random.PRNGKey(0), -1, NEW, 0.0, 1.0)
    assert int(n) == NEW
    sequence = np.concatenate([PROMPT, np.asarray(tokens)])
    logits = full_logits(graphdef, params, sequence)
    expected = logits[len(PROMPT) - 1: -1].argmax(-1)
    np.testing.assert_array_equal(np.asarray(tokens), expected)
    assert len(set(expected.tolist())) > 1  # a loop that repeats one token would prove little


def test_the_continuation_stops_at_eos(model):
    graphdef, params = model
    tokens, _ = generate_tokens(graphdef, params, jnp.asarray(PROMPT), jax.random.PRNGKey(0), -1, NEW, 0.0, 1.0)
    eos = int(tokens[3])  # pretend the fourth greedy token is the end of the text
    first = int(np.flatnonzero(np.asarray(tokens) == eos)[0])
    stopped, n = generate_tokens(graphdef, params, jnp.asarray(PROMPT), jax.random.PRNGKey(0), eos, NEW, 0.0, 1.0)
    assert int(n) == first + 1
    np.testing.assert_array_equal(np.asarray(stopped)[: first + 1], np.asarray(tokens)[: first + 1])


def test_sampling_follows_the_seed_and_top_p():
    logits = jnp.asarray([0.0, 3.0, 1.0, 2.9])
    draws = [int(pick(logits, jax.random.PRNGKey(s), 1.0, 1.0)) for s in range(200)]
    assert set(draws) == {0, 1, 2, 3}
    assert draws == [int(pick(logits, jax.random.PRNGKey(s), 1.0, 1.0)) for s in range(200)]
    # top_p keeps the smallest set of tokens whose probabilities reach it: here tokens 1 and 3 (0.48 + 0.43).
    nucleus = {int(pick(logits, jax.random.PRNGKey(s), 1.0, 0.8)) for s in range(200)}
    assert nucleus == {1, 3}
    assert {int(pick(logits, jax.random.PRNGKey(s), 5.0, 1e-6)) for s in range(50)} == {1}
