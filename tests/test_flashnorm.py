"""FlashNorm: the fused RMSNorm + matmul kernels, TPU (Mosaic) and GPU (Triton), against their jnp twin
(interpret mode); the TPU ones free of races on a simulated megacore and compiled by Mosaic for TPU generations
ahead of time, the GPU ones lowered to Triton for CUDA; and the model trains alike in every model.norm mode on a
sharded mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from scaletrain import config
from scaletrain.kernels import norm_matmul as nm
from scaletrain.kernels import norm_matmul_tpu as tpu
from tests.conftest import lower_for_cuda, tiny_overrides, train_steps
from tests.numerics import assert_close, assert_trees_close

EPS = 1e-5
# Small blocks, so that every grid axis and every in-kernel loop has several steps; no dimension below is a
# block multiple. At most 8 rows take the decode kernel (tests/test_flashnorm_decode.py); more, the tiled one.
BLOCKS = nm.Blocks(m=16, n=128, k=128, compiled=False, decode_rows=8, decode_n=128)
KERNELS = {"tpu": BLOCKS, "gpu": nm.GpuBlocks(m=16, n=32, k=16, compiled=False, decode_rows=8)}


def _operands(m, k, n, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(ks[0], (m, k), jnp.float32).astype(dtype)
    g = (1 + 0.2 * jax.random.normal(ks[1], (k,))).astype(dtype)
    w = (0.05 * jax.random.normal(ks[2], (k, n))).astype(dtype)
    dz = jax.random.normal(ks[3], (m, n), jnp.float32).astype(dtype)
    return x, g, w, dz


def _relative(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _value_and_grads(fn, x, g, w, dz):
    z, vjp = jax.vjp(fn, x, g, w)
    return (z, *vjp(dz))


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("dtype, tol, shape", [(jnp.float32, 1e-5, (40, 200, 300)), (jnp.float32, 1e-5, (8, 384, 256)),
                                               (jnp.bfloat16, 1e-2, (40, 200, 300))])
def test_kernels_equal_the_reference(dtype, tol, shape, kernels):
    """Forward, dx, dg and dW, each against jax.vjp of the jnp reference (norm, then matmul)."""
    x, g, w, dz = _operands(*shape, dtype)
    blocks = KERNELS[kernels]
    fused = _value_and_grads(lambda x, g, w: nm.norm_matmul(x, g, w, EPS, blocks=blocks), x, g, w, dz)
    reference = _value_and_grads(lambda x, g, w: nm.reference(x, g, w, EPS), x, g, w, dz)
    for name, got, want in zip(("z", "dx", "dg", "dW"), fused, reference):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert _relative(got, want) <= tol, (name, _relative(got, want))


@pytest.mark.parametrize("kernels", KERNELS)
def test_float32_logits_from_bfloat16_inputs(kernels):
    x, g, w, _ = _operands(24, 256, 384, jnp.bfloat16)
    got = nm.norm_matmul(x, g, w, EPS, out_dtype=jnp.float32, blocks=KERNELS[kernels])
    assert got.dtype == jnp.float32
    assert _relative(got, nm.reference(x, g, w, EPS, out_dtype=jnp.float32)) <= 1e-2


def _races_found() -> bool:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    return bool(interpret_pallas_call.races is not None and interpret_pallas_call.races.races_found)


# A race is recorded (_races_found) and the kernel run to its end, its output checked too: jax 0.12 raises on the first
# race unless told to warn.
MEGACORE = pltpu.InterpretParams(detect_races=True, on_race="warn", num_cores_or_threads=2, uninitialized_memory="nan")


def test_no_race_and_no_nan_on_a_simulated_megacore():
    """TPU interpret mode with two cores splitting the "parallel" grid axes, uninitialised memory as NaN."""
    x, g, w, dz = _operands(40, 300, 260, jnp.float32)
    with tpu.interpret_mode(MEGACORE):
        fused = _value_and_grads(lambda x, g, w: nm.norm_matmul(x, g, w, EPS, blocks=BLOCKS), x, g, w, dz)
        fused = [np.asarray(a) for a in fused]
    assert not _races_found()
    reference = _value_and_grads(lambda x, g, w: nm.reference(x, g, w, EPS), x, g, w, dz)
    for got, want in zip(fused, reference):
        assert np.isfinite(got).all()
        assert _relative(got, want) <= 1e-5


def test_a_state_carrying_axis_marked_parallel_is_caught():
    """The check above can fail: with the K axis (which carries the accumulators) marked "parallel", the
    second core starts from uninitialised scratch."""
    x, g, w, _ = _operands(32, 256, 256, jnp.float32)
    with tpu.interpret_mode(MEGACORE):
        bad = np.asarray(tpu.forward(x, g, w, EPS, BLOCKS, jnp.float32, semantics=("parallel",) * 3))
    assert np.isnan(bad).any() or _races_found()


@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1", "v6e:2x2"])
def test_mosaic_compiles_the_kernels_for_tpu_at_llama3_8b_shapes(topology):
    """Forward and backward at one device's share of Llama-3-8B (8192 tokens, d_model 4096) with the
    generation's block sizes: gate/up (N = 2 x 14336, the widest) everywhere, and on v5p the Q/K/V projection
    (N = (32 + 2 x 8) x 128) too (compiles cost CI time)."""
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    device = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices[0]
    blocks = nm.blocks_for(device)
    assert blocks.compiled and blocks == tpu.GENERATIONS[topology.split(":")[0]]
    sharding = NamedSharding(jax.sharding.Mesh(np.array([device]), ("d",)), PartitionSpec())
    m, k = 8192, 4096
    for n in (6144, 2 * 14336) if topology.startswith("v5p") else (2 * 14336,):
        assert tpu.vmem_bytes(m, n, k, blocks) <= blocks.vmem_limit_bytes
        shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in ((m, k), (k,), (k, n), (m, n))]

        def step(x, g, w, dz):
            return _value_and_grads(lambda x, g, w: nm.norm_matmul(x, g, w, EPS, blocks=blocks), x, g, w, dz)

        text = jax.jit(step).lower(*shapes).compile().as_text()
        assert text.count("tpu_custom_call") >= 3  # forward, dx/dg, dW: Mosaic kernels, not interpreted


def test_the_gpu_kernels_lower_to_triton_for_cuda_at_llama3_8b_shapes():
    """Pallas writes the Triton IR on the CPU (for compute capability 9.0): every kernel's loads, dots and
    stores must pass Triton's rules (power-of-two tensors, dot sides of 16 and more) at real shapes with the
    default blocks. Compiling the IR to PTX needs a GPU (`make bench-gpu`)."""
    m, k, n = 8192, 4096, 2 * 14336
    shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k,), (k, n), (m, n))]

    def step(x, g, w, dz):
        return _value_and_grads(lambda x, g, w: nm.norm_matmul(x, g, w, EPS, blocks=nm.GpuBlocks()), x, g, w, dz)

    assert lower_for_cuda(step, *shapes).count("__gpu$xla.gpu.triton") == 3  # forward, dx/dg, dW


STEPS = 3


def _train(batches, norm):
    # optim.eps = the learning rate (3e-3): with the default 1e-8, Adam turns a rounding difference in a gradient
    # entry near 1e-8 into one of up to lr (tests/test_loss.py's fused-loss training measured 1.7e-5); with eps = lr
    # an update moves by at most as much as its gradient, and the parameters differ by their rounding.
    return train_steps(batches, ["mesh.fsdp=4", "mesh.tensor=2", f"model.norm={norm}", "optim.eps=3e-3"])


@pytest.fixture(scope="module")
def standard(batches):
    return _train(batches, "standard")


@pytest.mark.parametrize("norm", ["deferred", "fused"])
def test_the_model_trains_alike_in_every_norm_mode(batches, standard, norm):
    """fsdp=4 x tensor=2, fp32: the fused kernels run per device under shard_map; gradients of the gains
    (replicated inside it) are summed over the devices by shard_map's transpose."""
    losses, params = _train(batches, norm)
    # Rounding apart: 16 ulps of each loss and of each parameter array's scale (measured: at most 1.7). A wrong
    # gradient (a gain's not summed over the devices) moves the updates by a share of lr, 10^3 times more.
    assert_close(losses, standard[0], ulps=16)
    assert_trees_close(params, standard[1], ulps=16)


def test_folding_the_gains_keeps_the_function():
    """Gains far from 1 (a trained model's are), folded in float32 into a weightless-norm model: the same
    logits within 1e-5, for standard and fused norms and untied and tied embeddings."""
    from flax import nnx

    from scaletrain import models as model_lib
    from scaletrain.tools import inference

    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 32), 0, 384)
    positions = jnp.broadcast_to(jnp.arange(32), tokens.shape)

    def logits(model_cfg, params):
        graphdef = model_lib.abstract(model_cfg)[0]
        return np.asarray(nnx.merge(graphdef, params)(tokens, positions, jnp.ones_like(tokens)))

    for tied in (False, True):
        cfg = config.load(None, tiny_overrides("unused") + [f"model.tie_embeddings={tied}"])
        model_cfg = model_lib.ModelConfig.from_config(cfg.model)
        params = model_lib.init_params(model_cfg, jax.random.PRNGKey(0))
        keys = iter(jax.random.split(jax.random.PRNGKey(2), 8))
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: 1 + 0.5 * jax.random.normal(next(keys), x.shape) if "scale" in jax.tree_util.keystr(p)
            else x, params)
        want = logits(model_cfg, params)
        folded = inference.fold(params, tied)
        assert ("final_norm" in folded) == tied and "attn_norm" not in folded["layers"]
        for norm in ("standard", "fused"):
            folded_cfg = model_lib.ModelConfig.from_config(cfg.model, norm_weights="folded", norm=norm)
            # Folding rounds each gain x weight once; then ~12 reductions in each order: 32 ulps of the logits'
            # scale (measured: 3; was atol 1e-5, ~50-100 ulps). A gain missed or misplaced moves them by ~10%.
            assert_close(logits(folded_cfg, folded), want, ulps=32)


def test_fold_norms_and_logits_commands(tmp_path, capfd):
    """Trained on one device in a process of its own; the commands then as the command line runs them
    (scaletrain.__main__.main), in this process (conftest.run_main): three process starts spared."""
    from tests.conftest import run_cli, run_main

    run, folded = tmp_path / "run", tmp_path / "folded"
    done = run_cli(["--config", "configs/llama_tiny.yaml", *sum((["--set", o] for o in tiny_overrides(run, steps=3)),
                                                                 ["--set", "checkpoint.every_steps=3"])])
    assert done.returncode == 0, done.stderr
    done = run_main(["convert", "fold-norms", "--run-dir", str(run), "--out", str(folded)], capfd, module=True)
    assert done.returncode == 0, done.stderr
    assert "norm_weights: folded" in (folded / "config.yaml").read_text()
    np.save(tmp_path / "tokens.npy", np.random.RandomState(0).randint(0, 384, (2, 16)))
    outputs = []
    for source, extra in ((run, []), (folded, ["--set", "model.norm=fused"])):
        out = tmp_path / f"logits{len(outputs)}.npy"
        done = run_main(["logits", "--run-dir", str(source), "--tokens", str(tmp_path / "tokens.npy"), "--out",
                         str(out), *extra], capfd, module=True)
        assert done.returncode == 0, done.stderr
        outputs.append(np.load(out))
    assert outputs[0].shape == (2, 16, 384) and outputs[0].dtype == np.float32
    for other in outputs[1:]:
        assert_close(other, outputs[0], ulps=32)  # as test_folding_the_gains_keeps_the_function
    # Refusals, in process (the CLI turns a UserError into one `error:` line and exit 2: tests/test_cli.py).
    from scaletrain.errors import UserError
    from scaletrain.tools import inference

    np.save(tmp_path / "bad.npy", np.full((2, 16), 384))
    with pytest.raises(UserError, match="ids must lie in"):
        inference.read_tokens(str(tmp_path / "bad.npy"), 384)
    with pytest.raises(UserError, match="already has model.norm_weights=folded"):
        inference.fold_norms(str(folded), str(tmp_path / "again"))


def test_norm_cancellation_with_qk_norms_keeps_the_function():
    """Q and K skip the input norm's 1/rms (their per-head norms of eps 0 undo it), V keeps it."""
    from flax import nnx

    from scaletrain import models as model_lib

    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 32), 0, 384)
    positions = jnp.broadcast_to(jnp.arange(32), tokens.shape)
    cfg = config.load(None, tiny_overrides("unused") + ["model.qk_norm=true", "model.qk_norm_eps=0"])
    params = model_lib.init_params(model_lib.ModelConfig.from_config(cfg.model), jax.random.PRNGKey(0))
    assert params["layers"]["attn"]["q_norm"]["scale"].shape == (2, 16)

    def logits(**fields):
        model_cfg = model_lib.ModelConfig.from_config(cfg.model, **fields)
        return np.asarray(nnx.merge(model_lib.abstract(model_cfg)[0], params)(tokens, positions, jnp.ones_like(tokens)))

    want = logits()
    for norm in ("standard", "fused"):
        # Q and K's norms see x instead of x / rms(x), V and the rest the same sums in each order: 32 ulps of the
        # logits' scale (measured: 3; was atol 1e-5, ~100 ulps).
        assert_close(logits(norm_cancellation=True, norm=norm), want, ulps=32)


@pytest.mark.parametrize("overrides, message", [
    (["model.norm_cancellation=true"], "needs model.qk_norm=true"),
    (["model.norm_cancellation=true", "model.qk_norm=true"], "exact only with model.qk_norm_eps=0"),
])
def test_norm_cancellation_refuses_models_that_do_not_qualify(overrides, message):
    from scaletrain.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        config.load(None, overrides)
