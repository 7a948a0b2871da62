"""The mixtral family's decoder: the skeleton's stack of units, each a routed block (attention, then a mixture of
experts, moe.py) or, with model.moe_every = k > 1, a group of k - 1 dense blocks and one routed block. Its
blocks' auxiliary sums are the router's; the decoder's penalty and metrics are the router's losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from scaletrain.models import lora
from scaletrain.models.llama import Block, Llama
from scaletrain.models.mixtral import moe
from scaletrain.models.transformer import ModelConfig

# The key of a mixture of experts' router sums in a block's auxiliary dict.
ROUTER = "router"


class RoutedBlock(Block):
    """Attention then a mixture of experts; a call returns the stream and {ROUTER: moe.sums}."""

    @staticmethod
    def feed_forward(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return moe.MoE(cfg, rngs)

    def _feed_forward(self, x_btd, one_matmul: bool = True) -> tuple[jax.Array, dict]:
        out, sums = self.mlp(x_btd, self.mlp_norm)
        return x_btd + out, {ROUTER: sums}


class MoEGroup(nnx.Module):
    """model.moe_every = k > 1: the unit the layer scan repeats, k - 1 dense blocks (stacked along `sublayers`)
    then one mixture-of-experts block."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=cfg.moe_every - 1)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "sublayers"})
        def make_dense(rngs):
            return Block(cfg, rngs)

        self.dense = make_dense(rngs)
        self.moe = RoutedBlock(cfg, rngs)
        self.dense_layers = cfg.moe_every - 1
        self.unroll = cfg.unroll_loops

    def _dense_scan(self, step, x_btd, xs=None):
        graphdef, stacked = nnx.split(self.dense)
        return jax.lax.scan(lambda x, p: step(nnx.merge(graphdef, p[0]), x, p[1]), x_btd, (stacked, xs),
                            unroll=self.unroll)

    def __call__(self, x_btd, sin_bth, cos_bth, segment_ids_bt) -> tuple[jax.Array, dict]:
        """The stream and the group's auxiliary sums: its MoE block's (the dense blocks have none). Each of its
        layers drops its own elements under LoRA's dropout (lora.within)."""
        group = self.dense_layers + 1

        def dense(block, x, i):
            with lora.within(group, i):
                return block(x, sin_bth, cos_bth, segment_ids_bt)

        x_btd, _ = self._dense_scan(dense, x_btd, jnp.arange(self.dense_layers))
        with lora.within(group, self.dense_layers):
            return self.moe(x_btd, sin_bth, cos_bth, segment_ids_bt)

    def decode(self, x_btd, sin_bth, cos_bth, start, cache):
        """Block.decode through the group; `cache` holds the group's layers [moe_every, ...]."""
        k_cache, v_cache = cache
        x_btd, dense_cache = self._dense_scan(lambda block, x, c: block.decode(x, sin_bth, cos_bth, start, c),
                                              x_btd, (k_cache[:-1], v_cache[:-1]))
        x_btd, (k_last, v_last) = self.moe.decode(x_btd, sin_bth, cos_bth, start, (k_cache[-1], v_cache[-1]))
        return x_btd, (jnp.concatenate([dense_cache[0], k_last[None]]),
                       jnp.concatenate([dense_cache[1], v_last[None]]))


class Mixtral(Llama):
    """Llama's decoder with routed units (model.num_experts > 0: the config checks it)."""

    @staticmethod
    def unit(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return MoEGroup(cfg, rngs) if cfg.moe_every > 1 else RoutedBlock(cfg, rngs)

    @staticmethod
    def unit_layers(cfg: ModelConfig) -> int:
        return cfg.moe_every

    def penalty(self, aux: dict) -> jax.Array:
        """The router's losses at the config's coefficients (moe.penalty), for the stacked sums."""
        return moe.penalty(self.cfg.router_aux_loss, self.cfg.router_z_loss, aux[ROUTER])

    def aux_metrics(self, aux: dict) -> dict:
        """The router's metrics (moe.metrics)."""
        return moe.metrics(aux[ROUTER])
