"""tuneforge: fine-tune Hugging Face causal language models, dense and MoE."""

__version__ = "0.1.0"
