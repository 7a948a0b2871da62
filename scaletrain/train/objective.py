"""What a step minimises (`train.objective`, docs/post-training.md): the next-token cross-entropy (`lm`), or the
DPO loss of preference pairs (`dpo`).

An objective gives the runner its head: a function of the final stream that returns the summed loss and the sums
its metrics are made of, over the rows it is given. Every term is a sum over rows, so microbatches (gradient
accumulation, a pipeline's) add up to their batch. The step divides by `count` (tokens for `lm`, pairs for
`dpo`), which makes the loss and the gradient the batch's mean: TRL's token mean for SFT, its mean over pairs for
DPO.

DPO, as TRL (>= 0.29) computes it. Each row holds one pair: segment 1 is prompt + chosen, segment 2 prompt +
rejected (the data's layout, data/packing.py), and loss_mask marks the completions' tokens. A sequence's log-prob
is the sum of its completion tokens' log-probs, for the policy and for the reference (`ref_logprobs`, per token:
precomputed in the data, or computed by the step from the reference's parameters). Then, with
delta = (policy - reference)(chosen) - (policy - reference)(rejected):
  sigmoid: -log sigmoid(beta delta), with label smoothing e: -(1 - e) log sigmoid(beta delta) - e log sigmoid(-beta
           delta) (cDPO; TRL >= 0.29 ignores e here);
  ipo:     (delta / completion length, each sequence's own - 1 / (2 beta))^2;
  hinge:   relu(1 - beta delta).
The rewards logged are beta (policy - reference) of each sequence, as TRL's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from scaletrain.train.loss import head_loss, token_losses

CHOSEN, REJECTED = 1, 2  # a DPO row's segment ids


@dataclasses.dataclass(frozen=True)
class LM:
    """The next-token cross-entropy over the loss mask's tokens."""

    needs_reference = False

    def rows(self, batch: dict) -> dict:
        """The per-row arrays the head reads."""
        return {"targets": batch["targets"], "mask": batch["loss_mask"]}

    def head(self, graphdef: nnx.GraphDef, params: Any, x_btd: jax.Array, rows: dict) -> tuple[jax.Array, dict]:
        return head_loss(graphdef, params, x_btd, rows["targets"], rows["mask"]), {}

    def count(self, batch: dict) -> jax.Array:
        """What the loss is a mean over: the tokens in the loss."""
        return jnp.sum(batch["loss_mask"])

    def metrics(self, sums: dict, count: jax.Array) -> dict:
        return {}


NEXT_TOKEN = LM()  # the default objective: pretraining's, and SFT's


@dataclasses.dataclass(frozen=True)
class DPO:
    """Direct preference optimisation of one pair a row (see the module docstring)."""

    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    needs_reference = True

    def rows(self, batch: dict) -> dict:
        return {"targets": batch["targets"], "mask": batch["loss_mask"], "segments": batch["segment_ids"],
                "reference": batch["ref_logprobs"]}

    def head(self, graphdef: nnx.GraphDef, params: Any, x_btd: jax.Array, rows: dict) -> tuple[jax.Array, dict]:
        logprobs = -token_losses(graphdef, params, x_btd, rows["targets"])
        chosen, rejected = (rows["mask"] * (rows["segments"] == s) for s in (CHOSEN, REJECTED))
        pairs = (jnp.sum(chosen, axis=1) > 0).astype(jnp.float32)
        ratio_c, ratio_r = (jnp.sum((logprobs - rows["reference"]) * w, axis=1) for w in (chosen, rejected))
        delta = ratio_c - ratio_r
        if self.loss == "ipo":
            lengths = (jnp.maximum(jnp.sum(w, axis=1), 1.0) for w in (chosen, rejected))
            per_pair = (ratio_c / next(lengths) - ratio_r / next(lengths) - 1 / (2 * self.beta)) ** 2
        elif self.loss == "hinge":
            per_pair = jax.nn.relu(1 - self.beta * delta)
        else:
            e = self.label_smoothing
            per_pair = (1 - e) * jax.nn.softplus(-self.beta * delta) + e * jax.nn.softplus(self.beta * delta)
        reward_c, reward_r = jax.lax.stop_gradient((self.beta * ratio_c, self.beta * ratio_r))
        sums = {"chosen": jnp.sum(reward_c * pairs), "rejected": jnp.sum(reward_r * pairs),
                "correct": jnp.sum((reward_c > reward_r) * pairs)}
        return jnp.sum(per_pair * pairs), sums

    def count(self, batch: dict) -> jax.Array:
        """The pairs: rows whose chosen sequence has completion tokens (the rest are padding rows)."""
        chosen = batch["loss_mask"] * (batch["segment_ids"] == CHOSEN)
        return jnp.sum(jnp.sum(chosen, axis=1) > 0).astype(jnp.float32)

    def metrics(self, sums: dict, count: jax.Array) -> dict:
        return {"dpo_chosen_reward": sums["chosen"] / count, "dpo_rejected_reward": sums["rejected"] / count,
                "dpo_margin": (sums["chosen"] - sums["rejected"]) / count, "dpo_accuracy": sums["correct"] / count}


Objective = LM | DPO


def of(cfg) -> Objective:
    """The config's objective."""
    if cfg.train.objective == "dpo":
        return DPO(cfg.dpo.beta, cfg.dpo.loss, cfg.dpo.label_smoothing)
    return LM()


def runs_reference(cfg) -> bool:
    """Whether the step runs a reference forward pass (DPO, its log-probs not precomputed): the cost model counts
    it (facts/flops.py)."""
    return reference_kind(cfg) in ("copy", "adapters_off")


def reference_kind(cfg) -> str:
    """Where DPO's reference log-probs come from: "precomputed" (the data's), "adapters_off" (LoRA's base: the
    policy's own parameters with the adapters at zero) or "copy" (a frozen copy of checkpoint.init_from's
    parameters); "" for an objective without a reference."""
    if cfg.train.objective != "dpo":
        return ""
    if cfg.dpo.reference != "auto":
        return cfg.dpo.reference
    return "adapters_off" if cfg.lora.rank else "copy"
