"""Flash attention (`model.attention: flash`): the library's Pallas kernels - splash attention (TPU, interpreted
here) and the Triton kernel (GPU, interpreted here) - against the plain jnp twin and against the XLA path, alone
and in the whole model on many devices; the TPU kernel compiled ahead of time for real chips."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaletrain import config
from scaletrain.kernels import flash_attention as fa
from scaletrain.train import trainer
from tests import equivalence
from tests.conftest import lower_for_cuda, tiny_overrides

STEPS = 3
HEAD_DIM = 64


def _operands(t, n, kv, seed=0):
    """fp32 q (scaled), k, v for 2 rows, packed with documents of ~50 tokens (segment ids that start mid-block)."""
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (2, t, n, HEAD_DIM)) * HEAD_DIM ** -0.5
    k, v = (jax.random.normal(key, (2, t, kv, HEAD_DIM)) for key in ks[1:3])
    segments = jnp.cumsum(jax.random.uniform(ks[3], (2, t)) < 0.02, axis=1).astype(jnp.int32)
    assert int(segments.max()) >= 2  # several documents per row
    return q, k, v, segments


def _value_and_grads(attend, q, k, v, segments):
    """The output and the gradients of q, k and v under a loss that weighs every output element differently."""
    weights = jnp.cos(jnp.arange(q.size, dtype=jnp.float32).reshape(q.shape))
    loss = lambda q, k, v: (attend(q, k, v, segments) * weights).sum()  # noqa: E731
    return (attend(q, k, v, segments), *jax.grad(loss, argnums=(0, 1, 2))(q, k, v))


def _assert_close(got, want, rtol=1e-5):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(b), name


# (sequence length, query heads, kv heads): GQA ratios 1, 2 and 4; 256 a multiple of the 128-token blocks, 200 not
# (padded), 384 a multiple of 128 but not of the 256-token blocks asked for below.
SHAPES = [(256, 4, 4), (200, 4, 2), (384, 8, 2)]


@pytest.mark.parametrize("t, n, kv", SHAPES)
@pytest.mark.parametrize("kernel", [fa.Splash(block_q=256, block_kv=256, interpret=True),
                                    fa.Triton(block_q=64, block_k=64, interpret=True)], ids=["splash", "triton"])
def test_kernels_equal_the_reference(kernel, t, n, kv):
    operands = _operands(t, n, kv)
    got = jax.jit(lambda *a: _value_and_grads(lambda *b: fa.flash_attention(*b, kernel), *a))(*operands)
    _assert_close(got, _value_and_grads(fa.reference, *operands))


def test_the_reference_is_the_models_xla_attention():
    """The twin the kernels are held to computes what the `xla` path computes, blocked or not: output and
    gradients."""
    from scaletrain.models.attention import blocked_attention

    q, k, v, segments = _operands(256, 4, 2)
    b, t, n, h = q.shape

    def xla(q, k, v, segments):
        return blocked_attention(q.reshape(b, t, 2, 2, h), k, v, segments, block=64).reshape(q.shape)

    _assert_close(_value_and_grads(xla, q, k, v, segments), _value_and_grads(fa.reference, q, k, v, segments))


@pytest.fixture(scope="module")
@equivalence.computed_once
def xla_one_device(batches):
    return equivalence.reference(batches)


# Meshes of 8 devices with fsdp x tensor (kv heads split at tensor=2, replicated at tensor=4: the tiny model has
# 2), ZeRO-2 with grad accumulation, and a remat policy that saves the kernel's residuals.
MESHES = {
    "one device": [],
    "fsdp=4 x tensor=2": ["mesh.fsdp=4", "mesh.tensor=2"],
    "fsdp=2 x tensor=4, save attention_out": ["mesh.fsdp=2", "mesh.tensor=4", "remat.policy=custom",
                                              "remat.custom.attention_out=device"],
    "zero2 data=2 x fsdp=2 x tensor=2, grad_accum 2, full remat": [
        "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "sharding.preset=zero2", "train.grad_accum_steps=2",
        "remat.policy=full"],
}


@pytest.mark.parametrize("mesh", MESHES)
def test_the_model_with_flash_trains_like_xla_on_one_device(batches, xla_one_device, mesh):
    """fp32, 3 updates: every step's loss and gradient norm, and every parameter and Adam moment, within 1e-5
    relative (arrays in norm, as tests/equivalence.py explains)."""
    equivalence.assert_same(equivalence.run(batches, "model.attention=flash", *MESHES[mesh]), xla_one_device)


@pytest.mark.parametrize("policy, forward_kernels", [("full", 2), ("custom", 1)])
def test_remat_policies_see_the_kernels_residuals(policy, forward_kernels):
    """The tiny model's step compiled for 4 TPU chips: full remat runs the forward kernel again in the backward
    pass; a policy that saves attention_out keeps the kernel's output and log-sum-exp, so it runs once."""
    from scaletrain.planner import aot

    cfg = config.load(None, tiny_overrides("unused") + [
        "model.attention=flash", "model.dtype=bfloat16", "mesh.fsdp=4", f"remat.policy={policy}",
        "remat.custom.attention_out=device"])
    setup = trainer.build(cfg, aot.topology_devices("v5p:2x2x1"))
    text = setup.step.lower(*setup.abstract_args()).compile().as_text()
    kernels = [line for line in text.splitlines() if "custom-call(" in line and "tpu_custom_call" in line]
    assert len(kernels) == forward_kernels + 2  # and dq, dkv
    assert sum("splash_mha_fwd" in line for line in kernels) == forward_kernels
    # The side-by-side benchmark's kernel count follows the layer loop: each kernel in its body once per layer.
    found = _kernel_costs().inventory(text)
    assert found["calls_in_loops"] == len(kernels) and not found["uncosted"]
    assert found["calls"] == cfg.model.num_layers * (forward_kernels + 2)


def tpu_operands(topology: str, t: int, n: int, kv: int):
    """(The kernel for a chip of `topology`, abstract bf16 q [1, t, n, 128], k and v [1, t, kv, 128] and int32
    segment ids [1, t] placed on that chip): what an ahead-of-time compile for it takes."""
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    device = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices[0]
    sharding = NamedSharding(jax.sharding.Mesh(np.array([device]), ("d",)), PartitionSpec())
    qkv = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in ((1, t, n, 128), (1, t, kv, 128),
                                                                            (1, t, kv, 128))]
    return fa.kernel_for(device), qkv, jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=sharding)


@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1", "v6e:2x2"])
def test_splash_compiles_for_tpu_at_llama3_8b_shapes(topology):
    """Forward and backward of one device's attention in Llama-3-8B (8192 tokens, 32 query heads sharing 8 kv
    heads of 128, bf16) with the generation's block sizes, through Mosaic (not interpreted)."""
    t = 8192
    kernel, shapes, segments = tpu_operands(topology, t, 32, 8)
    assert kernel == fa.GENERATIONS[topology.split(":")[0]] and not kernel.interpret

    def step(q, k, v, seg):
        out, vjp = jax.vjp(lambda q, k, v: fa.flash_attention(q, k, v, seg, kernel), q, k, v)
        return out, vjp(out)

    text = jax.jit(step).lower(*shapes, segments).compile().as_text()
    assert text.count("tpu_custom_call") >= 3  # forward, dq, dkv: Mosaic kernels
    # benchmarks/maxtext_aot/kernels.py costs them as XLA does not: 2, 3 and 4 matmuls of 2·H·T·S·D each over
    # the causal mask's visited blocks, counted here block by block with the generation's block sizes.
    visited = sum(kb * kernel.block_kv <= (qb + 1) * kernel.block_q - 1
                  for qb in range(t // kernel.block_q) for kb in range(t // kernel.block_kv))
    f = visited / ((t // kernel.block_q) * (t // kernel.block_kv))
    found = _kernel_costs().inventory(text)
    assert sorted(k["kind"] for k in found["kernels"]) == ["dkv", "dq", "fwd"] and not found["uncosted"]
    assert found["flops"] == pytest.approx(2 * (2 + 3 + 4) * 32 * t * t * 128 * f, rel=1e-9)


def test_the_triton_kernel_lowers_for_cuda_at_llama3_8b_shapes():
    """Pallas writes the Triton IR on the CPU; compiling it to PTX needs a GPU."""
    t = 8192
    shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((1, t, 32, 128), (1, t, 8, 128), (1, t, 8, 128))]
    segments = jax.ShapeDtypeStruct((1, t), jnp.int32)

    def step(q, k, v, seg):
        out, vjp = jax.vjp(lambda q, k, v: fa.flash_attention(q, k, v, seg, fa.Triton()), q, k, v)
        return out, vjp(out)

    text = lower_for_cuda(step, *shapes, segments)
    assert text.count("__gpu$xla.gpu.triton") >= 3  # forward, and the backward's kernels


def test_a_kernel_that_declares_its_cost_is_counted_once():
    """megablox's grouped matmul (MaxText's MoE kernel) declares its cost (pl.CostEstimate), which XLA takes into
    its own counts: the side-by-side benchmark lists it as declared and adds nothing (splash attention declares
    none: the test above)."""
    from jax.experimental import topologies
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    device = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    m, k, n, groups = 1024, 512, 768, 4
    args = [jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((groups, k, n), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((groups,), jnp.int32, sharding=sharding)]
    compiled = jax.jit(lambda x, w, sizes: gmm(x, w, sizes, tiling=(128, 128, 128))).lower(*args).compile()
    found = _kernel_costs().inventory(compiled.as_text())
    assert found["declared"]["calls"] == 1 and found["declared"]["flops"] == 2 * m * k * n
    assert found["calls"] == 0 and found["flops"] == 0 and not found["uncosted"]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert cost["flops"] >= 2 * m * k * n  # XLA's count holds the declared cost


def _kernel_costs():
    """benchmarks/maxtext_aot/kernels.py, which the side-by-side benchmark runs in MaxText's environment too."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "maxtext_aot" / "kernels.py"
    spec = importlib.util.spec_from_file_location("maxtext_aot_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flash_is_a_config_choice():
    with pytest.raises(config.ConfigError, match="model.attention"):
        config.load(None, ["model.attention=splash"])
