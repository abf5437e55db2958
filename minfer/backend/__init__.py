"""Backend selection: "auto" (the default), "cpu" (the NumPy reference) or "cuda"
(imported lazily, so the CPU path never needs cupy).

The CPU backend's arithmetic is MINFER_CPU_MATH's: "f32" (cpu.py, the float32
reference) or "ggml" (ggml_cpu.py, llama.cpp's CPU arithmetic).

"auto" is the one place that decides where a model runs when the user did not
say: the CUDA backend when cupy imports, sees a device and the backend accepts
the model, else the CPU backend. It never hides the choice: with `announce`, one
stderr line names the device chosen, or says why not CUDA. An explicit "cuda"
that cannot run stays an error (CUDABackend's one-line MinferError).
"""
from __future__ import annotations

import os
import sys

from ..config import ModelConfig
from ..errors import MinferError
from .base import Backend

BACKENDS = ("auto", "cpu", "cuda")
CPU_MATH = ("f32", "ggml")         # MINFER_CPU_MATH: the float32 reference, or llama.cpp's CPU arithmetic


def math_setting(environ=None) -> str:
    """MINFER_CPU_MATH (default f32) -> one of CPU_MATH; anything else is a one-line error."""
    value = (os.environ if environ is None else environ).get("MINFER_CPU_MATH", "f32").strip().lower() or "f32"
    if value not in CPU_MATH:
        raise MinferError(f"MINFER_CPU_MATH={value!r}: expected one of {', '.join(CPU_MATH)}")
    return value


def cpu_backend(cfg: ModelConfig) -> Backend:
    """The CPU backend of MINFER_CPU_MATH's arithmetic."""
    if math_setting() == "ggml":
        from .ggml_cpu import GgmlCPUBackend
        return GgmlCPUBackend(cfg)
    from .cpu import CPUBackend
    return CPUBackend(cfg)


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


def _cuda(cfg: ModelConfig, settings: dict | None) -> Backend:
    from .cuda import CUDABackend    # imports without cupy; the constructor says
    from .cuda.settings import CudaSettings   # why it cannot run (no cupy, no device)
    return CUDABackend(cfg, CudaSettings.from_env().replace(**settings) if settings else None)


def _auto(cfg: ModelConfig, settings: dict | None) -> tuple[Backend, str]:
    """-> (backend, the note naming its device or why CUDA was not taken)"""
    why = cuda_unavailable()
    if why is None:
        try:
            be = _cuda(cfg, settings)
        except MinferError as e:     # e.g. a head dimension the CUDA kernels do not take
            why = str(e)
        else:
            return be, be.device_info()["device"]
    return cpu_backend(cfg), why


def get_backend(name: str, cfg: ModelConfig, announce: bool = False, settings: dict | None = None) -> Backend:
    """The backend called `name` for this model. announce: for "auto", print
    `minfer: backend NAME (device or reason)` on stderr. settings: CUDA settings by
    field name over the environment's (cuda/settings.py; tests and benchmarks)."""
    if name == "auto":
        be, note = _auto(cfg, settings)
        if announce:
            print(f"minfer: backend {be.name} ({note})", file=sys.stderr, flush=True)
        return be
    if name == "cpu":
        if settings:
            raise MinferError(f"settings {', '.join(settings)} are the CUDA backend's; "
                              f"the CPU backend has none")
        return cpu_backend(cfg)
    if name == "cuda":
        return _cuda(cfg, settings)
    raise MinferError(f"unknown backend {name!r} (choose from: {', '.join(BACKENDS)})")
