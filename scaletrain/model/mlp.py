"""The SwiGLU feed-forward block: down(silu(x W_gate) * (x W_up))."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from scaletrain.model.layers import param, project
from scaletrain.sharding import constrain


class MLP(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        d, f, pd = cfg.d_model, cfg.d_ff, cfg.param_dtype
        self.w_gate = param(rngs, (d, f), ("embed", "mlp"), pd, cfg.init_std)
        self.w_up = param(rngs, (d, f), ("embed", "mlp"), pd, cfg.init_std)
        self.w_down = param(rngs, (f, d), ("mlp", "embed"), pd, cfg.out_std)

    def __call__(self, x_btd: jax.Array, norm) -> jax.Array:
        """The MLP of norm(x): the norm is applied with the gate/up projection (model.norm)."""
        # Gate and up as one matmul against [embed, 2, mlp] (a tensor-parallel shard of mlp holds both halves of
        # its columns): the backward pass sums the two input gradients before they leave the device - one
        # reduce-scatter instead of two under tensor parallelism. mlp stays the minor dim, so gate and up are
        # contiguous halves: with the pair minor ([embed, mlp, 2]) TPU layouts padded it to 128 lanes, and the
        # backward pass relaid and padded 2 GB per layer and 4 x 8192 tokens of Llama-3-8B.
        w_d2f = jnp.stack([self.w_gate[...], self.w_up[...]], axis=1)
        gate_up_bt2f = norm.project(x_btd, w_d2f, ("embed", None, "mlp"))
        gate_btf = checkpoint_name(gate_up_bt2f[:, :, 0], "mlp_gate")
        up_btf = checkpoint_name(gate_up_bt2f[:, :, 1], "mlp_up")
        h_btf = constrain(jax.nn.silu(gate_btf) * up_btf, ("batch", "seq", "mlp"))
        out_btd = project(h_btf, self.w_down[...])
        return checkpoint_name(constrain(out_btd, ("batch", "residual_seq", "embed")), "mlp_out")
