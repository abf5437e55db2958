"""The GGUF file format: reading a file (gguf.py), its block formats and their
dequantization (quants.py), and the quantizers that write them (quantize.py)."""
