"""minfer: prefill GGUF-quantized language models on an NVIDIA GPU."""

__version__ = "0.1.0"
