"""One wrapper module per kernel file: `kernels/<name>.py` here checks the arguments
of, allocates the output of and launches the kernels of the top-level
`kernels/<name>.cu` (flash_attn.py: flash_attn.cu and flash_attn_sm90.cu)."""
