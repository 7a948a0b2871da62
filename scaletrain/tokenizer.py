"""The byte-level tokenizer: ids 0-255 are bytes, then BOS, EOS and PAD. No JAX here: config validation uses it."""

from __future__ import annotations

import numpy as np

BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 259


def encode(text: bytes) -> np.ndarray:
    """One document: BOS, its bytes, EOS."""
    return np.concatenate([[BOS], np.frombuffer(text, np.uint8), [EOS]]).astype(np.int32)


def decode(tokens: np.ndarray) -> str:
    return bytes(int(t) for t in tokens if t < 256).decode("utf-8", errors="replace")
