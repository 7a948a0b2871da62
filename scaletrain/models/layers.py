"""Parameter creation with logical axes, RMSNorm and the embedding table."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from scaletrain.config import NORMS
from scaletrain.kernels import norm_matmul
from scaletrain.models.quantize import Quantization
from scaletrain.parallel.sharding import active_device, constrain, local, ways

# Flax would otherwise try to shard each variable as it is created, which needs a mesh; we resolve
# logical names to mesh axes ourselves (sharding.py), from shapes, before anything is materialised.
nnx.use_eager_sharding(False)


def param(rngs: nnx.Rngs, shape: tuple[int, ...], logical: tuple[str, ...], dtype, std: float,
          quant: Quantization | None = None) -> nnx.Param:
    """A normal(0, std) weight matrix annotated with its logical axis names and the dtype its matmuls read it in
    (`operand`: its matmuls' low-precision mode, else the compute dtype) - the dtype FSDP gathers it in, which the
    planner counts (models.operand_dtypes)."""
    assert len(shape) == len(logical), (shape, logical)
    value = std * jax.random.normal(rngs.params(), shape, dtype)
    return nnx.Param(value, out_sharding=logical, operand=quant.mode if quant else "compute")


def ones(shape: tuple[int, ...], logical: tuple[str, ...], dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), out_sharding=logical)


def added(shape: tuple[int, ...], logical: tuple[str | None, ...], dtype) -> nnx.Param:
    """A vector added to activations (a bias, an attention sink), zero at the start as transformers' biases are.
    Marked `added`: no matmul multiplies it, so the planner counts it apart from the weights (facts/flops.py)."""
    return nnx.Param(jnp.zeros(shape, dtype), out_sharding=logical, added=True)


def project(x: jax.Array, w: jax.Array, in_dims: int = 1, out_dtype=None, quant: Quantization | None = None
            ) -> jax.Array:
    """Contract the last `in_dims` dims of x with the first `in_dims` dims of w, as one 2-D matmul over all
    tokens. The same math as an einsum such as 'btd,dnh->btnh', but XLA's CPU backend lays out the gradient
    of a dot whose contraction spans (batch, seq) with slow transposes (2x on the whole step); as a plain
    [tokens, in] @ [in, out] the backward pass is two canonical matmuls too. `quant`: the matmul's low-precision
    mode (models/quantize.py), None for the compute dtype."""
    return projections(x, (w,), in_dims, out_dtype, quant)[0]


def projections(x: jax.Array, ws, in_dims: int = 1, out_dtype=None, quant: Quantization | None = None
                ) -> tuple[jax.Array, ...]:
    """`project` of x by each of `ws`, x flattened to [tokens, in] once for all of them (the backward pass saves
    one copy of it, not one per matmul). Not where the sequence is split (context parallelism): a shard of the
    flattened tokens would be a block of whole rows, so XLA would gather the sequence to flatten it."""
    lead, k = x.shape[: x.ndim - in_dims], math.prod(x.shape[x.ndim - in_dims:])
    x2 = x.reshape(-1, k) if ways("seq") == 1 else x.reshape(*lead, k)

    def matmul(w2):
        if quant is not None:
            return quant.dot(x2, w2, out_dtype=out_dtype)
        return jnp.dot(x2, w2.astype(x.dtype), preferred_element_type=out_dtype)

    return tuple(matmul(w.reshape(k, -1)).reshape(*lead, *w.shape[in_dims:]) for w in ws)


class RMSNorm(nnx.Module):
    """y = x / rms(x) * g, computed in float32 whatever the compute dtype. `project` computes RMSNorm(x) @ W
    in one of three equal ways (model.norm, docs/flashnorm.md): `standard` normalises then multiplies;
    `deferred` multiplies x * g and scales each row by 1/rms(x) afterwards, in XLA; `fused` does that inside
    one Pallas kernel (kernels/norm_matmul.py)."""

    def __init__(self, dim: int, eps: float, param_dtype, mode: str = "standard", weightless: bool = False,
                 axis: str = "embed", plus_one: bool = False):
        assert mode in NORMS, mode
        self.eps, self.mode, self.dim, self.plus_one = eps, mode, dim, plus_one
        # Weightless: the gain lives in the following weights (folded), so the norm has none. `plus_one`
        # (Gemma's): the gain is 1 + w, w stored from zero, the sum taken in float32.
        self.scale = None if weightless else nnx.Param(jnp.full((dim,), 0.0 if plus_one else 1.0, param_dtype),
                                                       out_sharding=(axis,))

    def _gain(self) -> jax.Array:
        if self.scale is None:
            return jnp.ones((self.dim,), jnp.float32)
        return 1.0 + self.scale[...].astype(jnp.float32) if self.plus_one else self.scale[...]

    def _inv_rms(self, x_btd: jax.Array) -> jax.Array:
        x = x_btd.astype(jnp.float32)
        return jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)

    def scaled_input(self, x_btd: jax.Array) -> jax.Array:
        """x * g in x's dtype: what the deferred projections multiply (x itself with folded weights)."""
        if self.scale is None:
            return x_btd
        return (x_btd.astype(jnp.float32) * self._gain().astype(jnp.float32)).astype(x_btd.dtype)

    def project_unscaled(self, x_btd: jax.Array, w: jax.Array, quant: Quantization | None = None) -> jax.Array:
        """(x * g) @ w in float32: the projection of RMSNorm(x) before its rows are scaled by 1/rms(x). With
        folded weights (no gain) it is x @ W*: the matmul reads x as it is."""
        return project(self.scaled_input(x_btd), w, out_dtype=jnp.float32, quant=quant)

    def row_scale(self, x_btd: jax.Array, out_dims: int) -> jax.Array:
        """1/rms(x), shaped to scale a projection with `out_dims` output dims."""
        return self._inv_rms(x_btd).reshape(*x_btd.shape[:-1], *(1,) * out_dims)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        normed = x_btd.astype(jnp.float32) * self._inv_rms(x_btd) * self._gain().astype(jnp.float32)
        return normed.astype(x_btd.dtype)

    def project(self, x_btd: jax.Array, w: jax.Array, w_logical: tuple[str | None, ...],
                out_dtype=None, quant: Quantization | None = None) -> jax.Array:
        """RMSNorm(x) @ w for w [embed, ...] (logical axes `w_logical`), in out_dtype (x's by default)."""
        return self.project_each(x_btd, ((w, w_logical),), out_dtype, quant)[0]

    def project_each(self, x_btd: jax.Array, ws: tuple[tuple[jax.Array, tuple[str | None, ...]], ...],
                     out_dtype=None, quant: Quantization | None = None) -> tuple[jax.Array, ...]:
        """RMSNorm(x) @ w for each (w, w_logical) in `ws`, the norm's work shared: the normalised x (standard),
        or x * g and 1/rms(x) (deferred), computed once for all of them - so the backward pass saves them once,
        not once per matmul; `fused` normalises inside each kernel (which multiplies in the compute dtype: the
        config refuses it with `quant`)."""
        out_dtype = out_dtype or x_btd.dtype
        if self.mode == "standard":
            return projections(self(x_btd), [w for w, _ in ws], out_dtype=out_dtype, quant=quant)
        if self.mode == "deferred":
            inv_rms, rows = self._inv_rms(x_btd), x_btd.shape[:-1]
            unscaled = projections(self.scaled_input(x_btd), [w for w, _ in ws], out_dtype=jnp.float32, quant=quant)
            return tuple((y * inv_rms.reshape(*rows, *(1,) * (w.ndim - 1))).astype(out_dtype)
                         for y, (w, _) in zip(unscaled, ws))
        assert quant is None, "model.norm=fused multiplies in the compute dtype (config.validate)"

        eps, blocks = self.eps, norm_matmul.blocks_for(active_device())

        def fused(x_btd, g, w):
            b, t, d = x_btd.shape
            z = norm_matmul.norm_matmul(x_btd.reshape(b * t, d), g, w.reshape(d, -1), eps, out_dtype, blocks)
            return z.reshape(b, t, *w.shape[1:])

        x_logical = ("batch", "seq", "embed")
        return tuple(local(fused, (x_logical, ("embed",), w_logical), x_logical[:2] + w_logical[1:])(
            x_btd, self._gain(), w) for w, w_logical in ws)


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, rngs: nnx.Rngs, param_dtype, std: float, scale: bool = False):
        self.table = param(rngs, (vocab, dim), ("vocab", "embed"), param_dtype, std)
        # Gemma's: embeddings times sqrt(dim), the factor rounded to the compute dtype first as Hugging Face's is.
        self.scale = math.sqrt(dim) if scale else None

    def __call__(self, tokens_bt: jax.Array, dtype) -> jax.Array:
        table = self.table[...].astype(dtype)
        if ways("seq") > 1:
            # With the tokens split over the sequence axis and the table's width over the same axis (FSDP over
            # context), XLA's gather cannot be partitioned: it would replicate the whole batch's embeddings on
            # every device. Gathered whole first, as FSDP gathers any weight its matmul reads.
            table = constrain(table, ("vocab", None))
        x_btd = jnp.take(table, tokens_bt, axis=0)
        if self.scale is not None:
            x_btd = x_btd * jnp.asarray(self.scale, dtype)
        return constrain(x_btd, ("batch", "residual_seq", "embed"))

    def attend(self, x_btd: jax.Array, quant: Quantization | None = None) -> jax.Array:
        """Tied output projection: logits against the embedding table, accumulated in float32."""
        return project(x_btd, self.table[...].T, out_dtype=jnp.float32, quant=quant)
