"""The gated feed-forward block: down(act(x W_gate) * (x W_up)) - SwiGLU (act silu), or GeGLU with the tanh
GELU (model.mlp_activation gelu_tanh: Gemma's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from scaletrain.models import lora, quantize
from scaletrain.models.layers import param, project
from scaletrain.parallel.sharding import constrain, ways

ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class MLP(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        d, f, pd = cfg.d_model, cfg.d_ff, cfg.param_dtype
        self.activation = cfg.mlp_activation
        self.quant = quantize.for_group(cfg, "mlp")
        self.w_gate = param(rngs, (d, f), ("embed", "mlp"), pd, cfg.init_std, self.quant)
        self.w_up = param(rngs, (d, f), ("embed", "mlp"), pd, cfg.init_std, self.quant)
        self.w_down = param(rngs, (f, d), ("mlp", "embed"), pd, cfg.out_std, self.quant)
        self.w_gate_lora = lora.adapter(cfg, "gate_proj", (d, f), ("embed", "mlp"), rngs)
        self.w_up_lora = lora.adapter(cfg, "up_proj", (d, f), ("embed", "mlp"), rngs)
        self.w_down_lora = lora.adapter(cfg, "down_proj", (f, d), ("mlp", "embed"), rngs)
        for name, shape, logical in (("w_gate", (d, f), ("embed", "mlp")), ("w_up", (d, f), ("embed", "mlp")),
                                     ("w_down", (f, d), ("mlp", "embed"))):
            lora.base_scale(cfg, self, name, shape, logical)

    def __call__(self, x_btd: jax.Array, norm, one_matmul: bool = True) -> jax.Array:
        """The MLP of norm(x): the norm is applied with the gate/up projection (model.norm). Split over
        `tensor` (and `one_matmul`, which decoding turns off: no backward pass), gate and up are one matmul
        against [embed, mlp, 2] (mlp-major, so a tensor-parallel shard holds both halves of its columns): the
        backward pass sums the two input gradients before they leave the device - one reduce-scatter instead
        of two. Otherwise two matmuls: a [..., mlp, 2] output split in its minor dim costs the TPU three
        relayout copies of the hidden activations per layer (docs/parallelism.md). Quantized (`self.quant`),
        always two: the joined matmul's gradient would share one scale per row across gate and up, so its
        rounding would depend on the mesh."""
        if one_matmul and ways("mlp") > 1 and self.quant is None:
            gate_up_btf2 = norm.project(x_btd, jnp.stack([self.w_gate[...], self.w_up[...]], axis=-1),
                                        ("embed", "mlp", None))
            gate_btf, up_btf = gate_up_btf2[..., 0], gate_up_btf2[..., 1]
        else:
            gate_btf, up_btf = norm.project_each(x_btd, ((self.w_gate[...], ("embed", "mlp")),
                                                         (self.w_up[...], ("embed", "mlp"))), quant=self.quant)
        if self.w_gate_lora is not None or self.w_up_lora is not None:
            normed = norm(x_btd)
            gate_btf = lora.delta(self.w_gate_lora, normed, gate_btf)
            up_btf = lora.delta(self.w_up_lora, normed, up_btf)
        gate_btf, up_btf = checkpoint_name(gate_btf, "mlp_gate"), checkpoint_name(up_btf, "mlp_up")
        h_btf = constrain(ACTIVATIONS[self.activation](gate_btf) * up_btf, ("batch", "seq", "mlp"))
        out_btd = lora.delta(self.w_down_lora, h_btf, project(h_btf, self.w_down[...], quant=self.quant))
        return checkpoint_name(constrain(out_btd, ("batch", "residual_seq", "embed")), "mlp_out")
