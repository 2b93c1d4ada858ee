"""hsx: verified, crash-safe extraction of a target LLM's hidden states for draft-model training."""

__version__ = "0.1.0"
