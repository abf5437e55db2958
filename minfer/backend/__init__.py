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
        from .cuda import CUDABackend    # imports without cupy; the constructor says
        return CUDABackend(cfg)          # why it cannot run (no cupy, no device)
    raise MinferError(f"unknown backend {name!r} (choose from: {', '.join(BACKENDS)})")
