"""Context parallelism (the sequence split over `mesh.context`) trains exactly like one device: 4 steps' loss and
gradient norm, the parameters and Adam's moment within 1e-5 (fp32), with documents packed across the layout's
chunk boundaries, for both attention modes and both context-attention modes (all-gather, ring), alone and beside
data, fsdp, tensor (sequence parallel), expert and pipeline axes; the zig-zag layout balances the causal work; the
meshes it cannot split are refused."""

import functools

import numpy as np
import pytest

from scaletrain import config
from scaletrain.data import loader as data
from scaletrain.errors import ConfigError
from scaletrain.parallel import checks, context
from tests import equivalence

STEPS = 4
# Document boundaries (as fractions of the sequence) that fall inside the layout's chunks, not on their edges: a
# query and the keys of its document then lie on different devices and in chunks the zig-zag swaps around.
CUTS = (0.17, 0.43, 0.77)


def _packed(batches: list[dict]) -> list[dict]:
    """The batches with every row cut into four documents at CUTS (shifted by one token per row): segment ids and
    positions as the loader packs them, the tokens unchanged."""
    out = []
    for batch in batches:
        rows, t = batch["tokens"].shape
        segments = np.ones((rows, t), np.int32)
        positions = np.zeros((rows, t), np.int32)
        for r in range(rows):
            starts = [0, *(int(c * t) + r for c in CUTS)]
            for doc, (a, b) in enumerate(zip(starts, [*starts[1:], t]), 1):
                segments[r, a:b], positions[r, a:b] = doc, np.arange(b - a)
        out.append({**batch, "segment_ids": segments, "positions": positions})
    return out


@functools.cache
def _batches(seq_len: int, rows: int = 8) -> list[dict]:
    """STEPS batches of `rows` rows of `seq_len` tokens, packed (made once per shape for the module's runs)."""
    it = data.BatchIterator(data.make_dataset(config.load(None, [f"data.seq_len={seq_len}"])), global_batch=rows)
    return _packed([next(it) for _ in range(STEPS)])


MOE = ["model.num_experts=4", "model.moe_d_ff=64"]
# The splash kernel (interpreted on CPU) at 512 tokens, 128 per context shard: 2 rows, one per data or fsdp shard -
# the kernel's work is per row, and the three flash meshes share one one-device reference.
FLASH = ["model.attention=flash", "train.global_batch=2"]
# Blocked attention (tiles of 4 queries under the ring), logits a block of 4 positions at a time and 2 accumulated
# microbatches: features the sequence split composes with, together in one model for the all-gather (its logits
# blocks through loss.blocked_linear_cross_entropy) and, with FlashNorm, for the ring (FlashNorm's head is no plain
# projection of the stream: its logits blocks take the checkpointed scan over context.blocks).
BLOCKED = ["model.attention_block=4", "model.logits_block=4", "train.grad_accum_steps=2"]
# (sequence, the model's overrides (the reference's too), the mesh's). Where each claim of docs/context.md's table
# is trained: the all-gather blocked, logits blocks and accumulation on context=4 x fsdp=2; the ring in tiles over
# the DCN and ICI levels (with the same features, and FlashNorm); the contiguous layout with sequence parallelism
# (all-gather, ring); experts, with the state offloaded and remat save_dots; each pipeline schedule - 1F1B with
# the ring and experts, zero-bubble with the optimizer state offloaded (its pairing of tests/test_pairings.py),
# GPipe under full remat (which GPipe rematerialises; 1F1B's own backward uses no policy), circular; flash
# zig-zag, contiguous with tensor, and the ring through splash over 4 context shards with sequence parallelism.
MESHES = {
    "context=4 x fsdp=2, blocked xla, logits blocks, 2 microbatches accumulated": (
        32, BLOCKED, ["mesh.context=4", "mesh.fsdp=2"]),
    "context=2 x data=2 x tensor=2, contiguous": (32, [], ["mesh.context=2", "mesh.data=2", "mesh.tensor=2",
                                                          "sharding.context_layout=contiguous"]),
    "context=2 x expert=2 x fsdp=2, experts, state offloaded, save_dots": (
        32, MOE, ["mesh.context=2", "mesh.expert=2", "mesh.fsdp=2", "optim.offload=true", "params.offload=true",
                  "remat.policy=save_dots"]),
    "dcn_context=2 x context=2 x fsdp=2, ring in tiles, logits blocks, FlashNorm, 2 microbatches accumulated": (
        32, [*BLOCKED, "model.norm=fused"], ["mesh.dcn_context=2", "mesh.context=2", "mesh.fsdp=2",
                                              "model.context_attention=ring"]),
    "context=2 x data=2 x tensor=2, ring, contiguous": (32, [], ["mesh.context=2", "mesh.data=2", "mesh.tensor=2",
                                                                "sharding.context_layout=contiguous",
                                                                "model.context_attention=ring"]),
    "context=2 x pipeline=2 x fsdp=2, experts, 1f1b, ring": (
        32, MOE, ["mesh.context=2", "mesh.pipeline=2", "mesh.fsdp=2", "pipeline.schedule=1f1b",
                  "pipeline.microbatches=2", "model.context_attention=ring"]),
    "context=2 x pipeline=2 x fsdp=2, zero-bubble, optimizer state offloaded": (
        32, [], ["mesh.context=2", "mesh.pipeline=2", "mesh.fsdp=2", "pipeline.schedule=zero_bubble",
                 "pipeline.microbatches=2", "optim.offload=true"]),
    "context=2 x pipeline=2 x data=2, gpipe, full remat": (
        32, [], ["mesh.context=2", "mesh.pipeline=2", "mesh.data=2", "pipeline.schedule=gpipe",
                 "pipeline.microbatches=2", "remat.policy=full"]),
    "context=2 x pipeline=2 x fsdp=2, circular": (32, ["model.num_layers=4"], [
        "mesh.context=2", "mesh.pipeline=2", "mesh.fsdp=2", "pipeline.schedule=circular", "pipeline.repeats=2",
        "pipeline.microbatches=2"]),
    "context=4 x data=2, flash": (512, FLASH, ["mesh.context=4", "mesh.data=2"]),
    "context=2 x fsdp=2 x tensor=2, flash, contiguous": (512, FLASH, [
        "mesh.context=2", "mesh.fsdp=2", "mesh.tensor=2", "sharding.context_layout=contiguous"]),
    "context=4 x tensor=2, flash, ring": (512, FLASH, [
        "mesh.context=4", "mesh.tensor=2", "model.context_attention=ring"]),
}


# Adam's mu of the attention's q/k projections after 4 updates on the circular schedule: 1.14e-5 relative from one
# device on a 2-core x86 machine (float32 sums in another order over 4 stage passes; the loss, gradient norm and
# parameters within 1e-5), where other CPUs stayed under 1e-5.
MU_RTOL = {"context=2 x pipeline=2 x fsdp=2, circular": 2e-5}


@pytest.mark.parametrize("mesh", MESHES)
def test_a_context_parallel_run_equals_one_device(mesh):
    seq_len, model, layout = MESHES[mesh]
    rows = next((int(o.split("=")[1]) for o in model if o.startswith("train.global_batch=")), 8)
    batches = _batches(seq_len, rows)  # the flash kernel's blocks are 128 queries: 128 per context shard
    overrides = [f"data.seq_len={seq_len}", *model]
    got = equivalence.run(batches, *overrides, *layout)
    equivalence.assert_same(got, equivalence.reference(batches, *overrides), mu=MU_RTOL.get(mesh, 1e-5))
    assert got.setup.mesh.shape["context"] > 1


@pytest.mark.parametrize("layout, blocks", [(layout, blocks) for layout in config.CONTEXT_LAYOUTS
                                            for blocks in ("xla", "xla in tiles", "splash")
                                            if blocks != "splash" or layout == "zigzag"])
def test_the_ring_equals_attention_over_the_whole_sequence(layout, blocks):
    """The ring alone on 4 devices - its passes' work XLA's (queries whole, or in tiles of 32) or the splash
    kernel's (kernels/ring_splash.py, interpreted) - against dot_attention over the whole sequence: the output and
    the gradients of q, k and v within 1e-5, documents packed across the layout's chunks. The splash ring carries
    attention sinks (model.attention_sinks, folded in after its last pass): their gradient too."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from scaletrain.kernels import flash_attention, ring_splash
    from scaletrain.kernels.ring_attention import ring_attention
    from scaletrain.models.attention import block_mask, dot_attention

    shards, (b, t, k, g, h) = 4, (2, 512, 2, 2, 8)  # splash's blocks are 128 queries: 512 / 4 shards
    rng = np.random.default_rng(0)
    q, key, value = (jnp.asarray(rng.normal(size=shape), jnp.float32)
                     for shape in ((b, t, k, g, h), (b, t, k, h), (b, t, k, h)))
    order = context.order(t, shards, layout)
    order = np.arange(t, dtype=np.int32) if order is None else order
    segments = _packed([{"tokens": np.zeros((b, t), np.int32)}])[0]["segment_ids"]
    q, key, value, segments = (jnp.take(x, order, axis=1) for x in (q, key, value, jnp.asarray(segments)))
    weights = jnp.asarray(rng.normal(size=h), jnp.float32)
    index = jnp.asarray(order)
    sinks = jnp.asarray(rng.normal(size=(k, g)), jnp.float32) if blocks == "splash" else None

    def whole(q, key, value, sinks):
        return dot_attention(q, key, value, block_mask(segments, segments, index, index), sinks_kg=sinks) @ weights

    mesh = Mesh(np.array(jax.devices()[:shards]), ("context",))
    split = P(None, "context")
    if blocks == "splash":
        kernels = ring_splash.pass_kernels(k * g, t, shards, layout, flash_attention.INTERPRETED)
        specs = [kernel.manual_sharding_spec(jax.sharding.NamedSharding(mesh, P(None, "context")))
                 for kernel in kernels]
        ring = jax.shard_map(lambda kernels, q, k, v, s, sinks: ring_splash.ring_splash_attention(
            kernels, q.reshape(*q.shape[:2], -1, h), k, v, s, ("context",), sinks.reshape(-1)).reshape(q.shape),
            mesh=mesh, in_specs=(specs, *(split,) * 4, P()), out_specs=split, check_vma=False)
        ring = functools.partial(ring, kernels)
    else:
        block = 32 if blocks == "xla in tiles" else 0
        ring = jax.shard_map(
            lambda q, k, v, s, sinks: ring_attention(q, k, v, s, s, order.reshape(shards, -1), ("context",), block),
            mesh=mesh, in_specs=(*(split,) * 4, P()), out_specs=split, check_vma=False)

    def on_the_ring(q, key, value, sinks):
        return ring(q, key, value, segments, sinks) @ weights

    wrt = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
    for got, want in zip(jax.jit(jax.value_and_grad(lambda *a: jnp.sum(on_the_ring(*a)), wrt))(q, key, value, sinks),
                         jax.value_and_grad(lambda *a: jnp.sum(whole(*a)), wrt)(q, key, value, sinks)):
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_the_zigzag_layout_balances_causal_work():
    """Each of 4 shards holds 2 of the 8 chunks, i and 7 - i; the (query, key) pairs a causal mask leaves are then
    the same on every shard, where contiguous shards would hold 1, 3, 5 and 7 parts of 16."""
    order = context.order(64, 4, "zigzag")
    assert sorted(order) == list(range(64))
    np.testing.assert_array_equal(order.reshape(4, 2, 8)[:, :, 0], [[0, 56], [8, 48], [16, 40], [24, 32]])
    pairs = (order + 1).reshape(4, 16).sum(axis=1)  # query at position p sees p + 1 keys
    assert len(set(pairs)) == 1
    assert context.order(64, 4, "contiguous") is None and context.order(64, 1, "zigzag") is None


@pytest.mark.parametrize("overrides, says", [
    (["data.seq_len=36", "mesh.context=4"], "not divisible by the 8 chunks"),
    (["data.seq_len=36", "mesh.context=4", "sharding.context_layout=contiguous", "mesh.tensor=2"],
     "data.seq_len / mesh.context = 9 is not divisible by mesh.tensor=2"),
    (["data.seq_len=256", "mesh.context=4", "model.attention=flash"], "not a multiple of 128"),
    (["data.seq_len=32", "mesh.context=4", "model.attention_block=16"], "does not divide data.seq_len / mesh.context"),
    (["data.seq_len=48", "mesh.context=2", "model.logits_block=16"], "logits_block=16 does not divide"),
    (["mesh.context=2", *MOE, "model.capacity_factor=1.25"], "capacity_factor 0"),
    (["data.seq_len=512", "mesh.context=2", "model.attention=flash", "model.context_attention=ring",
      "sharding.context_layout=contiguous"], "needs sharding.context_layout=zigzag"),
    (["data.seq_len=32", "mesh.context=2", "mesh.pipeline=2", "model.num_layers=2",
      "pipeline.schedule=zero_bubble", "model.context_attention=ring"],
     "model.context_attention=ring with pipeline.schedule=zero_bubble"),
])
def test_a_sequence_the_context_axis_cannot_split_is_refused(overrides, says):
    cfg = config.load(None, overrides)
    sizes = {a: int(cfg.mesh[a]) for a in config.MESH_AXES}
    with pytest.raises(ConfigError, match=says):
        checks.check(cfg, sizes)


def test_a_run_trains_with_the_sequence_split_and_resumes_without(tmp_path):
    """The trainer's own path - the loader's rows for this process, each batch laid out and placed along the
    sequence - with context 4 x fsdp 2, then resumed from its checkpoint on fsdp 8: the checkpoint holds no layout."""
    import json
    import math

    from scaletrain.train import trainer
    from tests.conftest import tiny_overrides

    run = tmp_path / "run"

    def train(steps, mesh):
        cfg = config.load(None, tiny_overrides(run, steps=steps, **mesh, **{"checkpoint.async_save": False}))
        assert trainer.run(cfg) == 0

    train(2, {"mesh.context": 4, "mesh.fsdp": 2})
    train(3, {"mesh.fsdp": 8})
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records if "loss" in r)
