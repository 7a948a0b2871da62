"""Communication per train step: the bytes each device sends and the time of every collective, per mesh axis.

Conventions (the scaling book, "Collectives on a torus"; docs/planner.md):
- V is the bytes of the whole array a collective gathers or reduces over one mesh axis of X devices (for an
  all-to-all, of the whole array exchanged; for a pipeline send, of the array sent).
- Bytes per device are those each device sends on a ring: V (X-1)/X for an all-gather or a reduce-scatter,
  2 V (X-1)/X for an all-reduce (= reduce-scatter + all-gather), V (X-1)/X^2 for an all-to-all, V for a send;
  the same convention as the compiled inventory (planner/hlo.py, `Collective.moved_bytes`).
- Time on a TPU torus: an all-gather or reduce-scatter takes V / W where every physical axis the mesh axis spans
  wraps (the book's convention, whose worked answers for v4 reproduce: a bidirectional ring's exact (X-1)/X is
  left out), W the sum over those axes (M_X of them) of W_ici bidirectional; V (X-1)/X / W otherwise, an open
  axis counting W_ici one-way (twice as long: the v5e answers). An all-reduce takes twice either; an all-to-all
  V max(parts) / (4 X W / M_X). A pipeline send crosses one link
  one way: V / W_oneway. On a GPU node (a switch) W is the NVLink egress per GPU, and an all-to-all
  V (X-1) / (X^2 W) (the book's GPU chapter); across slices (DCN, or GPU nodes) W is the DCN bandwidth per chip.
- Latency floor: each execution takes at least hops x 1 us: X/2 hops per wrapped axis, X-1 per open axis or
  switch ring. DCN latency is not modelled.
- A collective over a mesh axis that also has a DCN part (mesh.dcn_X > 1), or over several mesh axes, runs level
  by level, innermost first: the ICI level moves V, the level after it V / X_ici (gathering an array that is
  also sharded over another axis moves 1/|that axis| of it) - so DCN carries as little as it can.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

from scaletrain.config import MESH_AXES
from scaletrain.facts.hardware import Topology

HOP_LATENCY_S = 1e-6  # scaling.md: "ICI latency about 1 us per hop"; assumed for NVLink too
# ragged-all-to-all: an all-to-all of rows whose counts are known only at run time (TPU's expert dispatch),
# costed as an all-to-all of the rows that move.
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "send")
_ALL_TO_ALLS = ("all-to-all", "ragged-all-to-all")


@dataclass(frozen=True)
class Link:
    """One level of a mesh axis: how the devices a collective over it spans are connected."""

    name: str  # the mesh axis ("fsdp") or its DCN part ("dcn_fsdp")
    size: int  # X
    parts: tuple[int, ...]  # devices along each physical axis the level spans (a switch: (X,))
    wraps: tuple[bool, ...]  # per part: a whole physical axis with wraparound links
    oneway: float  # bytes/s of one link in one direction (a switch: egress per device)
    bidi: float  # bytes/s of one link in both directions
    switch: bool  # every device one hop from every other: a GPU node, or DCN
    hop_latency: float = HOP_LATENCY_S

    @property
    def bandwidth(self) -> float:
        """Bytes/s a device gathers at: W_bidi per wrapped part, W_oneway per open one (a switch: its egress)."""
        if self.switch:
            return self.oneway
        return sum(self.bidi if w else self.oneway for w in self.wraps)

    @property
    def hops(self) -> float:
        if self.switch:
            return self.size - 1
        return sum(p / 2 if w else p - 1 for p, w in zip(self.parts, self.wraps))

    def bytes_sent(self, kind: str, full_bytes: float) -> float:
        """Bytes one device sends for one execution (the module docstring's convention)."""
        x = self.size
        if kind in _ALL_TO_ALLS:
            return full_bytes * (x - 1) / x**2
        return {"all-gather": full_bytes * (x - 1) / x, "reduce-scatter": full_bytes * (x - 1) / x,
                "all-reduce": 2 * full_bytes * (x - 1) / x, "send": full_bytes}[kind]

    def seconds(self, kind: str, full_bytes: float) -> float:
        """One execution: the bandwidth time, or the latency floor when that is longer. On a level whose every
        physical axis wraps, as the book computes it: V / W for an all-gather or a reduce-scatter, 2 V / W for an
        all-reduce (a bidirectional ring's exact (X-1)/X left out, as the book's worked answers leave it)."""
        if kind == "send":
            return max(full_bytes / self.oneway, self.hop_latency)
        if kind in _ALL_TO_ALLS and not self.switch:
            moving = full_bytes * max(self.parts) / (4 * self.size * self.bandwidth / len(self.parts))
        elif not self.switch and all(self.wraps):
            moving = (2 if kind == "all-reduce" else 1) * full_bytes / self.bandwidth
        else:
            moving = self.bytes_sent(kind, full_bytes) / self.bandwidth
        return max(moving, self.hops * self.hop_latency)


@dataclass(frozen=True)
class Transfer:
    """One kind of collective of a train step on one level of one mesh axis."""

    axis: str
    kind: str
    what: str
    full_bytes: float  # V of one execution
    count: int  # executions per step
    bytes_per_device: float  # per step
    seconds: float  # per step
    exposed: float = 0.0  # seconds per step the step waits for it (the ring's sends beyond their passes' compute)


def collective(kind: str, what: str, full_bytes: float, count: int, levels: Sequence[Link]) -> list[Transfer]:
    """`count` executions of one collective of V = `full_bytes` over `levels` (innermost first): level i moves
    V / (X_1 ... X_{i-1}). Levels of size 1 move nothing and are left out."""
    out = []
    for link in levels:
        if link.size > 1 and count:
            out.append(Transfer(axis=link.name, kind=kind, what=what, full_bytes=full_bytes, count=count,
                                bytes_per_device=count * link.bytes_sent(kind, full_bytes),
                                seconds=count * link.seconds(kind, full_bytes)))
            full_bytes /= link.size
    return out


def tensor(activation_bytes: float, layers: int, microbatches: int, sequence_parallel: bool,
           recomputed: Iterable[str], levels: Sequence[Link], moe_layers: int = 0) -> list[Transfer]:
    """Megatron tensor parallelism per microbatch, V = one replica's [tokens, d_model] activations.
    With sequence parallelism, per layer: forward all-gather before Q/K/V and before gate/up, reduce-scatter after
    the output and down projections; the backward pass their transposes (2 more of each); a remat recomputation
    repeats the all-gather of the Q/K/V or gate/up projection and the reduce-scatter of the output projection it
    recomputes (`recomputed`: matmul groups, as roofline.recomputed names them). Outside the layers the vocab-parallel
    embedding reduce-scatters and the output projection all-gathers its input (transposed backward).
    Without sequence parallelism each all-gather / reduce-scatter pair is one all-reduce: after the output and
    down projections forward, of the Q/K/V and gate/up input gradients backward, again for a recomputed output
    projection, and once each for the embedding (forward) and the output projection (backward).
    A mixture-of-experts layer (models/mixtral/moe.py) has the same collectives - its input gathered whole, its output
    summed over `tensor` (the experts' hidden dim is split over it), recomputed with its router and experts - and
    one more: an all-reduce of its input gradient in the backward pass (as the compiled CPU and TPU steps do)."""
    recomputed = set(recomputed)
    moe = collective("all-reduce", "MoE input gradients", activation_bytes, moe_layers * microbatches, levels)
    if sequence_parallel:
        gathers = 4 + ("qkv" in recomputed) + bool({"gate_up", "expert_down"} & recomputed)
        scatters = 4 + ("out" in recomputed)
        return (collective("all-gather", "layer activations", activation_bytes, gathers * layers * microbatches,
                           levels)
                + collective("reduce-scatter", "layer activations", activation_bytes,
                             scatters * layers * microbatches, levels)
                + collective("all-gather", "embedding and output activations", activation_bytes, 2 * microbatches,
                             levels)
                + collective("reduce-scatter", "embedding and output activations", activation_bytes,
                             2 * microbatches, levels) + moe)
    reduces = 4 + ("out" in recomputed)
    return (collective("all-reduce", "layer activations", activation_bytes, reduces * layers * microbatches, levels)
            + collective("all-reduce", "embedding and output activations", activation_bytes, 2 * microbatches,
                         levels) + moe)


def context(kv_bytes: float, layers: int, microbatches: int, recomputed: bool, levels: Sequence[Link],
            ring_dtype_bytes: int = 0, pass_seconds: float = 0.0) -> list[Transfer]:
    """Context parallelism per layer and microbatch, V = the keys and values of the whole sequences of the
    context axis's rows (models/attention.py): an all-gather before attention, forward, and again where the remat
    policy recomputes attention (`recomputed`); the reduce-scatter of their gradient, backward.
    The ring schedule instead (`ring_dtype_bytes`: the compute dtype's bytes; kernels/ring_attention.py), C the
    ring's devices: each device sends its block (V / C) on to the next C - 1 times forward (again where
    attention is recomputed) and C - 1 times backward, and the blocks' float32 gradients C times backward, each
    pass one hop at the pace of the slowest level the ring spans. The segment ids travelling with the blocks
    (an int32 per token against 2 kv_heads head_dim K/V values) are left out. A pass's send hides under the
    attention of the block before it - `pass_seconds` forward, RING_BACKWARD times that backward, where the block
    and its gradient travel together; what it takes beyond is exposed, and so is each gradient's last send home."""
    if not ring_dtype_bytes:
        return (collective("all-gather", "keys and values", kv_bytes, (1 + recomputed) * layers * microbatches,
                           levels)
                + collective("reduce-scatter", "key and value gradients", kv_bytes, layers * microbatches, levels))
    ways = math.prod(link.size for link in levels)
    if ways == 1:
        return []
    block, passes = kv_bytes / ways, layers * microbatches
    (kv,), (grads,) = (_hops("keys and values", block, (2 + recomputed) * (ways - 1) * passes, levels),
                       _hops("key and value gradients", block * 4 / ring_dtype_bytes, ways * passes, levels))
    send, grad = kv.seconds / kv.count, grads.seconds / grads.count
    late = ((1 + recomputed) * max(0.0, send - pass_seconds)
            + max(0.0, send + grad - RING_BACKWARD * pass_seconds)) * (ways - 1) * passes
    return [replace(kv, exposed=late), replace(grads, exposed=grad * passes)]


# A ring pass's backward work in forwards of it: the scores again, then four matmuls to the forward's two.
RING_BACKWARD = 2.5


def _hops(what: str, full_bytes: float, count: int, levels: Sequence[Link]) -> list[Transfer]:
    """`count` sends of `full_bytes` to a neighbour, timed on the slowest level the axis spans (a ring, or a
    pipeline, advances at the pace of its slowest hop)."""
    spanned = [link for link in levels if link.size > 1]
    if not spanned:
        return []
    return collective("send", what, full_bytes, count, [min(spanned, key=lambda link: link.oneway)])


def pipeline(activation_bytes: float, microbatches: int, sends: int, exposed: int,
             levels: Sequence[Link]) -> list[Transfer]:
    """A pipeline's traffic per step: its stage-to-stage sends (runner.Runner.sends: the schedule's count,
    `exposed` of them waited for), a microbatch's activations to the next stage or their gradient back (2BD bytes
    each in bf16: scaling.md), every send timed on the slowest level the pipeline axis spans (DCN when
    mesh.dcn_pipeline > 1); and the embedded batch - `microbatches` of them - gathered by the stages (each
    device's rows are computed split over them) and its gradient, which the first stage forms, reduced back."""
    out = _hops("stage activations and their gradients", activation_bytes, sends, levels)
    batch = activation_bytes * microbatches
    return ([replace(t, exposed=t.seconds * exposed / sends) for t in out]
            + collective("all-gather", "the embedded batch, to every stage", batch, 1, levels)
            + collective("reduce-scatter", "its gradient, from every stage", batch, 1, levels))


def expert(routed_bytes: float, counts_bytes: float, moe_layers: int, microbatches: int, recomputed: bool,
           levels: Sequence[Link], kind: str = "all-to-all") -> list[Transfer]:
    """Expert parallelism per MoE layer and microbatch (models/mixtral/moe.py), V = the routed rows of the expert axis's
    devices (each one's operand, times their number): an all-to-all dispatching each device's rows to its
    experts' devices and one returning the results, forward; both transposed backward; and both again where the
    remat policy recomputes the layer (`recomputed`). `kind` `ragged-all-to-all` where only the rows move (TPU).
    Dropless routing first all-gathers every device's assignments per expert (`counts_bytes`, the axis's; 0 with
    capacity buffers, whose shapes are fixed), forward and again when recomputed."""
    passes = 2 + recomputed  # forward, backward, recomputation
    out = collective(kind, "routed rows (dispatch, combine)", routed_bytes, 2 * passes * moe_layers * microbatches,
                     levels)
    if counts_bytes:
        out += collective("all-gather", "assignments per expert", counts_bytes,
                          (1 + recomputed) * moe_layers * microbatches, levels)
    return out


def bubble(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The idle fraction of a pipeline schedule: GPipe (P-1)/(M+P-1) for P stages and M microbatches, circular
    (P-1)/(R M+P-1) with R repeats (scaling.md: the book gives no formula of its own)."""
    return (stages - 1) / (repeats * microbatches + stages - 1)


def _layout(dims: tuple[int, ...], sizes: Sequence[tuple[str, int]]) -> dict[str, list[int]]:
    """Chips each mesh axis takes along each physical axis, after jax.experimental.mesh_utils' rule: axes
    innermost first (tensor first: the most network-intensive), each on whole free physical axes whose product is
    its size (as many as possible), else on factors of them, taken in physical-axis order (mesh.py allows split
    physical axes). jax's own splitting is not called: jax 0.10's could not factor a size with a prime factor
    above its square root (it failed on the full v5p pod's 28)."""
    free, out = list(dims), {}
    for name, size in reversed(sizes):
        take = [1] * len(dims)
        whole = [c for n in range(len(dims), 0, -1) for c in itertools.combinations(range(len(dims)), n)
                 if all(free[i] > 1 for i in c) and math.prod(free[i] for i in c) == size]
        if size > 1 and whole:
            for i in whole[0]:
                take[i] = free[i]
        else:  # always completes: the free chips multiply to the product of this and the outer axes' sizes
            need = size
            for i in range(len(dims)):
                take[i] = math.gcd(need, free[i])
                need //= take[i]
        free = [f // t for f, t in zip(free, take)]
        out[name] = take
    return out


def links(topo: Topology, ici: Mapping[str, int], dcn: Mapping[str, int]) -> dict[str, list[Link]]:
    """Each mesh axis's levels, innermost first: its ICI part (laid out on the slice's torus, or a GPU node)
    and its DCN part (named dcn_AXIS)."""
    chip = topo.chip
    layout = {} if chip.is_gpu else _layout(topo.dims, [(a, ici[a]) for a in MESH_AXES])
    out = {}
    for axis in MESH_AXES:
        if chip.is_gpu:
            ici_link = Link(axis, ici[axis], (ici[axis],), (False,), chip.ici_bandwidth_oneway,
                            chip.ici_bandwidth_bidi, switch=True)
        else:
            spans = [(t, t == d and w) for t, d, w in zip(layout[axis], topo.dims, topo.wraps) if t > 1]
            ici_link = Link(axis, ici[axis], tuple(t for t, _ in spans), tuple(w for _, w in spans),
                            chip.ici_bandwidth_oneway, chip.ici_bandwidth_bidi, switch=False)
        dcn_bw = chip.dcn_bandwidth or 0.0  # topology() refuses slices > 1 without a DCN figure
        dcn_link = Link(f"dcn_{axis}", dcn[axis], (dcn[axis],), (False,), dcn_bw, dcn_bw, switch=True, hop_latency=0.0)
        out[axis] = [ici_link, dcn_link]
    return out


def by_axis(transfers: Iterable[Transfer]) -> tuple[dict[str, float], dict[str, float]]:
    """(bytes per device, seconds) per step for every level of every mesh axis (ICI `fsdp`, DCN `dcn_fsdp`)."""
    names = [*MESH_AXES, *(f"dcn_{a}" for a in MESH_AXES)]
    sent, seconds = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
    for t in transfers:
        sent[t.axis] += t.bytes_per_device
        seconds[t.axis] += t.seconds
    return sent, seconds
