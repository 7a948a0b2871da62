"""The gemma family: Gemma 3 (text) and Gemma 2 - the skeleton with Gemma's four-norm block (decoder.py), their
Hugging Face tables (hf.py) and the planner's matmul inventory (llama's: the same projections)."""

from __future__ import annotations

from scaletrain.models.family import Family
from scaletrain.models.gemma import hf
from scaletrain.models.gemma.decoder import Gemma, GemmaBlock
from scaletrain.models.llama import matmuls

FAMILY = Family(name="gemma", decoder=Gemma, matmuls=matmuls, architectures=hf.ARCHITECTURES, export=hf.export)

__all__ = ["FAMILY", "Gemma", "GemmaBlock"]
