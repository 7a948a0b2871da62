"""Low-precision matmuls (model.quantization, docs/quantization.md): the operands of a chosen matmul cast to int8
or fp8 with absmax scales in the forward pass, and the operands of both its backward matmuls (the incoming
gradient with the saved, already-quantized forward operand) too, so all three run at the matrix unit's low-precision
rate. Gradients pass straight through the rounding; the parameters and the optimizer state keep their dtypes.

The quantized dots are Qwix's (`dot_general_qt`, `ragged_dot_qt`: MaxText trains with the same), called as
functions: Qwix's model-level entry point intercepts the dots of a Flax module it has traced once, which would
bypass the layer-stack runner and the pipelines' own tracing. Here each matmul asks its layer's `Quantization`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from qwix._src.core import dot_general_qt, ragged_dot_qt

from scaletrain import config

# (forward operands, gradients): fp8 keeps three mantissa bits forward (e4m3) and trades them for range in the
# gradients (e5m2), whose magnitudes spread wider - Transformer Engine's "hybrid" format.
_QTYPES = {"int8": (jnp.int8, jnp.int8), "fp8": (jnp.float8_e4m3fn, jnp.float8_e5m2)}
_MATMUL = (((1,), (0,)), ((), ()))  # [rows, in] @ [in, out]


@dataclasses.dataclass(frozen=True)
class Quantization:
    """How one group's matmuls run: `mode` int8 or fp8; `per_tensor` one scale per operand, else one per row of
    the left operand and per column of the right (every non-contracted index: the rounding adapts to each
    token's and each output feature's range)."""

    mode: str
    per_tensor: bool = False

    def _dot_config(self) -> dot_general_qt.DotGeneralQtConfig:
        forward, grad = _QTYPES[self.mode]
        return dot_general_qt.DotGeneralQtConfig(
            lhs_qtype=forward, rhs_qtype=forward, dlhs_grad_qtype=grad, drhs_grad_qtype=grad,
            lhs_disable_channelwise_axes=self.per_tensor, rhs_disable_channelwise_axes=self.per_tensor,
            dlhs_grad_disable_channelwise_axes=self.per_tensor, drhs_grad_disable_channelwise_axes=self.per_tensor)

    def dot_general(self, x: jax.Array, w: jax.Array, dims=_MATMUL, out_dtype=None) -> jax.Array:
        """jax.lax.dot_general(x, w, dims) with quantized operands, in out_dtype (x's by default)."""
        w = w.astype(x.dtype)  # the same bf16 weight the unquantized matmul gathers and reads
        return dot_general_qt.dot_general_qt(x, w, dims, self._dot_config()).astype(out_dtype or x.dtype)

    def ragged_dot(self, x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """jax.lax.ragged_dot(x, w, group_sizes) with quantized operands, in x's dtype. Per channel whatever
        `per_tensor` says: Qwix's grouped matmul scales by row and column only."""
        forward, grad = _QTYPES[self.mode]
        config = ragged_dot_qt.RaggedDotQtConfig(lhs_qtype=forward, rhs_qtype=forward, dlhs_grad_qtype=grad,
                                                 drhs_grad_qtype=grad)
        return ragged_dot_qt.ragged_dot_qt(x, w.astype(x.dtype), group_sizes, config, None, x.dtype)


def for_group(cfg, group: str) -> Quantization | None:
    """The Quantization of a model config's matmul group, or None where it runs in the compute dtype."""
    assert group in config.MATMUL_GROUPS, group
    if cfg.quantization == "none" or group not in config.quantized_groups(cfg.quantized_matmuls):
        return None
    return Quantization(cfg.quantization, cfg.quantization_scale == "tensor")

