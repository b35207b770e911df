"""llmopt: compress, run and measure Hugging Face causal language models."""

__version__ = "0.1.0"
