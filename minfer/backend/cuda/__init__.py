"""The CUDA backend (cupy + NVRTC kernels from the top-level kernels/ folder)."""
from .backend import CUDABackend

__all__ = ["CUDABackend"]
