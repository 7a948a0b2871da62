"""Parameter counts and training FLOPs of a Llama model: the numbers MFU, the planner and sweeps share.

Convention: a multiply-add is 2 FLOPs; training is 3x the forward pass (backward = 2x forward); causal
attention is counted as the useful half of the full T x T score and value matmuls; norms, softmax, RoPE
and the embedding lookup are not counted (well under 1% at Llama sizes). A mixture of experts counts the
weights a token is multiplied with - its router and the k experts it is routed to, not all E: the "active
parameters" MoE models are compared by. Remat recomputation is not useful work and is not counted: MFU is model
FLOPs utilisation. Post-training changes the passes (`passes`): a frozen base (LoRA) has no weight gradient, its
adapters train in full; DPO's reference runs one more forward pass of the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from scaletrain import models as model_lib
from scaletrain.config_window import sliding_layers
from scaletrain.models import lora, quantize
from scaletrain.models.transformer import STACKS
from scaletrain.parallel.sharding import is_logical


@dataclass(frozen=True)
class ParamCount:
    """Parameters by role, each summed over the whole layer stack (dense and mixture-of-experts layers alike)."""

    embedding: int  # the input table, vocab x d_model
    attention: int  # Q, K, V, O
    mlp: int  # the feed-forwards: gate, up, down; a mixture of experts' router and every expert
    active_mlp: int  # of those, the weights one token multiplies: a MoE layer's router and k of its E experts
    norms: int  # the RMSNorm gains (QK norms' too)
    final_norm: int
    lm_head: int  # 0 when tied to the embedding
    quantized: int = 0  # of `matmul`, the weights a token multiplies in int8 or fp8 (model.quantization)
    adapters: int = 0  # LoRA's A and B (models/lora.py), every layer's (an expert's: E of them)
    active_adapters: int = 0  # of those, the ones a token multiplies (of a mixture's experts: k of E)
    # Vectors added, not multiplied (layers.added; no matmul FLOPs): GPT-OSS's biases and attention sinks
    biases: int = 0
    active_biases: int = 0  # of those, the ones a token uses (of a mixture's experts: k of E)
    heads_ahead: int = 0  # the output projection's further uses per token: multi-token prediction's (models/mtp.py)

    @property
    def total(self) -> int:
        return (self.embedding + self.attention + self.mlp + self.norms + self.final_norm + self.lm_head
                + self.adapters + self.biases)

    @property
    def active(self) -> int:
        """Parameters one token uses: all but the experts it is not routed to (Mixtral's "active parameters")."""
        return (self.total - self.mlp + self.active_mlp - self.adapters + self.active_adapters - self.biases
                + self.active_biases)

    @property
    def matmul(self) -> int:
        """Weights each token is multiplied with: every layer's projections - of a mixture of experts, the router
        and the k experts the token is routed to; the multi-token prediction modules' blocks and projections
        among them - and the output projection (the embedding table itself when tied), once and again for each
        module."""
        return self.attention + self.active_mlp + (1 + self.heads_ahead) * (self.lm_head or self.embedding)


def param_count(model_cfg) -> ParamCount:
    """Counted from the model's own abstract parameters (model.abstract), so that any array the model has - QK
    norms, weightless norms' absence, routers - is counted as built. Under `layers` (stacked along `layers`, and
    `sublayers` for the dense layers of a group, model.moe_every > 1): a parameter with one dim of its own is a
    norm gain, the rest are the feed-forward's (under `mlp`) or attention's; an array with an `experts` dim holds
    E experts of which a token uses k."""
    _, params, logical = model_lib.abstract(model_cfg)
    low, vectors = model_lib.quantized(model_cfg), model_lib.added(model_cfg)
    sizes = dict.fromkeys(("attention", "mlp", "active_mlp", "norms", "quantized", "adapters", "active_adapters",
                           "biases", "active_biases"), 0)
    # every stack of layers: `layers`, DeepSeek's dense first layers before it and its multi-token prediction
    # modules after it (models/deepseek, models/mtp.py: their projection counted with attention's)
    stacks = [s for s in ("layers", "dense_layers", "mtp") if s in params]
    flat = [leaf for s in stacks for leaf in jax.tree_util.tree_flatten_with_path(params[s])[0]]
    names_of = [n for s in stacks for n in jax.tree.leaves(logical[s], is_leaf=is_logical)]
    rounded_of, added_of = ([r for s in stacks for r in jax.tree.leaves(tree[s])] for tree in (low, vectors))
    for (path, x), names, rounded, bias in zip(flat, names_of, rounded_of, added_of):
        own = [n for n in names if n not in STACKS]
        used = x.size // model_cfg.num_experts * model_cfg.experts_per_token if "experts" in names else x.size
        if lora.is_adapter(path):
            sizes["adapters"] += x.size
            sizes["active_adapters"] += used
            continue
        if bias:
            sizes["biases"] += x.size
            sizes["active_biases"] += used
            continue
        if len(own) == 1:
            sizes["norms"] += x.size
            continue
        if any(getattr(k, "key", None) == "mlp" for k in path):
            sizes["mlp"] += x.size
            sizes["active_mlp"] += used
        else:
            sizes["attention"] += x.size
        sizes["quantized"] += used if rounded else 0

    def size(name: str) -> int:
        return sum(x.size for x in jax.tree.leaves(params.get(name, {})))

    # The output head as its matmul takes it (the lm_head's own annotation says the same; a tied table's is the
    # lookup's compute dtype).
    head = quantize.for_group(model_cfg, "output") is not None
    sizes["quantized"] += (1 + model_cfg.mtp_depth) * (size("lm_head") or size("embed")) if head else 0
    return ParamCount(embedding=size("embed"), **sizes, final_norm=size("final_norm"), lm_head=size("lm_head"),
                      heads_ahead=model_cfg.mtp_depth)


def attention_keys(m, seq_len: int) -> float:
    """The keys a query meets, averaged over a sequence's positions and summed over the layers: T / 2 for a full
    (causal) layer, W - W (W - 1) / 2T for a sliding layer whose window W is shorter than the sequence (the first W
    positions see fewer) - model.sliding_window, model.layer_types."""
    slides = int(sliding_layers(m.layer_types, m.num_layers).sum())
    w = m.sliding_window
    sliding = w - w * (w - 1) / (2 * seq_len) if 0 < w < seq_len else seq_len / 2
    # the multi-token prediction modules' blocks (models/mtp.py) attend in full
    return (m.num_layers + m.mtp_depth - slides) * seq_len / 2 + slides * sliding


def attention_flops_per_token(m, seq_len: int) -> float:
    """Training FLOPs of causal attention scores and values per token: 3 * 2 N (H + H_v) x the keys a query
    meets (attention_keys), H_v the values' head size (latent attention's v_head_dim; else H) - 6 T N H L without
    sliding windows."""
    return 6.0 * m.num_heads * (m.head_dim + (m.v_head_dim or m.head_dim)) * attention_keys(m, seq_len)


def passes(m, reference: bool = False) -> int:
    """Passes a training step makes over each weight matrix of the model per token: the forward pass, the input
    gradient, the weight gradient (none where the base is frozen: LoRA, model.lora_rank > 0) and, with
    `reference`, DPO's reference forward (objective.runs_reference). 3 for pretraining."""
    return 2 + (not m.lora_rank) + reference


def flops_per_token(m, seq_len: int, reference: bool = False) -> float:
    """Training FLOPs per token: 2 x `passes` per matmul weight the token is multiplied with (ParamCount.matmul: a
    mixture of experts' active weights; 6 for pretraining), 6 per adapter weight (trained in full), plus causal
    attention (a fourth pass with `reference`)."""
    count = param_count(m)
    return (2.0 * passes(m, reference) * count.matmul + 6.0 * count.active_adapters
            + attention_flops_per_token(m, seq_len) * (3 + reference) / 3)


def quantized_share(m, seq_len: int, reference: bool = False) -> float:
    """The share of flops_per_token that model.quantization runs in int8 or fp8 (0 without): the weight in MFU's
    peak of the chip's low-precision rate (hardware.Chip.mixed_peak)."""
    return 2.0 * passes(m, reference) * param_count(m).quantized / flops_per_token(m, seq_len, reference)
