"""MXFP4 checkpoints (GPT-OSS's experts on the Hub): a weight stored as `<name>_blocks` (uint8, two 4-bit E2M1
values a byte, low nibble first, 16 bytes = 32 values a block) and `<name>_scales` (uint8, a power-of-two exponent
per block, biased by 127), dequantized to float32 as `convert from-hf` reads it, in transformers' layout
(integrations/mxfp4.py's convert_moe_packed_tensors): blocks [E, rows, G, 16] -> [E, G x 32, rows]."""

from __future__ import annotations

import numpy as np

BLOCKS, SCALES = "_blocks", "_scales"
# E2M1's 16 codes: sign bit, then 2 exponent bits and 1 mantissa bit.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The dequantized tensor's shape for blocks of this shape."""
    *lead, rows, groups, width = blocks_shape
    return *lead, groups * width * 2, rows


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 weights from MXFP4 blocks [..., rows, G, 16] and scales [..., rows, G]."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # low nibble first
    values = FP4_VALUES[codes].reshape(*blocks.shape[:-1], -1)  # [..., rows, G, 32]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return np.swapaxes(values.reshape(*blocks.shape[:-2], -1), -1, -2)
