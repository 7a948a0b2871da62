"""The SwiGLU feed-forward block: down(silu(x W_gate) * (x W_up))."""

from __future__ import annotations

import jax
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

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        gate_btf = checkpoint_name(project(x_btd, self.w_gate[...]), "mlp_gate")
        up_btf = checkpoint_name(project(x_btd, self.w_up[...]), "mlp_up")
        h_btf = constrain(jax.nn.silu(gate_btf) * up_btf, ("batch", "seq", "mlp"))
        out_btd = project(h_btf, self.w_down[...])
        return checkpoint_name(constrain(out_btd, ("batch", "seq", "embed")), "mlp_out")
