"""The llama family's decoder: the skeleton as it is - dense blocks (attention, then the SwiGLU MLP) scanned over
the layers, no auxiliary sums, no penalty. Llama, Mistral (without a sliding window) and Qwen3 (QK norms:
model.qk_norm) are all this decoder."""

from __future__ import annotations

from scaletrain.models.transformer import Block, Decoder

__all__ = ["Block", "Llama"]


class Llama(Decoder):
    pass
