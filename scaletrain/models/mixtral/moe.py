"""The mixture-of-experts feed-forward block (Mixtral): a softmax router sends each token to its top-k experts,
SwiGLU feed-forwards stacked as `[experts, ...]` arrays, and sums their outputs weighted by the router's
probabilities renormalised over the k chosen.

The block runs per device (sharding.local: jax.shard_map over every mesh axis), on the device's own tokens:
routing needs no other device's, and a sort over the whole batch would gather it. Its experts live on the
`expert` mesh axis (split `experts` dim, the batch split over `expert` too), so tokens travel to their experts'
devices and back by all-to-all; their hidden dim lives on `tensor` (a partial sum, reduced once at the end).

Two ways to compute (model.capacity_factor, docs/moe.md):
- dropless (0): every assignment (token, choice) is computed. Assignments are sorted by expert and multiplied
  with a grouped matmul (jax.lax.ragged_dot); across devices they travel by jax.lax.ragged_all_to_all on TPU,
  and on other backends (XLA:CPU has no ragged all-to-all) by an all-to-all padded to the most one device can
  send another - the same rows arrive in the same order.
- capacity (> 0): each expert takes at most C = ceil(capacity_factor x seq_len x k / experts) assignments from
  each sequence, first choices before second ones and earlier positions first; the rest are dropped (their
  share of the token's output is zero) and counted. Buffers are [experts, C] per sequence, so the all-to-all
  has a fixed shape and a sequence's drops do not depend on the mesh.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from scaletrain.kernels import grouped_matmul
from scaletrain.models import lora, quantize
from scaletrain.models.layers import added, param
from scaletrain.models.mixtral import unit as unit_lib
from scaletrain.models.routing import ROUTER_BIAS, SOFTMAX, Routing
from scaletrain.parallel.sharding import active_axes, active_device, constrain, local

# Per-layer router statistics, summed over the batch (`router_stats`'s vector): the load-balancing loss (per
# sequence, times its length), the z-loss (per token), the dropped assignments, then the assignments per expert.
AUX, Z, DROPPED, LOAD = 0, 1, 2, 3


def sums(stats: jax.Array, tokens: int) -> dict:
    """A layer's auxiliary sums (what MoE.__call__ returns beside the stream, the runners stack along the layers
    and add across microbatches): the statistics vector by name, and the tokens it sums over."""
    return {"aux": stats[AUX], "z": stats[Z], "dropped": stats[DROPPED], "load": stats[LOAD:],
            "tokens": jnp.float32(tokens)}


def penalty(router_aux_loss: float, router_z_loss: float, stacked: dict) -> jax.Array:
    """What the objective adds for the router: router_aux_loss x the load-balancing loss + router_z_loss x the
    z-loss, each summed over the tokens like the cross-entropy (so that microbatches add up to their batch and the
    step's division by the token count makes both means) and averaged over the MoE layers. `stacked`: `sums`
    stacked along the MoE layers. Linear in the sums, as a pipeline's hand-written backward pass needs."""
    layers = stacked["aux"].shape[0]
    return (router_aux_loss * jnp.sum(stacked["aux"]) + router_z_loss * jnp.sum(stacked["z"])) / layers


def metrics(stacked: dict) -> dict:
    """What metrics.jsonl logs of the router: its two losses (means over tokens and MoE layers), the busiest
    expert's load over the mean load (1 when balanced; the worst layer's), and the share of assignments dropped
    for want of capacity."""
    load, tokens = stacked["load"], jnp.sum(stacked["tokens"])
    return {"router_aux_loss": jnp.sum(stacked["aux"]) / tokens, "router_z_loss": jnp.sum(stacked["z"]) / tokens,
            "expert_load_max": jnp.max(jnp.max(load, axis=1) / jnp.maximum(jnp.mean(load, axis=1), 1e-9)),
            "dropped_fraction": jnp.sum(stacked["dropped"]) / jnp.sum(load)}


def capacity(capacity_factor: float, seq_len: int, k: int, experts: int) -> int:
    """C: the assignments each expert takes from a sequence, with capacity buffers."""
    return math.ceil(capacity_factor * seq_len * k / experts)


def rows_per_token(k: int, experts: int, shards: int, capacity_factor: float, seq_len: int,
                   ragged: bool) -> tuple[float, float]:
    """Rows of d_model per token of a device's share of the batch, in each MoE layer: (those the device sends to
    its tokens' experts, those its experts receive and compute - the buffer the transport fills). Dropless: its
    k assignments per token; across `shards` expert devices, received into a buffer of shards x its tokens x
    min(k, experts per device) rows by the ragged all-to-all (`ragged`), or, padded, sent and received as
    `shards` blocks of all its assignments. With capacity buffers: experts x C per sequence, both ways."""
    if capacity_factor:
        rows = experts * capacity(capacity_factor, seq_len, k, experts) / seq_len
        return rows, rows
    if shards == 1:
        return k, k
    if ragged:
        return k, shards * min(k, experts // shards)
    return shards * k, shards * k


class MoE(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        d, f, e, pd = cfg.d_model, cfg.expert_d_ff, cfg.num_experts, cfg.param_dtype
        self.k, self.capacity_factor, self.moe_matmul = cfg.experts_per_token, cfg.capacity_factor, cfg.moe_matmul
        self.quant = quantize.for_group(cfg, "experts")
        self.router = param(rngs, (d, e), ("embed", None), pd, cfg.init_std)
        # Routing hook (models/routing.py): the scores, groups and scale; a selection-only bias, float32 always
        self.routing = Routing.of(cfg)
        self.router_bias = (nnx.Param(jnp.zeros((e,), jnp.float32), out_sharding=(ROUTER_BIAS,))
                            if cfg.router_correction_bias else None)
        self.w_gate = param(rngs, (e, d, f), ("experts", "embed", "moe_mlp"), pd, cfg.init_std, self.quant)
        self.w_up = param(rngs, (e, d, f), ("experts", "embed", "moe_mlp"), pd, cfg.init_std, self.quant)
        self.w_down = param(rngs, (e, f, d), ("experts", "moe_mlp", "embed"), pd, cfg.out_std, self.quant)
        self.w_gate_lora = lora.adapter(cfg, "gate_proj", (e, d, f), ("experts", "embed", "moe_mlp"), rngs, lead=1)
        self.w_up_lora = lora.adapter(cfg, "up_proj", (e, d, f), ("experts", "embed", "moe_mlp"), rngs, lead=1)
        self.w_down_lora = lora.adapter(cfg, "down_proj", (e, f, d), ("experts", "moe_mlp", "embed"), rngs, lead=1)
        for name, logical in (("w_gate", ("experts", "embed", "moe_mlp")), ("w_up", ("experts", "embed", "moe_mlp")),
                              ("w_down", ("experts", "moe_mlp", "embed"))):
            lora.base_scale(cfg, self, name, getattr(self, name).shape, logical, lead=1)
        # GPT-OSS's biases (model.router_logit_bias, model.expert_bias) with their logical axes; and the experts'
        # gated unit (unit.py).
        self.biases = ((("router_logit_bias", (e,), (None,)),) if cfg.router_logit_bias else ()) + (
            (("b_gate", (e, f), ("experts", "moe_mlp")), ("b_up", (e, f), ("experts", "moe_mlp")),
             ("b_down", (e, d), ("experts", "embed"))) if cfg.expert_bias else ())
        for name, shape, logical in self.biases:
            setattr(self, name, added(shape, logical, pd))
        self.unit = unit_lib.Unit.of(cfg)
        self.gpt_oss_biases = (cfg.router_logit_bias, cfg.expert_bias)

    def __call__(self, x_btd: jax.Array, norm) -> tuple[jax.Array, dict]:
        """(the block's output [b, t, d] for norm(x), the router's `sums` over these rows)."""
        # The norm runs here, whole (any model.norm computes the same RMSNorm): the experts see their tokens
        # permuted, past where a norm could be fused into their matmul.
        h_btd = constrain(norm(x_btd), ("batch", "seq", "embed"))
        adapters = (self.w_gate_lora, self.w_up_lora, self.w_down_lora)
        platform = active_device().platform
        fn = _per_device(self.k, self.capacity_factor, active_axes("experts"), active_axes("moe_mlp"),
                         platform == "tpu", self.quant, active_axes("batch"), active_axes("seq"),
                         tuple(None if a is None else a.scale for a in adapters), self.routing,
                         self.router_bias is not None, self.unit, *self.gpt_oss_biases,
                         kernel=grouped_matmul.kind(self.moe_matmul, platform), platform=platform)
        up, down = ("experts", "embed", "moe_mlp"), ("experts", "moe_mlp", "embed")
        # The experts' weights, then each adapter's A and B, with their logical axes (models/lora.py's rule).
        weights = [(self.w_gate[...], up), (self.w_up[...], up), (self.w_down[...], down)]
        for a, logical in zip(adapters, (up, up, down)):
            if a is not None:
                weights += [(a.a[...], (*logical[:2], None)), (a.b[...], (logical[0], None, logical[2]))]
        weights += [(getattr(self, name)[...], logical) for name, _, logical in self.biases]
        logicals = tuple(logical for _, logical in weights)
        router = (self.router[...],) + (() if self.router_bias is None else (self.router_bias[...],))
        router_logicals = (("embed", None), (None,))[:len(router)]
        per_device = local(fn, (("batch", "seq", "embed"), *router_logicals, *logicals),
                           (("batch", "seq", "embed"), ("batch", None)))

        def block(h, *args):  # the experts gathered as the per-device block takes them
            # Pinned where the parameters lie first: left free, the backward pass's gather pulls the sharding of
            # the scan's saved copy to its own, and the forward pass stacks the gathered experts after all.
            experts = args[len(router):]
            return per_device(h, *args[:len(router)], *(constrain(constrain(w, logical, "params"), logical)
                                                         for w, logical in zip(experts, logicals)))

        # Whatever the remat policy, the backward pass gathers the experts again (as FSDP gathers every other
        # weight) rather than keeping every layer's gathered experts from the forward pass: under policy none
        # that held Mixtral 8x7B's at 2.8 GB a layer (163 GiB a chip on FSDP 64, 74 planned).
        out_btd, stats = jax.checkpoint(block, policy=_regather, prevent_cse=False)(
            h_btd, *router, *(w for w, _ in weights))
        out_btd = checkpoint_name(constrain(out_btd, ("batch", "residual_seq", "embed")), "mlp_out")
        return out_btd, sums(jnp.sum(stats, axis=0), x_btd.shape[0] * x_btd.shape[1])


def _regather(prim, *_, **__) -> bool:
    """The MoE block's remat policy: everything saveable but a sharding constraint's output (the gathered
    experts; the block's activations are constrained outside it)."""
    return prim.name != "sharding_constraint"


def route(h_td: jax.Array, router_de: jax.Array, k: int, routing: Routing = SOFTMAX,
          bias_e: jax.Array | None = None, logit_bias_e: jax.Array | None = None):
    """(expert ids [T, k], their weights [T, k] - by default the softmax's top k renormalised to sum to 1, the
    softmax of the top k logits as GPT-OSS takes it (`routing`, models/routing.py: how else) -, the router's
    probabilities [T, E] and logsumexp [T]), in float32. `bias_e`: the selection-only bias
    (model.router_correction_bias); `logit_bias_e`: a bias added to the logits (model.router_logit_bias), so
    inside the scores."""
    logits = jnp.dot(h_td.astype(jnp.float32), router_de.astype(jnp.float32))
    if logit_bias_e is not None:
        logits = logits + logit_bias_e.astype(jnp.float32)
    top_e, weights, probs = routing.select(logits, k, bias_e)
    return top_e, weights, probs, jax.nn.logsumexp(logits, axis=-1)


def router_stats(top_e_btk: jax.Array, probs_bte: jax.Array, lse_bt: jax.Array, dropped,
                 seq_axes: tuple[str, ...] = ()) -> jax.Array:
    """The statistics vector of `MoE.__call__` for these sequences. The load-balancing loss is Switch's and
    Mixtral's, E x sum_e f_e P_e (f_e: the share of the sequence's assignments that expert e got, P_e: its mean
    probability; 1 when balanced), taken per sequence so that it does not depend on how the batch is split.
    `seq_axes`: the mesh axes that split each sequence (context parallelism): every sum is then the whole
    sequence's, the same on each of them."""
    def whole(x):
        return jax.lax.psum(x, seq_axes) if seq_axes else x

    e, k = probs_bte.shape[-1], top_e_btk.shape[-1]
    t = probs_bte.shape[1] * (jax.lax.psum(1, seq_axes) if seq_axes else 1)
    load_be = whole(jnp.sum(jax.nn.one_hot(top_e_btk, e, dtype=jnp.float32), axis=(1, 2)))
    share_be = jax.lax.stop_gradient(load_be) / (t * k)
    aux = e * jnp.sum(share_be * whole(jnp.sum(probs_bte, axis=1)))
    return jnp.concatenate([jnp.stack([aux, whole(jnp.sum(lse_bt ** 2)), whole(dropped)]), jnp.sum(load_be, axis=0)])


def _per_device(k: int, capacity_factor: float, expert_axes: tuple[str, ...], tensor_axes: tuple[str, ...],
                ragged_transport: bool, quant: quantize.Quantization | None, batch_axes: tuple[str, ...] = (),
                seq_axes: tuple[str, ...] = (), lora_scales: tuple[float | None, ...] = (None, None, None),
                routing: Routing = SOFTMAX, router_bias: bool = False, unit: unit_lib.Unit = unit_lib.SWIGLU,
                router_logit_bias: bool = False, expert_bias: bool = False, kernel: str = "ragged_dot",
                platform: str = "cpu"):
    """The block on one device's tokens and weights: h [b, t, d], router [d, E], the device's experts
    [E_l, d, f_l] and [E_l, f_l, d] -> (output [b, t, d], statistics [1, stats]). `quant`: the experts' matmuls'
    low-precision mode (the router's stays float32); `batch_axes` the mesh axes that split the batch, `seq_axes`
    those that split each sequence (routing is per token: each device routes its own tokens). `lora_scales`: the
    gate, up and down projections' adapter scales (None: not adapted); each adapted one's A and B follow the
    experts' weights, in that order (models/lora.py). `routing` how the router picks and weighs (models/routing.py);
    `router_bias`: the router's selection bias [E] follows the router. After the adapters, with `router_logit_bias`
    the router's logit bias [E], and with `expert_bias` the experts' biases [E_l, f_l], [E_l, f_l], [E_l, d];
    `unit` the gated unit between the up and down projections; `kernel` the grouped matmul's on a device of
    `platform` (kernels/grouped_matmul.py)."""
    # An expert's rows lie on the devices of its expert shard: across the other batch and sequence axes (and,
    # being the same rows, not across `tensor`) a quantized matmul takes its gradient's scales as maxima over all.
    rows = tuple(a for a in batch_axes if a not in expert_axes) + seq_axes
    grouped = _GroupedMatmul(quant, tensor_axes, rows, unit, kernel, platform)
    adapted = 2 * sum(scale is not None for scale in lora_scales)

    def fn(h_btd, router_de, *weights):
        bias_e, (w_gate, w_up, w_down, *rest) = (weights[0], weights[1:]) if router_bias else (None, weights)
        adapters, biases = rest[:adapted], rest[adapted:]
        logit_bias_e, biases = (biases[0], biases[1:]) if router_logit_bias else (None, biases)
        b, t, d = h_btd.shape
        top_e, weights, probs, lse = route(h_btd.reshape(b * t, d), router_de, k, routing, bias_e, logit_bias_e)
        weights = weights.astype(h_btd.dtype)
        pairs = iter(zip(adapters[::2], adapters[1::2]))
        experts = tuple(w if scale is None else lora.Grouped(w, *next(pairs), scale)
                        for w, scale in zip((w_gate, w_up, w_down), lora_scales))
        if expert_bias:
            b_gate, b_up, b_down = biases
            if tensor_axes:  # the down projection's outputs are partial sums over `tensor`: its bias added once
                b_down = b_down * (jax.lax.axis_index(tensor_axes) == 0).astype(b_down.dtype)
            experts += (b_gate, b_up, b_down)
        if capacity_factor:
            rows_ktd, dropped = _with_capacity(h_btd, top_e.reshape(b, t, k), experts, capacity_factor,
                                               expert_axes, grouped)
        else:
            rows_ktd = _dropless(h_btd.reshape(b * t, d), top_e, experts, expert_axes, ragged_transport, grouped)
            dropped = 0.
        # Choice-major ([k, T, d], not [T, k, d]): the sum over k is then k whole [T, d] passes. With k minor,
        # the TPU tiles the [T, k, d] rows with k (2) padded to its tile's 8 sublanes, and the sum and its
        # gradient's broadcast moved more bytes than the block's other passes together: choice-major is 11%
        # faster by XLA's estimate (benchmarks/moe_dispatch.py, docs/moe.md).
        out_td = jnp.sum(rows_ktd * weights.T[:, :, None], axis=0)
        if tensor_axes:  # each device summed over its slice of the experts' hidden dim
            out_td = jax.lax.psum(out_td, tensor_axes)
        stats = router_stats(top_e.reshape(b, t, k), probs.reshape(b, t, -1), lse.reshape(b, t),
                             jnp.asarray(dropped, jnp.float32), seq_axes)
        return out_td.reshape(b, t, d), stats[None]

    return fn


def _swiglu(rows_rd, w_gate, w_up, w_down, matmul, down_matmul=None, plain=None, unit=unit_lib.SWIGLU,
            biases=None):
    """down(silu(rows W_gate) * (rows W_up)), each matmul `matmul(x, w)` grouped by expert (the down projection's
    `down_matmul`, where given); a weight with an adapter (lora.Grouped) adds its output, computed by `plain`
    (default `matmul`: the grouped matmul in the compute dtype). `unit`: the gated unit in place of silu(gate) *
    up; `biases`: the gate, up and down projections' biases, each placed to add to its output (or None)."""
    plain = plain or matmul
    b_gate, b_up, b_down = biases or (0, 0, 0)
    gate = checkpoint_name(lora.grouped(matmul, plain, rows_rd, w_gate) + b_gate, "moe_gate")
    up = checkpoint_name(lora.grouped(matmul, plain, rows_rd, w_up) + b_up, "moe_up")
    return lora.grouped(down_matmul or matmul, plain, unit(gate, up), w_down) + b_down


class _GroupedMatmul:
    """The experts' grouped matmuls on one device: jax.lax.ragged_dot or megablox's kernels (`kernel`, on a
    device of `platform`: kernels/grouped_matmul.py), or quantized (`quant`), where the hidden dim's mesh axes
    (`tensor_axes`: the gate and up projections' outputs, the down projection's contraction) and the axes across
    which an expert's rows are spread (`row_axes`) share the scales."""

    def __init__(self, quant: quantize.Quantization | None, tensor_axes: tuple[str, ...],
                 row_axes: tuple[str, ...], unit: unit_lib.Unit = unit_lib.SWIGLU, kernel: str = "ragged_dot",
                 platform: str = "cpu"):
        self.quant, self.tensor_axes, self.row_axes, self.unit = quant, tensor_axes, row_axes, unit
        self.kernel, self.platform = kernel, platform

    def swiglu(self, rows, group_sizes, experts):
        """The SwiGLU of rows sorted by expert, `group_sizes[e]` of them for expert e (rows past their sum are
        padding, which nothing reads: zeros with ragged_dot, left unwritten by megablox). `experts`: the three
        weights, then their biases where the experts have them."""
        def plain(x, w):
            return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=x.dtype)

        biases = unit_lib.rows_of_groups(experts[3:], group_sizes, rows.shape[0]) if experts[3:] else None
        experts = experts[:3]
        if self.quant is None:
            matmul = plain
            if self.kernel == "megablox":
                def matmul(x, w):  # the adapters' small matmuls stay ragged dots (`plain`)
                    return grouped_matmul.megablox(x, w, group_sizes, self.platform)
            return _swiglu(rows, *experts, matmul, plain=plain, unit=self.unit, biases=biases)

        def up(x, w):
            return self.quant.ragged_dot(x, w, group_sizes, out_axes=self.tensor_axes, row_axes=self.row_axes)

        def down(x, w):
            return self.quant.ragged_dot(x, w, group_sizes, contract_axes=self.tensor_axes, row_axes=self.row_axes)

        return _swiglu(rows, *experts, up, down, plain, unit=self.unit, biases=biases)


def _dropless(h_td, top_e, experts, expert_axes, ragged_transport, grouped: _GroupedMatmul) -> jax.Array:
    """Every assignment's expert output, [k, T, d]: the assignments sorted by expert, sent to their experts'
    devices, multiplied there grouped by expert, and returned to their places."""
    num_local = experts[0].shape[0]
    t, k = top_e.shape
    shards = _axis_size(expert_axes)
    flat_e = top_e.T.reshape(-1)  # choice-major: assignment c x T + i is token i's choice c
    order = jnp.argsort(flat_e, stable=True)
    inverse = _inverse(order)
    rows = _permute(jnp.tile(h_td, (k, 1)), order, inverse)  # [k T, d], by expert
    counts = jnp.bincount(flat_e, length=num_local * shards)  # this device's assignments per expert
    if shards == 1:
        out = grouped.swiglu(rows, counts, experts)
    else:
        received = rows_per_token(k, num_local * shards, shards, 0.0, 1, ragged_transport)[1]
        out = _expert_parallel(rows, counts, experts, expert_axes, ragged_transport, int(t * received), grouped)
    return _permute(out, inverse, order).reshape(k, t, -1)


def _inverse(order):
    """The inverse of permutation `order` (a scatter of its [rows] indices only)."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype), unique_indices=True)


@jax.custom_vjp
def _permute(rows, order, inverse):
    """rows[order] for a permutation `order` whose inverse is `inverse`; its gradient is the cotangent's rows put
    back by `inverse` - a gather both ways. Autodiff's transpose of a gather, or a forward `zeros.at[order].set`,
    is a scatter of whole [rows, d] arrays, which XLA:TPU widens to 32-bit buffers: three of them live per
    mixture layer's backward pass (9.3 GiB a chip for DeepSeek-V3 671B, docs/moe.md)."""
    return rows[order]


def _permute_fwd(rows, order, inverse):
    return rows[order], inverse


def _permute_bwd(inverse, g):
    return g[inverse], None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def _axis_size(axes) -> int:
    return math.prod(jax.lax.axis_size(a) for a in axes) if axes else 1


def _expert_parallel(rows, counts, experts, axes, ragged_transport, buffer_rows, grouped: _GroupedMatmul):
    """Rows sorted by (global) expert, `counts` per expert, computed by the devices along `axes` that hold their
    experts, and returned in the same order. `buffer_rows`: the most rows a device can receive, the ragged
    transport's buffer (rows_per_token's)."""
    num_local, shards = experts[0].shape[0], _axis_size(axes)
    me = jax.lax.axis_index(axes)
    all_counts = jax.lax.all_gather(counts, axes, tiled=False).reshape(shards, shards, num_local)  # [src, dst, e]
    sizes = jnp.sum(all_counts, axis=-1)  # [src, dst]: rows each device sends each
    send_offsets = _exclusive_cumsum(sizes[me])
    mine = all_counts[:, me]  # [src, e]: the rows for my experts, from each device
    if ragged_transport:
        received = _ragged_exchange(rows, send_offsets, sizes, me, buffer_rows, axes, back=False)
        starts = _exclusive_cumsum(sizes[:, me])
    else:
        received = _padded_exchange(rows, send_offsets, sizes[me], axes)
        starts = jnp.arange(shards) * rows.shape[0]
    # Each source's rows arrive sorted by expert; group them all by my experts for the grouped matmul.
    position = jnp.arange(received.shape[0])
    source = jnp.searchsorted(starts, position, side="right") - 1
    offset = position - starts[source]
    ends = jnp.cumsum(mine, axis=1)  # [src, e]
    local_e = jax.vmap(lambda e_ends, q: jnp.searchsorted(e_ends, q, side="right"))(ends[source], offset)
    order = jnp.argsort(local_e, stable=True)  # rows past a source's count get num_local: last
    inverse = _inverse(order)
    out = grouped.swiglu(_permute(received, order, inverse), jnp.sum(mine, axis=0), experts)
    out = _permute(out, inverse, order)
    if ragged_transport:
        return _ragged_exchange(out, send_offsets, sizes, me, rows.shape[0], axes, back=True)
    return _padded_exchange(out, send_offsets, sizes[me], axes, back=True)


def _exclusive_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


def _padded_exchange(rows, send_offsets, send_sizes, axes, back=False):
    """The all-to-all of rows grouped by destination (`send_sizes` each from `send_offsets`), every block padded
    to the most a device can send (all its rows): [R, d] -> [shards x R, d], source s's rows at s x R. With
    `back`, the reverse: each device's computed rows home again, [shards x R, d] -> [R, d] in the order sent."""
    shards = send_sizes.shape[0]
    r = rows.shape[0] // shards if back else rows.shape[0]
    position = jnp.arange(r)
    dst = jnp.searchsorted(send_offsets + send_sizes, position, side="right")
    slot = position - send_offsets[jnp.minimum(dst, shards - 1)]
    if back:
        blocks = jax.lax.all_to_all(rows.reshape(shards, r, -1), axes, 0, 0, tiled=False)
        return blocks[jnp.minimum(dst, shards - 1), slot]
    blocks = jnp.zeros((shards, r, rows.shape[-1]), rows.dtype).at[dst, slot].set(rows, mode="drop")
    return jax.lax.all_to_all(blocks, axes, 0, 0, tiled=False).reshape(shards * r, -1)


def _ragged_exchange(rows, send_offsets, sizes, me, out_rows, axes, back=False):
    """jax.lax.ragged_all_to_all of `_padded_exchange`'s rows, without the padding: received rows lie packed by
    source, in source order. `sizes[src, dst]` is what each device sends each."""
    if back:  # the computed rows return from where they were received to where they were sent from
        offsets, send, recv = _exclusive_cumsum(sizes[:, me]), sizes[:, me], sizes[me]
        output_offsets = _exclusive_cumsum(sizes, axis=1)[:, me]
    else:
        offsets, send, recv = send_offsets, sizes[me], sizes[:, me]
        output_offsets = _exclusive_cumsum(sizes, axis=0)[me]
    out = jnp.zeros((out_rows, rows.shape[-1]), rows.dtype)
    return jax.lax.ragged_all_to_all(rows, out, offsets.astype(jnp.int32), send.astype(jnp.int32),
                                     output_offsets.astype(jnp.int32), recv.astype(jnp.int32), axis_name=axes)


def _with_capacity(h_btd, top_e_btk, experts, capacity_factor, expert_axes, grouped: _GroupedMatmul):
    """Every assignment's expert output [k, b t, d] (zeros where dropped) and the number dropped, with at most
    C assignments per expert per sequence."""
    b, t, k = top_e_btk.shape
    num_local, d = experts[0].shape[0], h_btd.shape[-1]
    shards = _axis_size(expert_axes)
    e = num_local * shards
    most = capacity(capacity_factor, t, k, e)
    # Rank each expert's assignments within a sequence: first choices first, then by position.
    choice_major = jax.nn.one_hot(top_e_btk.swapaxes(1, 2).reshape(b, k * t), e, dtype=jnp.int32)
    rank = jnp.sum((jnp.cumsum(choice_major, axis=1) - 1) * choice_major, axis=-1)
    rank_btk = rank.reshape(b, k, t).swapaxes(1, 2)
    kept = rank_btk < most
    seq = jnp.broadcast_to(jnp.arange(b)[:, None, None], (b, t, k))
    slot = jnp.where(kept, rank_btk, most)  # out of bounds: dropped by the scatter
    buffers = jnp.zeros((b, e, most, d), h_btd.dtype).at[seq, top_e_btk, slot].set(
        jnp.broadcast_to(h_btd[:, :, None], (b, t, k, d)), mode="drop")
    rows = buffers.swapaxes(0, 1).reshape(e, b * most, d)  # [E, rows, d]
    if shards > 1:  # each device's experts take every device's rows for them: [E_l, shards x rows, d]
        rows = jax.lax.all_to_all(rows, expert_axes, 0, 1, tiled=True)
    if grouped.quant is None:
        out = _swiglu(rows, *experts[:3], lambda x, w: jnp.einsum("erd,edf->erf", x, w), unit=grouped.unit,
                      biases=tuple(b[:, None] for b in experts[3:]) or None)
    else:  # the buffers as groups of equal size, for the quantized grouped matmul and its shared scales
        el, r = rows.shape[:2]
        out = grouped.swiglu(rows.reshape(el * r, d), jnp.full((el,), r, jnp.int32), experts).reshape(el, r, d)
    if shards > 1:
        out = jax.lax.all_to_all(out, expert_axes, 1, 0, tiled=True)
    out = out.reshape(e, b, most, d).swapaxes(0, 1)
    seq, top_e, slot, kept = (jnp.moveaxis(x, -1, 0) for x in (seq, top_e_btk, slot, kept))  # choice-major
    gathered = out[seq, top_e, jnp.minimum(slot, most - 1)]
    gathered = jnp.where(kept[..., None], gathered, 0)
    return gathered.reshape(k, b * t, d), jnp.sum(~kept)
