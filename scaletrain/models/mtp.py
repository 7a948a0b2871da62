"""Multi-token prediction (DeepSeek-V3's MTP; model.mtp_depth = D > 0, model.mtp_loss_weight = w; docs/deepseek.md).

D modules run after the layer stack, one after the other. Module k (1..D) at position i takes the previous one's
stream h_{k-1} (h_0: the stack's output, before the final norm) and the embedding of the token k positions on,
t_{i+k}, and predicts t_{i+k+1}:

    h_k = Block_k(W_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h_{k-1})]),   logits_k = Head(RMSNorm_k(h_k))

Block_k is a layer of the stack's kind (DeepSeek-V3's: latent attention and the mixture), attending causally over
h_{k-1} with the main pass's positions and documents; Emb and Head are the model's own (shared, as DeepSeek-V3
shares them). Module k's loss is the cross-entropy summed over the positions whose target t_{i+k+1} is in the
loss mask and in position i's document; the objective adds w / D x the modules' summed losses to the next-token
loss's sum, so that after the step's division by the loss's token count the term is w x the mean over the depths
of each module's loss over the sequence (DeepSeek-V3's L_MTP = w / D sum_k L_k, each L_k over T tokens).

The tokens and targets k positions on are shifted on the host, in sequence order, before the batch is laid out
for the context axis (`lookahead`, called by the trainer's put_batch): every array then holds position i's own
values, the modules work token by token like the rest of the model, and context parallelism (any layout) and
packing need nothing more - no roll across devices in the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scaletrain.models import window
from scaletrain.models.layers import RMSNorm, param, project
from scaletrain.models.transformer import layer_body
from scaletrain.parallel.sharding import constrain

# The auxiliary sums' key (Decoder.ahead) and each depth's batch arrays: the token k on, its target, its weight.
MTP = "mtp"
_ARRAYS = {"tokens": np.int32, "targets": np.int32, "mask": np.float32}


def batch_keys(depth: int) -> dict[str, type]:
    """The batch arrays `lookahead` adds for `depth` modules, with their dtypes."""
    return {f"mtp{k}_{name}": dtype for k in range(1, depth + 1) for name, dtype in _ARRAYS.items()}


def lookahead(batch: dict[str, np.ndarray], depth: int) -> dict[str, np.ndarray]:
    """Each depth k's [rows, seq_len] arrays from a batch in sequence order: t_{i+k} (`tokens`), t_{i+k+1}
    (`targets`) and `mask`, position i + k's loss mask where it lies in position i's document (0 past the row)."""
    out = {}
    for k in range(1, depth + 1):
        def ahead(a: np.ndarray) -> np.ndarray:
            shifted = np.zeros_like(a)
            shifted[:, :-k] = a[:, k:]
            return shifted

        same = ahead(batch["segment_ids"]) == batch["segment_ids"]
        out |= {f"mtp{k}_tokens": ahead(batch["tokens"]), f"mtp{k}_targets": ahead(batch["targets"]),
                f"mtp{k}_mask": (ahead(batch["loss_mask"]) * same).astype(np.float32)}
    return out


class Depth(nnx.Module):
    """One module: the norms of the embedded token and of the previous stream, their concatenation's projection
    to d_model (`proj`, [2 d_model, d_model]: the embedding's rows first), one block, the norm before the head."""

    def __init__(self, cfg, unit, rngs: nnx.Rngs):
        d = cfg.d_model
        self.embed_norm = RMSNorm(d, cfg.norm_eps, cfg.param_dtype)
        self.hidden_norm = RMSNorm(d, cfg.norm_eps, cfg.param_dtype)
        self.proj = param(rngs, (2 * d, d), (None, "embed"), cfg.param_dtype, cfg.init_std)
        self.block = unit(cfg, rngs)
        self.final_norm = RMSNorm(d, cfg.norm_eps, cfg.param_dtype)

    def __call__(self, h_btd, e_btd, sin_bth, cos_bth, segment_ids_bt) -> tuple[jax.Array, dict]:
        x_btd = jnp.concatenate([self.embed_norm(e_btd), self.hidden_norm(h_btd)], axis=-1)
        return self.block(project(x_btd, self.proj[...]), sin_bth, cos_bth, segment_ids_bt)


def stacked(cfg, unit, rngs: nnx.Rngs) -> nnx.Module:
    """model.mtp_depth modules, their parameters stacked along `mtp_layers`."""
    @nnx.split_rngs(splits=cfg.mtp_depth)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "mtp_layers"})
    def make(rngs):
        return Depth(cfg, unit, rngs)

    return make(rngs)


def sums(graphdef: nnx.GraphDef, params, h_btd: jax.Array, batch: dict[str, jax.Array], head_loss) -> dict:
    """The modules run on the stack's output stream `h_btd`: {"loss": each depth's summed cross-entropy [D],
    "count": the tokens in it [D], and its block's auxiliary sums stacked [D, ...]}. `head_loss(graphdef, params,
    stream, targets, mask)` is the main head's summed loss (train/loss.py's)."""
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    sin_bth, cos_bth = window.rope_tables(cfg, batch["positions"])
    depth_def, depth_params = nnx.split(model.mtp)
    # One module's block under the remat policy, as the stack's layers run; outside a loop, so with the barrier
    # that keeps XLA from merging the recomputation into the forward pass.
    body = layer_body(cfg, depth_def, unrolled=True)
    losses, counts, auxes = [], [], []
    for k in range(cfg.mtp_depth):
        one = jax.tree.map(lambda a: a[k], depth_params)
        ahead = {name: batch[f"mtp{k + 1}_{name}"] for name in _ARRAYS}
        e_btd = model.embed(ahead["tokens"], cfg.dtype)
        h_btd, aux = body(h_btd, one, e_btd, sin_bth, cos_bth, batch["segment_ids"])
        # As the main head's stream (Decoder.final_stream): normed split along the sequence, then gathered.
        normed = constrain(nnx.merge(depth_def, one).final_norm(h_btd), ("batch", "residual_seq", "embed"))
        stream = constrain(normed, ("batch", "seq", "embed"))
        losses.append(head_loss(graphdef, params, stream, ahead["targets"], ahead["mask"]))
        counts.append(jnp.sum(ahead["mask"]))
        auxes.append(aux)
    return {"loss": jnp.stack(losses), "count": jnp.stack(counts), **jax.tree.map(lambda *a: jnp.stack(a), *auxes)}


def penalty(weight: float, mtp: dict) -> jax.Array:
    """What the objective adds for the modules' sums: weight / D x their summed losses (linear in the sums)."""
    return weight * jnp.sum(mtp["loss"]) / mtp["loss"].shape[0]


def metrics(mtp: dict) -> dict:
    """metrics.jsonl's `mtp_loss`: the modules' cross-entropy per token, over every depth (unweighted)."""
    return {"mtp_loss": jnp.sum(mtp["loss"]) / jnp.maximum(jnp.sum(mtp["count"]), 1.0)}


__all__ = ["MTP", "Depth", "batch_keys", "lookahead", "metrics", "penalty", "stacked", "sums"]
