"""FlashNorm serving decode: the decode-shaped kernels (a few rows) against their jnp twin; the ordering race of
overlapping the norm's reduction with the matmul, caught in racy variants and absent from the shipped kernel;
Mosaic and Triton lowering at decode shapes; and greedy decoding giving the same tokens in every model.norm mode,
with and without folded gains, on a tiny model (and in the fused modes on a converted model of Llama-3.2-1B's
widths)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from scaletrain import models as model_lib
from scaletrain.kernels import norm_matmul as nm
from scaletrain.kernels import norm_matmul_tpu as tpu
from scaletrain.tools import inference
from scaletrain.tools.generate import compute_dtype_params, generate_tokens
from tests.conftest import lower_for_cuda
from tests.test_flashnorm import EPS, MEGACORE, _operands, _races_found, _relative

F32 = jnp.float32
# Small panels and in-kernel steps, so that the decode grid and its K loop take several steps at test sizes.
KERNELS = {"tpu": nm.Blocks(compiled=False, decode_n=128),
           "gpu": nm.GpuBlocks(compiled=False, decode_n=32, decode_k=32)}


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("dtype, tol, shape", [(F32, 1e-5, (1, 200, 300)), (F32, 1e-5, (5, 640, 384)),
                                               (jnp.bfloat16, 1e-2, (3, 640, 300))])
def test_the_decode_kernels_equal_the_reference(dtype, tol, shape, kernels):
    """A few rows (at most decode_rows) take the decode kernel; its output equals the reference's."""
    x, g, w, _ = _operands(*shape, dtype)
    assert shape[0] <= KERNELS[kernels].decode_rows
    got = nm.norm_matmul(x, g, w, EPS, out_dtype=F32, blocks=KERNELS[kernels])
    assert _relative(got, nm.reference(x, g, w, EPS, out_dtype=F32)) <= tol


# --- the race --------------------------------------------------------------------------------------------
# The ordering bug FlashNorm's authors hit: the norm's reduction overlaps the matmul, and the post-scale (or the
# matmul) does not wait for what it reads. On a TPU the overlap comes from a megacore's second TensorCore (it
# runs half of a "parallel" grid axis) or from an asynchronous copy. The TPU interpret mode finds both: it runs
# two simulated cores, fills uninitialised memory with NaN, performs a copy only when it is waited on, and
# reports unordered accesses. Two tempting variants of the decode kernel, each wrong:

BN = 128


def _r_computed_once(x_ref, g_ref, w_ref, out_ref, r_ref):
    """r computed at the first column block and kept in scratch for the others (it is the same for all)."""
    @pl.when(pl.program_id(0) == 0)
    def _():
        x = x_ref[...].astype(F32)
        r_ref[...] = jax.lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + EPS)

    xg = x_ref[...].astype(F32) * g_ref[...].astype(F32)
    out_ref[...] = jnp.dot(xg, w_ref[...], preferred_element_type=F32) * r_ref[...]


def _panel_copied_by_hand(x_ref, g_ref, w_hbm, out_ref, panel_ref, sem, *, wait_before_matmul: bool):
    """W's panel copied asynchronously while the reduction computes r; the matmul must wait for the copy."""
    copy = pltpu.make_async_copy(w_hbm.at[pl.program_id(0)], panel_ref, sem)
    copy.start()
    x = x_ref[...].astype(F32)
    r = jax.lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + EPS)
    if wait_before_matmul:
        copy.wait()
    out_ref[...] = jnp.dot(x * g_ref[...].astype(F32), panel_ref[...], preferred_element_type=F32) * r
    if not wait_before_matmul:
        copy.wait()


def _variant(kernel, x, g, w, semantics, scratch, w_by_hand=False):
    (m, k), n = x.shape, w.shape[1]
    if w_by_hand:  # left in HBM as [panels, K, BN]: the kernel copies its panel itself
        w, w_spec = w.reshape(k, n // BN, BN).transpose(1, 0, 2), pl.BlockSpec(memory_space=pl.ANY)
    else:
        w_spec = pl.BlockSpec((k, BN), lambda j: (0, j))
    return np.asarray(pl.pallas_call(
        kernel, grid=(n // BN,),
        in_specs=[pl.BlockSpec((m, k), lambda j: (0, 0)), pl.BlockSpec((1, k), lambda j: (0, 0)), w_spec],
        out_specs=pl.BlockSpec((m, BN), lambda j: (0, j)), out_shape=jax.ShapeDtypeStruct((m, n), F32),
        scratch_shapes=scratch, compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
        interpret=MEGACORE)(x, g.reshape(1, k), w))


@pytest.fixture(scope="module")
def operands():
    x, g, w, _ = _operands(8, 256, 4 * BN, F32)
    return x, g, w, np.asarray(nm.reference(x, g, w, EPS))


def test_the_shipped_decode_kernel_is_free_of_the_race(operands):
    """Two simulated cores split its column axis; copies land only when waited on; uninitialised memory is NaN."""
    x, g, w, want = operands
    with tpu.interpret_mode(MEGACORE):
        got = np.asarray(tpu.decode_forward(x, g, w, EPS, KERNELS["tpu"], F32))
    assert not _races_found()
    assert np.isfinite(got).all() and _relative(got, want) <= 1e-5


def test_r_carried_across_a_parallel_axis_is_caught(operands):
    """The second core starts at the middle column block and scales by scratch no one wrote: garbled rows.
    Run in order ("arbitrary"), the same kernel is right - at the cost of one core reading all of W."""
    x, g, w, want = operands
    scratch = [pltpu.VMEM((x.shape[0], 1), F32)]
    racy = _variant(_r_computed_once, x, g, w, ("parallel",), scratch)
    assert np.isnan(racy).any() or _races_found()
    in_order = _variant(_r_computed_once, x, g, w, ("arbitrary",), scratch)
    assert not _races_found() and _relative(in_order, want) <= 1e-5


def test_a_matmul_that_does_not_wait_for_its_copy_is_caught(operands):
    x, g, w, want = operands
    scratch = [pltpu.VMEM((x.shape[1], BN), F32), pltpu.SemaphoreType.DMA]
    racy = _variant(functools.partial(_panel_copied_by_hand, wait_before_matmul=False), x, g, w, ("parallel",),
                    scratch, w_by_hand=True)
    assert _races_found() and (np.isnan(racy).any() or _relative(np.nan_to_num(racy), want) > 0.1)
    ordered = _variant(functools.partial(_panel_copied_by_hand, wait_before_matmul=True), x, g, w, ("parallel",),
                       scratch, w_by_hand=True)
    assert not _races_found() and _relative(ordered, want) <= 1e-5


# --- lowering at decode shapes ---------------------------------------------------------------------------

# (K, N): Llama-3.2-1B's Q/K/V and gate/up, Llama-3.1-8B's gate/up.
DECODE_SHAPES = [(2048, (32 + 2 * 8) * 64), (2048, 2 * 8192), (4096, 2 * 14336)]


@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1"])
def test_mosaic_compiles_the_decode_kernel_at_llama_widths(topology):
    """The forward of 1 and 64 rows (batch 1 and 64 at one token each) through Mosaic, with the generation's
    decode panels: one custom call each, in the VMEM budget."""
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    device = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices[0]
    blocks = nm.blocks_for(device)
    sharding = NamedSharding(jax.sharding.Mesh(np.array([device]), ("d",)), PartitionSpec())
    for m in (1, 64):
        for k, n in DECODE_SHAPES:
            shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in ((m, k), (k,), (k, n))]
            text = jax.jit(functools.partial(nm.norm_matmul, eps=EPS, blocks=blocks)).lower(*shapes).compile().as_text()
            assert text.count("tpu_custom_call") == 1, (m, k, n)


def test_the_gpu_decode_kernel_lowers_to_triton_at_llama_widths():
    for m in (1, 64):
        for k, n in DECODE_SHAPES:
            shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k,), (k, n))]
            fn = functools.partial(nm.norm_matmul, eps=EPS, blocks=nm.GpuBlocks())
            assert lower_for_cuda(fn, *shapes).count("__gpu$xla.gpu.triton") == 1, (m, k, n)


# --- the same tokens in every mode -----------------------------------------------------------------------

MODES = [(norm, weights) for weights in ("standard", "folded") for norm in ("standard", "deferred", "fused")]


def _greedy_in_every_mode(model_cfg, params, prompts, new, modes=MODES):
    """{(model.norm, model.norm_weights): greedy tokens [batch, new]} from the same checkpoint, folded for the
    folded modes as `convert fold-norms` folds it."""
    folded = inference.fold(params, model_cfg.tie_embeddings)
    out = {}
    for norm, weights in modes:
        cfg = dataclasses.replace(model_cfg, norm=norm, norm_weights=weights)
        tokens, n = generate_tokens(model_lib.abstract(cfg)[0],
                                    compute_dtype_params(folded if weights == "folded" else params, cfg.dtype),
                                    jnp.asarray(prompts), jax.random.PRNGKey(0), -1, new, 0.0, 1.0)
        assert (np.asarray(n) == new).all()
        out[norm, weights] = np.asarray(tokens)
    return out


def _assert_all_equal(tokens: dict):
    want = tokens["standard", "standard"]
    assert len(np.unique(want)) > 2  # a loop repeating one token would prove little
    for mode, got in tokens.items():
        np.testing.assert_array_equal(got, want, err_msg=str(mode))


def test_greedy_tokens_are_identical_in_every_mode_on_a_tiny_model():
    """fp32, batch 2 (two rows: the decode kernel), gains far from 1 so that folding changes every weight."""
    cfg = model_lib.ModelConfig.from_config(
        None, vocab_size=259, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, d_ff=128,
        init_std=0.3, dtype=F32, tie_embeddings=False)
    params = model_lib.init_params(cfg, jax.random.PRNGKey(0))
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 8))
    params = jax.tree_util.tree_map_with_path(
        lambda p, a: 1 + 0.3 * jax.random.normal(next(keys), a.shape) if p[-1].key == "scale" else a, params)
    prompts = np.array([[256, 72, 101, 108, 108, 111], [256, 87, 111, 114, 108, 100]], np.int32)
    _assert_all_equal(_greedy_in_every_mode(cfg, params, prompts, 12))


def test_greedy_tokens_are_identical_in_the_fused_modes_on_a_converted_llama_3_2_1b_shape(tmp_path):
    """A random Hugging Face model with Llama-3.2-1B's widths (d 2048, 32 heads over 8 kv heads of 64, d_ff 8192,
    the 128256 vocabulary, tied embeddings, Llama 3 RoPE scaling) and 1 of its 16 layers, through
    `convert from-hf`, then decoded in fp32 at batch 2 by the fused kernels (gains folded) and the standard norm.
    One layer holds every fused projection at these widths (Q/K/V and gate/up after the layer's norms, the tied
    output head after the final norm), and 3 new tokens take the prefill and then the KV cache twice: more layers
    or tokens run the same kernels on the same shapes again (the tiny model decodes 2 layers and 12 tokens)."""
    import torch
    import transformers
    from transformers.initialization import no_init_weights

    from scaletrain.__main__ import main
    from scaletrain.store.checkpoint import restore_params

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=1, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=64,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})
    # Drawn once, as Hugging Face's init draws them (normal, std initializer_range), with trained-looking gains:
    # from_config alone would draw every weight twice (torch's init, then Hugging Face's), ~5 s at these widths.
    with no_init_weights():
        hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf_model.tie_weights()
    assert hf_model.lm_head.weight is hf_model.model.embed_tokens.weight
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, config.initializer_range)
    hf_model.save_pretrained(tmp_path / "hf")
    del hf_model
    assert main(["convert", "from-hf", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    setup = inference.one_device_setup(inference.load_config(tmp_path / "run", ["model.dtype=float32"]))
    _, params = restore_params(str(tmp_path / "run"), setup.abstract_state.params)
    prompts = np.array([[128000, 791, 6864, 315], [128000, 9906, 1917, 11]], np.int32)
    # The fused kernels against the standard norm, with the gains folded: the layers' kernels then take no gain
    # (folded into Q/K/V and gate/up), the output head's takes the final norm's (tied embeddings keep it: the tiny
    # model's are untied), so a gain of 1 and a trained-looking one both run at K = 2048. The tiny model covers
    # every mode, fused with unfolded gains among them.
    modes = [("standard", "standard"), ("fused", "folded")]
    _assert_all_equal(_greedy_in_every_mode(setup.model_cfg, params, prompts, 3, modes))
