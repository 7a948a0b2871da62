"""The collectives each strategy compiles to, read from the HLO, against the scaling book's formulas (docs/planner.md).

fp32 (4 bytes), 8 devices, tiny model: D=64, F=128, L=2, N=8 heads of 8, K=4 kv heads, V=384, T=32, batch 8.
"""

import jax
import numpy as np
import pytest

from scaletrain import config
from scaletrain.planner import hlo, roofline
from scaletrain.train import trainer
from tests import equivalence
from tests.conftest import tiny_overrides

D, F, L, N, K, H, V, T, B = 64, 128, 2, 8, 4, 8, 384, 32, 8
MODEL = {"model.num_heads": N, "model.num_kv_heads": K, "model.head_dim": H}
PARAMS_PER_LAYER = 3 * D * F + 2 * D * (N + K) * H + 2 * D  # scaling.md: 3DF + 2D(N+K)H + 2D


def _inventory(*overrides):
    cfg = config.load(None, tiny_overrides("unused", **MODEL) + list(overrides))
    setup = trainer.build(cfg, jax.devices())
    text = equivalence.compiled_step(setup).as_text()
    return hlo.inventory(text, setup.mesh)


def _in_layers(inventory):
    return [c for c in inventory if c.loops == (L,)]


def _bytes(collectives, kind, axis, phase):
    """Full-array bytes per layer of one kind of collective over one mesh axis."""
    return sum(c.full_bytes for c in collectives
               if c.effective_kind == kind and c.axes == (axis,) and c.phase == phase)


def _close(got, want):
    assert abs(got - want) <= 0.05 * want, (got, want)


def test_fsdp_gathers_weights_and_scatters_gradients_per_layer():
    layers = _in_layers(_inventory("mesh.fsdp=8"))
    weights = 4 * PARAMS_PER_LAYER
    # scaling.md, FSDP: each layer's weights all-gathered in the forward pass and again in the backward pass
    # (the transpose of the gather: its gradient reduce-scattered).
    _close(_bytes(layers, "all-gather", "fsdp", "forward"), weights)
    _close(_bytes(layers, "all-gather", "fsdp", "backward"), weights)
    _close(_bytes(layers, "reduce-scatter", "fsdp", "backward"), weights)
    assert not [c for c in layers if c.effective_kind == "all-reduce" and c.full_bytes > 4 * D]


@pytest.fixture(scope="module")
def tensor_parallel():
    return {sp: _inventory("mesh.fsdp=2", "mesh.tensor=4", f"sharding.sequence_parallel={sp}")
            for sp in (True, False)}


def test_tensor_and_sequence_parallel_move_activations_not_weights(tensor_parallel):
    collectives = tensor_parallel[True]
    layers = _in_layers(collectives)
    activation = 4 * (B // 2) * T * D  # one [batch per fsdp shard, seq, d_model] fp32 tensor
    # scaling.md, tensor parallelism: per layer an all-gather and a reduce-scatter of activations for attention
    # and for the MLP in the forward pass, their transposes in the backward pass.
    _close(_bytes(layers, "all-gather", "tensor", "forward"), 2 * activation)
    _close(_bytes(layers, "reduce-scatter", "tensor", "forward"), 2 * activation)
    _close(_bytes(layers, "all-gather", "tensor", "backward"), 2 * activation)
    _close(_bytes(layers, "reduce-scatter", "tensor", "backward"), 2 * activation)
    # Sequence parallelism: no [batch, seq, d_model] tensor is all-reduced anywhere in the step.
    assert not [c for c in collectives if c.effective_kind == "all-reduce" and "tensor" in c.axes
                and c.full_bytes >= activation]
    # Vocab-parallel embedding and loss: nothing near the size of full-vocab logits crosses the tensor axis.
    logits = 4 * (B // 2) * T * V
    assert not [c for c in collectives if "tensor" in c.axes and c.full_bytes >= logits / 2]


def test_without_sequence_parallelism_activations_are_all_reduced(tensor_parallel):
    layers = _in_layers(tensor_parallel[False])
    activation = 4 * (B // 2) * T * D
    _close(_bytes(layers, "all-reduce", "tensor", "forward"), 2 * activation)
    assert not _bytes(layers, "reduce-scatter", "tensor", "forward")


def test_replica_group_spellings_map_to_mesh_axes():
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(1, 4, 1, 1, 2),
                             ("data", "fsdp", "expert", "pipeline", "tensor"))
    spellings = {
        "replica_groups={{0,2,4,6},{1,3,5,7}}": ("fsdp",),
        "replica_groups=[4,2]<=[8]": ("tensor",),
        "replica_groups=[2,4]<=[4,2]T(1,0)": ("fsdp",),
        "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}": ("fsdp",),
        "replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_2'}": ("fsdp",),
        "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0','axis_1'}": ("fsdp", "tensor"),
        "source_target_pairs={{0,1},{1,0},{2,3},{3,2}}": ("tensor",),
    }
    for text, axes in spellings.items():
        assert hlo.mesh_axes(hlo.replica_groups(text), mesh) == axes, text


# Loop trip counts as the TPU backend prints them: no annotation, an `i < N` condition.
TPU_STYLE_HLO = """
%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[]{:T(128)} constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p.1: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p.1 = (s32[], f32[8]) parameter(0)
  %x = f32[8] get-tuple-element(%p.1), index=1
  %ag = f32[64]{0:T(128)} all-gather(%x), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, metadata={op_name="jit(step)/jvp()/while/body/dot_general"}
  %ar = (f32[64], f32[]) all-reduce(%ag, %x), channel_id=2, replica_groups=[1,8]<=[8], to_apply=%add, metadata={op_name="jit(step)/transpose(jvp())/while/body/dot_general"}
  %g0 = f32[64] get-tuple-element(%ar), index=0
  %ds = f32[8] dynamic-slice(%g0, %i.1), dynamic_slice_sizes={8}
  %g1 = f32[] get-tuple-element(%ar), index=1
  ROOT %t = (s32[], f32[8]) tuple(%i.1, %ds)
}

ENTRY %main (a: f32[8]) -> (s32[], f32[8]) {
  %a = f32[8] parameter(0)
  %init = (s32[], f32[8]) tuple(%zero, %a)
  ROOT %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body
}
"""  # noqa: E501 - HLO as XLA prints it: one instruction a line


def test_tpu_loop_spelling_and_combined_all_reduces():
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(8, 1, 1, 1, 1),
                             ("data", "fsdp", "expert", "pipeline", "tensor"))
    found = {(c.effective_kind, c.full_bytes): c for c in hlo.inventory(TPU_STYLE_HLO, mesh)}
    assert set(found) == {("all-gather", 256), ("reduce-scatter", 256), ("all-reduce", 4)}
    assert all(c.count == 3 and c.loops == (3,) and c.axes == ("data",) for c in found.values())
    assert found[("all-gather", 256)].phase == "forward" and found[("reduce-scatter", 256)].phase == "backward"
    assert hlo.summary(found.values())["reduce-scatter"] == {"count": 3, "bytes": 768}


def test_context_parallelism_gathers_keys_and_values_as_planned():
    """mesh.context=8 (dp: no weight moves over it, so every collective in the layers is context parallelism's
    own): per layer, K and V all-gathered forward and their gradient reduce-scattered backward, V = the whole
    sequences' keys and values - what the planner counts, in kind, count and bytes. (Under FSDP the weights move
    over context too: its devices are data-parallel for the state.)"""
    overrides = ["mesh.context=8", "sharding.preset=dp"]
    layers = _in_layers(_inventory(*overrides))
    kv = B * T * 2 * K * H * 4
    assert _bytes(layers, "all-gather", "context", "forward") == kv
    assert _bytes(layers, "reduce-scatter", "context", "backward") == kv
    cfg = config.load(None, tiny_overrides("unused", **MODEL) + overrides)
    planned = [c for c in roofline.plan(cfg, "v5p:2x2x2")["collectives"] if c["axis"] == "context"]
    moves = {(c["kind"], c["what"]): (c["full_bytes"], c["count"]) for c in planned}
    assert moves["all-gather", "keys and values"] == (kv, L)
    assert moves["reduce-scatter", "key and value gradients"] == (kv, L)
    weight_gradients = [c for c in layers if c.effective_kind == "all-reduce" and c.phase == "backward"]
    assert moves["all-reduce", "layer gradients"][1] == L * len(weight_gradients)


@pytest.mark.parametrize("attention", ["xla", "flash"])
def test_the_ring_passes_keys_and_values_as_planned(attention):
    """model.context_attention=ring on mesh.context=8 (dp), its passes' work XLA's or the splash kernel's: per
    layer each device sends its block of K and of V on to the next C - 1 times forward and C - 1 times backward,
    and their gradients (float32) C times - the planner's sends, in count and bytes. (The segment ids travel with
    the blocks, an int32 per token: the planner leaves them out, and so does this count.) Splash's blocks are 128
    queries: its sequence is 8 x 128, one row of it."""
    c, (b, t) = 8, ((B, T) if attention == "xla" else (1, 1024))
    overrides = ["mesh.context=8", "sharding.preset=dp", "model.context_attention=ring", f"model.attention={attention}",
                 f"data.seq_len={t}", f"train.global_batch={b}"]
    block = b * t // c * K * H * 4  # a device's K (or V)
    inventory = _inventory(*overrides)
    sends = [s for s in inventory if s.kind == "collective-permute" and s.full_bytes == block]
    assert all(s.axes == ("context",) for s in sends)
    cfg = config.load(None, tiny_overrides("unused", **MODEL) + overrides)
    planned = {p["what"]: p for p in roofline.plan(cfg, "v5p:2x2x2")["collectives"] if p["axis"] == "context"}
    kv, grads = planned["keys and values"], planned["key and value gradients"]
    assert (kv["full_bytes"], kv["count"]) == (2 * block, 2 * (c - 1) * L)
    assert (grads["full_bytes"], grads["count"]) == (2 * block, c * L)
    assert sum(s.count for s in sends if s.phase == "forward") == 2 * (c - 1) * L  # K and V, C - 1 passes a layer
    assert sum(s.count * s.full_bytes for s in sends) == sum(p["count"] * p["full_bytes"] for p in (kv, grads))
    assert not [s for s in inventory if s.kind == "all-gather" and "context" in s.axes]


def test_quantized_matmuls_keep_the_sequence_split():
    """int8 matmuls under mesh.context=8 take their rows as [batch, seq] (flattened, the tokens would be whole rows
    and XLA would gather the sequence for every projection): in the layers only the keys and values are gathered
    over context, as unquantized."""
    layers = _in_layers(_inventory("mesh.context=8", "sharding.preset=dp", "model.quantization=int8"))
    gathers = {c.full_bytes for c in layers if c.kind == "all-gather" and "context" in c.axes}
    assert gathers == {B * T * K * H * 4}  # K, and V


def test_logits_blocks_stay_on_their_context_shards():
    """model.logits_block under mesh.context=8: each step of the loss's loop takes a block of every device's own
    positions, so nothing moves the stream between the context devices (a block of the whole sequence would lie on
    one device: all-to-alls of the stream, and every block's head gradient all-reduced inside the loop)."""
    inventory = _inventory("mesh.context=8", "sharding.preset=dp", "model.logits_block=2")
    assert not [c for c in inventory if "context" in c.axes and (c.kind == "all-to-all" or c.loops not in ((), (L,)))]
