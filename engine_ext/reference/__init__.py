"""The transformers oracle the engine is tested against."""
