"""The model against plain numpy: RoPE (with Llama-3 scaling), grouped-query attention, the causal mask."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scaletrain.models import Llama, ModelConfig, abstract, rope
from scaletrain.models.attention import Attention
from scaletrain.models.layers import project
from scaletrain.parallel.sharding import LOGICAL_AXES
from tests.numerics import assert_close, assert_trees_close

CFG = ModelConfig.from_config(None, vocab_size=300, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                              head_dim=8, d_ff=64, dtype=jnp.float32)


def np_rope(x_btnh, positions_bt, inv_freq):
    """Rotate-half RoPE, written out pair by pair."""
    out = np.empty_like(x_btnh)
    half = x_btnh.shape[-1] // 2
    for b, t in np.ndindex(*positions_bt.shape):
        for i in range(half):
            a = positions_bt[b, t] * inv_freq[i]
            x1, x2 = x_btnh[b, t, :, i], x_btnh[b, t, :, i + half]
            out[b, t, :, i] = x1 * math.cos(a) - x2 * math.sin(a)
            out[b, t, :, i + half] = x2 * math.cos(a) + x1 * math.sin(a)
    return out


def test_rope_matches_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)
    pos = rng.integers(0, 100, size=(2, 5))
    inv_freq = rope.inverse_frequencies(8, 10000.0)
    np.testing.assert_allclose(inv_freq, [10000.0 ** (-i / 8) for i in (0, 2, 4, 6)], rtol=1e-6)
    sin, cos = rope.sin_cos(jnp.asarray(pos), inv_freq)
    np.testing.assert_allclose(rope.apply(jnp.asarray(x), sin, cos), np_rope(x, pos, inv_freq), atol=1e-4)


def test_llama3_frequency_scaling():
    # Llama 3.1: wavelengths above 8192/1 are divided by 8, below 8192/4 kept, smoothly blended between.
    base = rope.inverse_frequencies(128, 500000.0)
    scaled = rope.inverse_frequencies(128, 500000.0, "llama3", 8.0, 1.0, 4.0, 8192)
    wavelen = 2 * np.pi / base
    high = wavelen < 8192 / 4
    low = wavelen > 8192
    np.testing.assert_allclose(scaled[high], base[high])
    np.testing.assert_allclose(scaled[low], base[low] / 8, rtol=1e-6)
    mid = ~high & ~low
    assert mid.any()
    smooth = (8192 / wavelen[mid] - 1) / 3
    np.testing.assert_allclose(scaled[mid], (1 - smooth) * base[mid] / 8 + smooth * base[mid], rtol=1e-6)


def np_attention(x, wq, wk, wv, wo, positions, segments, inv_freq):
    """Each query head attends with its group's kv head to earlier keys of the same document."""
    q = np_rope(np.einsum("btd,dnh->btnh", x, wq), positions, inv_freq)
    k = np_rope(np.einsum("btd,dkh->btkh", x, wk), positions, inv_freq)
    v = np.einsum("btd,dkh->btkh", x, wv)
    b, t, n, h = q.shape
    group = n // k.shape[2]
    out = np.zeros_like(q)
    for bi, head, ti in np.ndindex(b, n, t):
        keys = [s for s in range(t) if s <= ti and segments[bi, s] == segments[bi, ti]]
        scores = np.array([q[bi, ti, head] @ k[bi, s, head // group] for s in keys]) / math.sqrt(h)
        p = np.exp(scores - scores.max())
        p /= p.sum()
        out[bi, ti, head] = sum(pi * v[bi, s, head // group] for pi, s in zip(p, keys))
    return np.einsum("btnh,nhd->btd", out, wo)


class _NoNorm:
    """Attention normalises its input with the norm it is given; these tests check attention alone."""

    def project(self, x, w, w_logical, out_dtype=None, quant=None):
        return project(x, w, out_dtype=out_dtype, quant=quant)

    def project_each(self, x, ws, out_dtype=None, quant=None):
        return tuple(self.project(x, w, logical, out_dtype, quant) for w, logical in ws)


NO_NORM = _NoNorm()


def test_grouped_query_causal_attention_matches_numpy():
    attn = Attention(CFG, nnx.Rngs(0))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 6, 32)).astype(np.float32)
    segments = np.array([[1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 1]])
    positions = np.array([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
    inv_freq = CFG.inverse_frequencies()
    sin, cos = rope.sin_cos(jnp.asarray(positions), inv_freq)
    got = attn(jnp.asarray(x), NO_NORM, sin, cos, jnp.asarray(segments))
    want = np_attention(x, *(np.asarray(w[...]) for w in (attn.wq, attn.wk, attn.wv, attn.wo)), positions,
                        segments, inv_freq)
    # numpy sums in its own order (float32 einsums, a loop over keys, float64 angles): 32 ulps of the output's
    # scale, 9e-8 here (measured: 3.3; was atol 1e-5, 3,500 ulps of this scale).
    assert_close(got, want, ulps=32)


def test_causal_mask_hides_the_future():
    model = Llama(CFG, nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 300, (1, 8)))
    pos, seg = jnp.arange(8)[None], jnp.ones((1, 8), jnp.int32)
    changed = tokens.at[0, 5].set((tokens[0, 5] + 1) % 300)
    a, b = model(tokens, pos, seg), model(changed, pos, seg)
    np.testing.assert_array_equal(a[0, :5], b[0, :5])
    assert not np.allclose(a[0, 5:], b[0, 5:])


def test_scanned_stack_equals_a_python_loop_over_layers():
    model = Llama(CFG, nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 300, (2, 8)))
    pos, seg = jnp.broadcast_to(jnp.arange(8), (2, 8)), jnp.ones((2, 8), jnp.int32)
    graphdef, stacked = nnx.split(model.layers)
    x = model.embed(tokens, jnp.float32)
    sin, cos = rope.sin_cos(pos, CFG.inverse_frequencies())
    for i in range(CFG.num_layers):
        layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], stacked))
        x, _ = layer(x, sin, cos, seg)  # a dense block has no auxiliary sums
    want = jnp.einsum("btd,dv->btv", model.final_norm(x), model.lm_head[...])
    # The same sums, scanned or not: 16 ulps of the logits' scale (measured: 1.3; was atol 1e-5, 210 ulps of it).
    assert_close(model(tokens, pos, seg), want, ulps=16)


def test_every_parameter_has_logical_axes_and_no_mesh_axes():
    _, shapes, logical = abstract(CFG)
    flat_shapes = jax.tree.leaves(shapes)
    flat_logical = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple))
    assert len(flat_shapes) == len(flat_logical)
    for s, names in zip(flat_shapes, flat_logical):
        assert len(names) == len(s.shape)
        assert set(names) <= set(LOGICAL_AXES)


def test_tied_embeddings_have_no_lm_head():
    import dataclasses

    _, shapes, _ = abstract(dataclasses.replace(CFG, tie_embeddings=True))
    assert "lm_head" not in shapes
    model = Llama(dataclasses.replace(CFG, tie_embeddings=True), nnx.Rngs(0))
    out = model(jnp.zeros((1, 4), jnp.int32), jnp.arange(4)[None], jnp.ones((1, 4), jnp.int32))
    assert out.shape == (1, 4, 300)


def test_project_equals_einsum():
    from scaletrain.models.layers import project

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(2, 3, 4, 5)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 5, 6)), jnp.float32)
    # Sums of 20 and 5 products, in whatever order each lowering picks: 8 ulps of the output's scale (measured:
    # 0.4). rtol alone failed any entry that is a near-cancellation on a CPU pairing the terms differently.
    assert_close(project(x, w, in_dims=2), jnp.einsum("btnh,nhd->btd", x, w), ulps=8)
    w2 = jnp.asarray(rng.normal(size=(5, 2, 3)), jnp.float32)
    assert_close(project(x, w2), jnp.einsum("btnh,hkd->btnkd", x, w2), ulps=8)


def test_blocked_attention_equals_full_attention_and_its_gradient():
    import dataclasses

    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(2, 16, 32)), jnp.float32)
    segments = jnp.asarray([[1] * 6 + [2] * 10, [1] * 16])
    positions = jnp.asarray([list(range(6)) + list(range(10)), list(range(16))])
    sin, cos = rope.sin_cos(positions, CFG.inverse_frequencies())
    full = Attention(CFG, nnx.Rngs(0))
    blocked = Attention(dataclasses.replace(CFG, attention_block=4), nnx.Rngs(0))

    def loss(module):
        graphdef, params = nnx.split(module)
        return lambda p: jnp.sum(nnx.merge(graphdef, p)(x, NO_NORM, sin, cos, segments) ** 2)

    # Online softmax over blocks of 4 keys against the whole: rounding apart, 16 ulps of each array's scale
    # (measured: 1.1 forward, 1.6 gradients). The former atol 1e-6 was 1.7% of wq's and wk's gradients (~6e-5).
    assert_close(blocked(x, NO_NORM, sin, cos, segments), full(x, NO_NORM, sin, cos, segments), ulps=16)
    grads = [jax.grad(loss(m))(nnx.split(m)[1]) for m in (blocked, full)]
    assert_trees_close(*grads, ulps=16)


def test_projections_are_one_matmul_only_where_tensor_splits_them():
    """Joined, Q/K/V and gate/up save the backward pass reduce-scatters under `tensor`; without it their sliced
    outputs cost the TPU relayout copies (docs/parallelism.md), so each projection is its own matmul."""
    from scaletrain import config
    from scaletrain.parallel import mesh, sharding

    model = Llama(CFG, nnx.Rngs(0))
    tokens = jnp.zeros((4, 8), jnp.int32)

    def dots(rules_mesh=None):
        def forward(tokens):
            if rules_mesh is None:
                return model(tokens, tokens, tokens)
            with sharding.use_rules(rules_mesh, sharding.rules_for("fsdp", True, True)):
                return model(tokens, tokens, tokens)
        return str(jax.make_jaxpr(forward)(tokens)).count("dot_general")

    tensor = mesh.make_mesh(config.load(None, ["mesh.fsdp=4", "mesh.tensor=2"]).mesh)
    fsdp = mesh.make_mesh(config.load(None, ["mesh.fsdp=8"]).mesh)
    assert dots() == dots(fsdp) == dots(tensor) + 3  # Q, K, V -> 1 and gate, up -> 1 in the scanned layer
