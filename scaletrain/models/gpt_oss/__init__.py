"""The gpt_oss family: GPT-OSS - the mixtral family's decoder (a mixture of experts in every layer) with the pieces
GPT-OSS's config keys switch on (attention sinks, biases on Q/K/V/O, the router and the experts, the clamped
SwiGLU: config_gpt_oss.py), and its Hugging Face table (hf.py). The matmul inventory is mixtral's: the biases
and sinks add no matmul (the planner counts their parameters from the model itself)."""

from __future__ import annotations

from scaletrain.models import mixtral
from scaletrain.models.family import Family
from scaletrain.models.gpt_oss import hf

FAMILY = Family(name="gpt_oss", decoder=mixtral.Mixtral, matmuls=mixtral.matmuls, architectures=hf.ARCHITECTURES,
                export=hf.export, experts=True)

__all__ = ["FAMILY"]
