"""Using a run's checkpoint: Hugging Face conversion, logits and fold-norms, generation."""
