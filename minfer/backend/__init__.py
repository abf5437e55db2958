"""Backend selection: "cpu" (the NumPy reference) or "cuda" (imported lazily, so
the CPU path never needs cupy)."""
from __future__ import annotations

from ..config import ModelConfig
from ..errors import MinferError
from .base import Backend

BACKENDS = ("cpu", "cuda")


def get_backend(name: str, cfg: ModelConfig) -> Backend:
    if name == "cpu":
        from .cpu import CPUBackend
        return CPUBackend(cfg)
    if name == "cuda":
        try:
            import cupy
            from .cuda import CUDABackend
        except ImportError as e:
            raise MinferError(f"CUDA backend unavailable: {e}") from None
        try:
            n_dev = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # noqa: BLE001 - cupy raises its own runtime error types
            raise MinferError(f"CUDA backend unavailable: {type(e).__name__}: {e}") from None
        if n_dev < 1:
            raise MinferError("CUDA backend unavailable: no CUDA device")
        return CUDABackend(cfg)
    raise MinferError(f"unknown backend {name!r} (choose from: {', '.join(BACKENDS)})")
