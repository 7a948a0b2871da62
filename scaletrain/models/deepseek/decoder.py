"""The deepseek family's decoder: blocks of latent attention (mla.py), the first model.first_dense_layers of them
with the SwiGLU MLP, stacked apart and run before the scanned stack, whose blocks have a mixture of experts (routed
as model.router_* say: models/routing.py) plus model.shared_experts always-on experts. The dense first layers run
beside the embedding, outside the layer stack a pipeline splits: every pipeline stage holds them (DeepSeek-V3 has
3 of 61)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scaletrain.models import mtp
from scaletrain.models.deepseek.mla import LatentAttention
from scaletrain.models.mixtral import moe
from scaletrain.models.mixtral.decoder import ROUTER, Mixtral, RoutedBlock
from scaletrain.models.mlp import MLP
from scaletrain.models.transformer import Block, ModelConfig, decode_scan, layer_body
from scaletrain.parallel import pipeline


class DenseBlock(Block):
    """A dense first layer: latent attention, then the SwiGLU MLP of width d_ff."""

    attention = LatentAttention


class SharedExperts(nnx.Module):
    """The routed experts (moe.MoE) plus model.shared_experts always-on ones, which are one SwiGLU MLP of their
    summed width (as Hugging Face stores them), on the same normalised input."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.routed = moe.MoE(cfg, rngs)
        self.shared = (MLP(dataclasses.replace(cfg, d_ff=cfg.shared_experts * cfg.expert_d_ff), rngs)
                       if cfg.shared_experts else None)

    def __call__(self, x_btd, norm) -> tuple[jax.Array, dict]:
        out_btd, sums = self.routed(x_btd, norm)
        if self.shared is not None:
            out_btd = out_btd + self.shared(x_btd, norm)
        return out_btd, sums


class MoEBlock(RoutedBlock):
    """Latent attention, then the routed and shared experts; returns {ROUTER: moe.sums} beside the stream."""

    attention = LatentAttention

    @staticmethod
    def feed_forward(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return SharedExperts(cfg, rngs)


class DeepSeek(Mixtral):
    """Mixtral's decoder (router losses and metrics) with DeepSeek's blocks and the dense first layers."""

    @staticmethod
    def unit(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return MoEBlock(cfg, rngs)

    @staticmethod
    def unit_layers(cfg: ModelConfig) -> int:
        return 1

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        if cfg.first_dense_layers:
            @nnx.split_rngs(splits=cfg.first_dense_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "dense_layers"})
            def make_dense(rngs):
                return DenseBlock(cfg, rngs)

            self.dense_layers = make_dense(rngs)
        if cfg.mtp_depth:
            self.mtp = mtp.stacked(cfg, type(self).unit, rngs)

    def stack_inputs(self, tokens_bt, positions_bt, segment_ids_bt, remat_layers: bool = True,
                     dropout_seeds=None, layer_ids=None):
        """The skeleton's pieces, the embedded stream run through the dense first layers (under the remat
        policy, as the stack's layers are)."""
        x_btd, body, stacked, extras = super().stack_inputs(tokens_bt, positions_bt, segment_ids_bt, remat_layers,
                                                            dropout_seeds, layer_ids)
        if self.cfg.first_dense_layers:
            x_btd = self._dense(x_btd, *extras[:3])
        return x_btd, body, stacked, extras

    def _dense(self, x_btd, sin_bth, cos_bth, segment_ids_bt):
        graphdef, stacked = nnx.split(self.dense_layers)
        return pipeline.scan(layer_body(self.cfg, graphdef), x_btd, stacked, (sin_bth, cos_bth, segment_ids_bt),
                             self.cfg.unroll_loops)[0]

    def ahead(self, graphdef, params, x_btd, batch, head_loss) -> dict:
        """The multi-token prediction modules' sums (models/mtp.py), where model.mtp_depth > 0."""
        return {mtp.MTP: mtp.sums(graphdef, params, x_btd, batch, head_loss)} if self.cfg.mtp_depth else {}

    def penalty(self, aux: dict) -> jax.Array:
        """The stack's router losses, plus model.mtp_loss_weight / D x each module's loss: its cross-entropy and
        its block's router losses."""
        out = super().penalty(aux)
        if mtp.MTP in aux:
            cfg, sums = self.cfg, aux[mtp.MTP]
            out += mtp.penalty(cfg.mtp_loss_weight, sums)
            out += cfg.mtp_loss_weight * moe.penalty(cfg.router_aux_loss, cfg.router_z_loss, sums[ROUTER])
        return out

    def aux_metrics(self, aux: dict) -> dict:
        return super().aux_metrics(aux) | (mtp.metrics(aux[mtp.MTP]) if mtp.MTP in aux else {})

    def after_update(self, params, aux: dict, keep: jax.Array, order: np.ndarray | None = None):
        """Aux-loss-free balancing (model.router_bias_update_rate = u > 0): each mixture's selection bias - the
        stack's and the multi-token prediction modules' - moves by u x sign(mean load - load) per expert, from
        the step's assignments counted over the whole batch, centred so that the biases' mean stays put; nothing
        where the step's update was dropped."""
        rate = self.cfg.router_bias_update_rate
        if not rate:
            return params

        def moved(stack: dict, load: jax.Array) -> dict:  # load: [layers, experts]
            step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
            step = jnp.where(keep, step - jnp.mean(step, axis=-1, keepdims=True), 0.0)
            mlp = stack["mlp"]
            return {**stack, "mlp": {**mlp, "routed": {**mlp["routed"],
                                                       "router_bias": mlp["routed"]["router_bias"] + step}}}

        load = aux[ROUTER]["load"] if order is None else aux[ROUTER]["load"][order]
        params = {**params, "layers": moved(params["layers"], load)}
        if mtp.MTP in aux:
            modules = params["mtp"]
            params["mtp"] = {**modules, "block": moved(modules["block"], aux[mtp.MTP][ROUTER]["load"])}
        return params

    def init_cache(self, batch: int, max_len: int):
        """(the dense first layers' cache, the stack's): keys [layers, b, max_len, heads, head_dim] and values
        [..., v_head_dim] each."""
        cfg = self.cfg
        v_dim = cfg.v_head_dim or cfg.head_dim

        def cache(layers: int):
            return (jnp.zeros((layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim), cfg.dtype),
                    jnp.zeros((layers, batch, max_len, cfg.num_kv_heads, v_dim), cfg.dtype))

        return cache(cfg.first_dense_layers), cache(cfg.stack_layers)

    def decode(self, tokens_bt, start, cache):
        dense_cache, stack_cache = cache
        x_btd, sin_bth, cos_bth = self.decode_inputs(tokens_bt, start)
        if self.cfg.first_dense_layers:
            x_btd, dense_cache = decode_scan(self.cfg, self.dense_layers, x_btd, sin_bth, cos_bth, start,
                                             dense_cache)
        x_btd, stack_cache = decode_scan(self.cfg, self.layers, x_btd, sin_bth, cos_bth, start, stack_cache)
        return self.logits(self.final_stream(x_btd)), (dense_cache, stack_cache)


__all__ = ["ROUTER", "DeepSeek", "DenseBlock", "MoEBlock", "SharedExperts"]
