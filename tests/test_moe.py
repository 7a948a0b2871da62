"""The mixture-of-experts block against per-token references, and expert parallelism against one device.

The layer tests run the block outside any mesh; the training tests train 3 steps (fp32) on up to 8 simulated devices,
with the experts split over `expert`, and compare with one device within 1e-5 (tests/equivalence.py: every step's
loss and gradient norm, the final parameters and Adam moments; and the router's metrics).
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scaletrain import config, remat
from scaletrain.models.layers import RMSNorm
from scaletrain.models.mixtral import moe
from scaletrain.models.transformer import ModelConfig
from scaletrain.planner import hlo, roofline
from scaletrain.train import trainer
from tests import equivalence
from tests.conftest import tiny_overrides

STEPS = 3
E, K = 8, 2
MOE = [f"model.num_experts={E}", f"model.experts_per_token={K}", "model.moe_d_ff=64"]


def _layer(capacity_factor=0.0, d=16, f=32, experts=4, k=2, moe_matmul="auto"):
    cfg = ModelConfig.from_config(dict(d_model=d, num_experts=experts, experts_per_token=k, moe_d_ff=f,
                                       capacity_factor=capacity_factor, dtype="float32", moe_matmul=moe_matmul))
    block = moe.MoE(cfg, nnx.Rngs(0))
    norm = RMSNorm(d, cfg.norm_eps, jnp.float32)
    norm.scale[...] = 1 + 0.1 * jax.random.normal(jax.random.PRNGKey(3), (d,))
    return block, norm


def _swiglu(h, w_gate, w_up, w_down):
    return (jax.nn.silu(h @ w_gate) * (h @ w_up)) @ w_down


def _reference(block, norm, x_btd, kept=None):
    """Each token through its top-k experts one at a time, weighted by its renormalised probabilities;
    `kept[b, t, j]` False drops the token's j-th choice."""
    k = block.k
    h = norm(x_btd)
    probs = jax.nn.softmax(h @ block.router[...], axis=-1)
    top = jnp.argsort(-probs, axis=-1)[..., :k]
    p = jnp.take_along_axis(probs, top, axis=-1)
    weights = p / p.sum(-1, keepdims=True)

    def token(h_d, top_k, w_k, kept_k):  # one token: its k experts' weights gathered, each applied in turn
        outs = jax.vmap(lambda e: _swiglu(h_d, block.w_gate[...][e], block.w_up[...][e], block.w_down[...][e]))(
            top_k)
        return jnp.sum((w_k * kept_k)[:, None] * outs, axis=0)

    kept = jnp.ones(top.shape, bool) if kept is None else kept
    flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731
    return jax.vmap(token)(flat(h), flat(top), flat(weights), flat(kept)).reshape(x_btd.shape)


def _run(fn, block, norm, x):
    """fn(block, norm, x), compiled (op by op, the references take seconds)."""
    graphdef, params = nnx.split((block, norm))
    return jax.jit(lambda params, x: fn(*nnx.merge(graphdef, params), x))(params, x)


def _grads(fn, block, norm, x, cotangent):
    graphdef, params = nnx.split((block, norm), nnx.Param)

    def loss(params, x):
        b, n = nnx.merge(graphdef, params)
        return jnp.sum(fn(b, n, x) * cotangent)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)


def _block(block, norm, x):
    return block(x, norm)


def _assert_trees_close(got, want, tol=1e-5):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) <= tol * max(np.linalg.norm(b), 1e-12), jax.tree_util.keystr(path)


@pytest.mark.parametrize("moe_matmul", ["ragged_dot", "megablox"])
def test_dropless_block_equals_each_token_through_its_experts(moe_matmul):
    """Through XLA's ragged dot and megablox's kernels (interpreted here: model.moe_matmul)."""
    block, norm = _layer(moe_matmul=moe_matmul)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 12, 16))
    cot = jax.random.normal(jax.random.PRNGKey(2), x.shape)
    out, stats = _run(_block, block, norm, x)
    np.testing.assert_allclose(out, _run(_reference, block, norm, x), rtol=1e-5, atol=1e-6)
    assert stats["dropped"] == 0 and stats["load"].sum() == 2 * 12 * block.k
    got = _grads(lambda b, n, x: b(x, n)[0], block, norm, x, cot)
    want = _grads(_reference, block, norm, x, cot)
    _assert_trees_close(got, want)


def test_megablox_rows_past_the_groups_reach_nothing():
    """Expert parallelism's receive buffer holds rows past the groups, which megablox's kernels leave unwritten
    (NaN when interpreted) in the product and in the input's gradient: the groups' rows, the weights' and the
    biases' gradients are ragged_dot's all the same."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((48, 16)), jnp.float32)
    experts = tuple(jnp.asarray(rng.standard_normal(shape) * 0.1, jnp.float32)
                    for shape in [(4, 16, 32), (4, 16, 32), (4, 32, 16), (4, 32), (4, 32), (4, 16)])
    sizes, inside = jnp.array([5, 0, 20, 10]), 35  # of 48 rows

    def loss(kernel):
        grouped = moe._GroupedMatmul(None, (), (), kernel=kernel)
        return lambda x, experts: jnp.sum(jnp.sin(grouped.swiglu(x, sizes, experts)[:inside]))

    (got, got_grads), (want, want_grads) = (jax.value_and_grad(loss(k), (0, 1))(x, experts)
                                            for k in ("megablox", "ragged_dot"))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    _assert_trees_close((got_grads[0][:inside], got_grads[1]), (want_grads[0][:inside], want_grads[1]))


def test_dropless_block_moves_rows_by_gathers_in_both_passes():
    """The rows sorted to their experts and back are permutations, moved by gathers forward and backward: a
    scatter of [rows, d] (a forward `zeros.at[order].set`, or autodiff's transpose of a gather) compiles on TPU
    to 32-bit buffers, three live per mixture layer's backward pass. Only the [rows] index inverse scatters."""
    block, norm = _layer()
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 12, 16))
    graphdef, params = nnx.split((block, norm), nnx.Param)

    def loss(params, x):
        b, n = nnx.merge(graphdef, params)
        return jnp.sum(b(x, n)[0] ** 2)

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).as_text()
    results = re.findall(r"stablehlo\.scatter.*?\) -> tensor<([0-9x]+)x[a-z]", hlo, re.S)
    assert results and not [r for r in results if r.endswith(f"x{x.shape[-1]}")], results


def _capacity_rule(top, capacity):
    """The documented rule, slowly: per sequence, first choices before second ones, each in position order,
    and an expert takes assignments while it has room."""
    b, t, k = top.shape
    kept = np.zeros(top.shape, bool)
    for s in range(b):
        used = {}
        for j in range(k):
            for p in range(t):
                e = int(top[s, p, j])
                if used.get(e, 0) < capacity:
                    kept[s, p, j] = True
                    used[e] = used.get(e, 0) + 1
    return kept


def test_capacity_drops_exactly_the_assignments_the_rule_names():
    block, norm = _layer(capacity_factor=0.5)
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 16, 16))
    h = norm(x)
    top = np.asarray(jnp.argsort(-(h @ block.router[...]), axis=-1)[..., :block.k])
    capacity = math.ceil(0.5 * 16 * block.k / 4)
    kept = _capacity_rule(top, capacity)
    assert 0 < (~kept).sum() < kept.size  # the case drops some, not all
    out, stats = _run(_block, block, norm, x)
    assert stats["dropped"] == (~kept).sum()
    want = _run(lambda b, n, x: _reference(b, n, x, jnp.asarray(kept)), block, norm, x)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    cot = jax.random.normal(jax.random.PRNGKey(2), x.shape)
    got = _grads(lambda b, n, x: b(x, n)[0], block, norm, x, cot)
    want = _grads(lambda b, n, x: _reference(b, n, x, jnp.asarray(kept)), block, norm, x, cot)
    _assert_trees_close(got, want)


def test_router_losses_are_the_documented_formulas():
    block, norm = _layer()
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 12, 16))
    _, stats = _run(_block, block, norm, x)
    logits = norm(x) @ block.router[...]
    probs = jax.nn.softmax(logits, -1)
    top = jnp.argsort(-probs, -1)[..., :block.k]
    share = jax.nn.one_hot(top, 4).sum((1, 2)) / (12 * block.k)  # [b, E]
    aux = 4 * jnp.sum(share * probs.mean(1), -1)  # per sequence
    np.testing.assert_allclose(stats["aux"], 12 * aux.sum(), rtol=1e-5)
    np.testing.assert_allclose(stats["z"], jnp.sum(jax.nn.logsumexp(logits, -1) ** 2), rtol=1e-5)


def test_moe_checkpoint_names_are_remat_names():
    assert {"moe_gate", "moe_up"} <= set(remat.NAMES)
    block, norm = _layer()
    x = jnp.ones((1, 4, 16))
    text = str(jax.make_jaxpr(lambda x: block(x, norm))(x))
    assert "name=moe_gate" in text and "name=moe_up" in text and "name=mlp_out" in text


@pytest.fixture(scope="module")
@equivalence.computed_once
def reference(batches):
    return equivalence.reference(batches, *MOE)


@pytest.fixture(scope="module")
@equivalence.computed_once
def capacity_reference(batches):
    return equivalence.reference(batches, *MOE, *CAPACITY)


ROUTER = ("router_aux_loss", "router_z_loss", "expert_load_max", "dropped_fraction")


def assert_like(got, want):
    """The harness's comparison, and the last step's router metrics."""
    equivalence.assert_same(got, want)
    for key in ROUTER:
        np.testing.assert_allclose(got.metrics[-1][key], want.metrics[-1][key], rtol=1e-5, atol=1e-7)


MESHES = {  # on as many devices as the mesh has; expert=2 alone is test_accumulated_microbatches_equal_the_batch's
    "expert=4": ["mesh.expert=4"],
    "expert=8": ["mesh.expert=8"],
    "expert=4 x tensor=2": ["mesh.expert=4", "mesh.tensor=2"],
    "data=2 x fsdp=2 x expert=2, full remat, megablox": ["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2",
                                                          "remat.policy=full", "model.moe_matmul=megablox"],
    "fsdp=4 x expert=2, offloaded": ["mesh.fsdp=4", "mesh.expert=2", "params.offload=true", "optim.offload=true"],
}
# Capacity buffers, and a dense layer before each MoE layer (moe_every=2).
CAPACITY = ["model.capacity_factor=1.0", "model.moe_every=2"]


@pytest.mark.parametrize("mesh", MESHES.values(), ids=MESHES.keys())
def test_expert_parallel_training_equals_one_device(batches, reference, mesh):
    run = equivalence.run(batches, *MOE, *mesh)
    assert_like(run, reference)
    setup, metrics = run.setup, run.metrics[-1]
    ways = setup.mesh.shape["expert"]
    assert setup.state_shardings.params["layers"]["mlp"]["w_gate"].spec[1] == "expert"
    assert metrics["router_aux_loss"] >= 1 and metrics["expert_load_max"] >= 1 and ways > 1


def test_capacity_and_interleaved_dense_layers_equal_one_device(batches, capacity_reference):
    run = equivalence.run(batches, *MOE, *CAPACITY, "mesh.expert=4", "mesh.fsdp=2")
    equivalence.assert_same(run, capacity_reference)
    assert 0 < run.metrics[-1]["dropped_fraction"] == pytest.approx(capacity_reference.metrics[-1]["dropped_fraction"])


def test_all_to_alls_per_moe_layer_move_the_predicted_bytes():
    """Each MoE layer dispatches and combines by all-to-all, and the backward pass transposes both: 4 per layer,
    each moving the padded buffer [shards, tokens x k, d] (XLA:CPU has no ragged all-to-all)."""
    expert, fsdp = 2, 4
    cfg = config.load(None, tiny_overrides("unused") + MOE + [f"mesh.expert={expert}", f"mesh.fsdp={fsdp}"])
    setup = trainer.build(cfg, jax.devices())
    text = equivalence.compiled_step(setup).as_text()
    exchanges = [c for c in hlo.inventory(text, setup.mesh) if c.kind == "all-to-all" and c.axes == ("expert",)]
    tokens = cfg.train.global_batch * cfg.data.seq_len // (expert * fsdp)
    assert sum(c.count for c in exchanges) == 4 * cfg.model.num_layers
    assert {c.full_bytes for c in exchanges} == {expert * tokens * K * cfg.model.d_model * 4}
    assert {c.phase for c in exchanges} == {"forward", "backward"} and {c.loops for c in exchanges} == {(2,)}
    # The planner predicts them: the same count, V the expert axis's devices' buffers together.
    (planned,) = [t for t in roofline.plan(cfg, "cpu:8")["collectives"]
                  if t["axis"] == "expert" and t["kind"] == "all-to-all"]
    assert (planned["count"], planned["full_bytes"]) == (4 * cfg.model.num_layers, expert * exchanges[0].full_bytes)


@pytest.mark.parametrize("overrides, message", [
    (["mesh.expert=2"], "needs a mixture-of-experts model"),
    (MOE + ["mesh.expert=3"], "not divisible by mesh.expert=3"),
    (MOE + ["model.moe_matmul=megablox", "model.quantization=int8"], "megablox's kernels multiply in the compute"),
])
def test_expert_refusals_name_the_keys(overrides, message):
    from scaletrain.errors import ConfigError
    from scaletrain.parallel import checks

    with pytest.raises(ConfigError, match=message):
        cfg = config.load(None, tiny_overrides("unused") + overrides)
        checks.check(cfg, {a: cfg.mesh[a] for a in config.MESH_AXES})


def test_decoding_with_a_kv_cache_equals_the_forward_pass():
    """Through a group (moe_every=2): a dense block's decode, then a mixture of experts' decode."""
    from scaletrain.models.mixtral import Mixtral as Llama

    cfg = ModelConfig.from_config(dict(num_experts=4, experts_per_token=2, moe_every=2, num_layers=2,
                                       d_model=32, num_heads=2, num_kv_heads=1, head_dim=16, d_ff=64,
                                       dtype="float32"))
    model = Llama(cfg, nnx.Rngs(0))
    tokens = jnp.arange(6)[None] * 7 % cfg.vocab_size
    positions, segments = jnp.arange(6)[None], jnp.ones((1, 6), jnp.int32)
    want = nnx.jit(lambda m, *a: m(*a))(model, tokens, positions, segments)
    decode = nnx.jit(lambda m, *a: m.decode(*a))
    logits, cache = decode(model, tokens[:, :4], jnp.int32(0), model.init_cache(1, 8))
    for i in (4, 5):
        step, cache = decode(model, tokens[:, i:i + 1], jnp.int32(i), cache)
        logits = jnp.concatenate([logits, step], axis=1)
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)


def test_accumulated_microbatches_equal_the_batch(batches, reference):
    """The router's losses are sums over tokens like the cross-entropy: microbatches add up to their batch (on
    expert=2 alone, which this also proves equal to one device)."""
    run = equivalence.run(batches, *MOE, "mesh.expert=2", "train.grad_accum_steps=2")
    equivalence.assert_same(run, reference)
    np.testing.assert_allclose(run.metrics[-1]["router_aux_loss"], reference.metrics[-1]["router_aux_loss"],
                               rtol=1e-5)
