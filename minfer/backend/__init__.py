"""Backend selection: "auto" (the default), "cpu" (the NumPy reference) or "cuda"
(imported lazily, so the CPU path never needs cupy).

"auto" is the one place that decides where a model runs when the user did not
say: the CUDA backend when cupy imports, sees a device and the backend accepts
the model, else the CPU backend. It never hides the choice: with `announce`, one
stderr line names the device chosen, or says why not CUDA. An explicit "cuda"
that cannot run stays an error (CUDABackend's one-line MinferError).
"""
from __future__ import annotations

import sys

from ..config import ModelConfig
from ..errors import MinferError
from .base import Backend

BACKENDS = ("auto", "cpu", "cuda")


def cuda_unavailable() -> str | None:
    """None when cupy imports and reports at least one CUDA device, else why not
    (a phrase for the `minfer: backend cpu (...)` line)."""
    try:
        import cupy
    except ModuleNotFoundError as e:
        if e.name == "cupy":
            return "cupy is not installed"
        return f"cupy does not import ({type(e).__name__}: {e})"
    except Exception as e:  # noqa: BLE001 - a broken cupy (missing libraries) is one reason
        return f"cupy does not import ({type(e).__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver, no device: the runtime raises
        return f"no CUDA device ({' '.join(str(e).split())})"
    return None if n > 0 else "no CUDA device"


def _auto(cfg: ModelConfig) -> tuple[Backend, str]:
    """-> (backend, the note naming its device or why CUDA was not taken)"""
    from .cpu import CPUBackend

    why = cuda_unavailable()
    if why is None:
        from .cuda import CUDABackend
        try:
            be = CUDABackend(cfg)
        except MinferError as e:     # e.g. a head dimension the CUDA kernels do not take
            why = str(e)
        else:
            return be, be.device_info()["device"]
    return CPUBackend(cfg), why


def get_backend(name: str, cfg: ModelConfig, announce: bool = False) -> Backend:
    """The backend called `name` for this model. announce: for "auto", print
    `minfer: backend NAME (device or reason)` on stderr."""
    if name == "auto":
        be, note = _auto(cfg)
        if announce:
            print(f"minfer: backend {be.name} ({note})", file=sys.stderr, flush=True)
        return be
    if name == "cpu":
        from .cpu import CPUBackend
        return CPUBackend(cfg)
    if name == "cuda":
        from .cuda import CUDABackend    # imports without cupy; the constructor says
        return CUDABackend(cfg)          # why it cannot run (no cupy, no device)
    raise MinferError(f"unknown backend {name!r} (choose from: {', '.join(BACKENDS)})")
