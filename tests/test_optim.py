import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from scaletrain import config
from scaletrain.errors import ConfigError
from scaletrain.models import ModelConfig, abstract
from scaletrain.train import optim, trainer
from tests import equivalence
from tests.conftest import tiny_overrides


def test_weight_decay_skips_norms_and_embeddings_unless_asked():
    cfg = config.load(None, [])
    _, _, logical = abstract(ModelConfig.from_config(cfg.model))
    mask = optim.decay_mask(cfg.optim, logical)
    assert mask["layers"]["attn"]["wq"] and mask["layers"]["mlp"]["w_down"]
    assert not mask["layers"]["attn_norm"]["scale"] and not mask["final_norm"]["scale"]
    assert not mask["embed"]["table"] and not mask["lm_head"]
    both = config.load(None, ["optim.decay_norms=true", "optim.decay_embeddings=true"])
    mask = optim.decay_mask(both.optim, logical)
    assert mask["final_norm"]["scale"] and mask["embed"]["table"]


def test_warmup_then_cosine_to_the_floor():
    cfg = config.load(None, ["optim.learning_rate=1.0", "optim.warmup_steps=10", "optim.min_lr_ratio=0.1"])
    lr = optim.schedule(cfg.optim, 110)
    assert float(lr(0)) == 0.0
    assert float(lr(5)) == pytest.approx(0.5)
    assert float(lr(10)) == pytest.approx(1.0)
    assert float(lr(60)) == pytest.approx(0.55, rel=1e-4)
    assert float(lr(110)) == pytest.approx(0.1)
    assert np.all(np.diff([float(lr(s)) for s in range(10, 111)]) <= 1e-7)


STEPS = 1  # the `batches` fixture's count


def _dtypes(opt_state) -> set:
    adam = opt_state[0]
    return {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))}


def test_float32_moments_of_bfloat16_parameters_compute_in_float32():
    """moments_in(float32, adamw) on bfloat16 parameters is adamw on their float32 values (the same moments,
    bitwise), its updates too (float32: apply_updates rounds parameter + update once); tree_map_params still finds
    the moments."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(4, 8)), jnp.bfloat16),
              "b": jnp.asarray(rng.normal(size=8), jnp.bfloat16)}
    adamw = optax.adamw(1e-2, b2=0.95, weight_decay=0.1)
    tx = optim.moments_in(jnp.float32, adamw)
    state, ref_state = tx.init(params), adamw.init(jax.tree.map(lambda p: p.astype(jnp.float32), params))
    for _ in range(2):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.bfloat16), params)
        updates, state = tx.update(grads, state, params)  # op by op, as the reference: no fusion to differ
        wide = jax.tree.map(lambda x: x.astype(jnp.float32), (grads, params))
        ref_updates, ref_state = adamw.update(wide[0], ref_state, wide[1])
        assert {u.dtype for u in jax.tree.leaves(updates)} == {jnp.dtype(jnp.float32)}
        for a, b in zip(jax.tree.leaves((updates, state)), jax.tree.leaves((ref_updates, ref_state))):
            np.testing.assert_array_equal(a, b.astype(a.dtype))
        params = optax.apply_updates(params, updates)
        assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    assert _dtypes(state) == {jnp.dtype(jnp.float32)}
    names = optax.tree_utils.tree_map_params(tx, lambda _, n: n, state, {"w": "W", "b": "B"},
                                             transform_non_params=lambda _: None)
    assert names[0].mu == names[0].nu == {"w": "W", "b": "B"}


def test_moments_stay_float32_with_bfloat16_parameters(batches):
    """The default optim.moment_dtype: float32 moments for bfloat16 parameters, through a real step (the step
    donates the state and fixes its shardings: a moment whose dtype drifted would not come back in it)."""
    cfg = config.load(None, tiny_overrides("unused", steps=STEPS) + ["mesh.fsdp=8", "model.param_dtype=bfloat16"])
    setup = trainer.build(cfg, jax.devices())
    assert _dtypes(setup.abstract_state.opt_state) == {jnp.dtype(jnp.float32)}
    state = setup.init(jax.random.PRNGKey(0))
    assert _dtypes(state.opt_state) == {jnp.dtype(jnp.float32)}
    step = equivalence.compiled_step(setup)  # as equivalence.run
    state, metrics = step(state, setup.put_batch(batches[0]), setup.loss_ceiling())
    assert np.isfinite(float(metrics["loss"])) and float(metrics["update_skipped"]) == 0.0
    assert _dtypes(state.opt_state) == {jnp.dtype(jnp.float32)}
    assert {p.dtype for p in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    assert all(np.any(np.asarray(m, np.float32) != 0) for m in jax.tree.leaves(state.opt_state[0].nu))


def test_bfloat16_moments_of_float32_parameters():
    cfg = config.load(None, tiny_overrides("unused", steps=STEPS) + ["mesh.fsdp=8", "optim.moment_dtype=bfloat16"])
    setup = trainer.build(cfg, jax.devices())
    assert _dtypes(setup.abstract_state.opt_state) == {jnp.dtype(jnp.bfloat16)}
    state, _ = jax.eval_shape(setup.step, *setup.abstract_args())  # traced, not compiled
    assert _dtypes(state.opt_state) == {jnp.dtype(jnp.bfloat16)}
    assert {p.dtype for p in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}


def test_moment_dtype_is_checked():
    with pytest.raises(ConfigError, match="optim.moment_dtype must be one of float32, bfloat16; got 'float16'"):
        config.load(None, ["optim.moment_dtype=float16"])
