"""Tokenizers, corpus preparation into ArrayRecord shards, and the deterministic batch loader."""
