"""The gemma family's decoder: the skeleton with Gemma's block - an RMSNorm before and after attention and before
and after the MLP (four a block), each output normalised before it joins the residual stream. Everything else
Gemma 2 and 3 do is a model key any decoder reads (config_gemma.py: (1 + w) gains, the scaled embedding, the query
scale, GeGLU, soft caps, RoPE per layer kind; models/window.py: sliding layers)."""

from __future__ import annotations

from flax import nnx

from scaletrain.models.layers import RMSNorm
from scaletrain.models.transformer import Block, Decoder, ModelConfig


class GemmaBlock(Block):
    """x + post_attn_norm(attention(attn_norm(x))), then x + post_mlp_norm(mlp(mlp_norm(x)))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        self.post_attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype, plus_one=cfg.norm_plus_one)
        self.post_mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype, plus_one=cfg.norm_plus_one)

    def __call__(self, x_btd, sin_bth, cos_bth, segment_ids_bt):
        x_btd = x_btd + self.post_attn_norm(self.attn(x_btd, self.attn_norm, sin_bth, cos_bth, segment_ids_bt))
        return self._feed_forward(x_btd)

    def _feed_forward(self, x_btd, one_matmul: bool = True):
        return x_btd + self.post_mlp_norm(self.mlp(x_btd, self.mlp_norm, one_matmul)), {}

    def decode(self, x_btd, sin_bth, cos_bth, start, cache):
        attn_btd, cache = self.attn.decode(x_btd, self.attn_norm, sin_bth, cos_bth, start, cache)
        return self._feed_forward(x_btd + self.post_attn_norm(attn_btd), one_matmul=False)[0], cache


class Gemma(Decoder):
    @staticmethod
    def unit(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return GemmaBlock(cfg, rngs)
