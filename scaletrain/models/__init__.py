"""Llama-family models in Flax NNX. Parameters and activations carry logical axis names only."""

from scaletrain.model.transformer import Llama, ModelConfig, abstract, init_params

__all__ = ["Llama", "ModelConfig", "abstract", "init_params"]
