"""What the CUDA backend runs on and how it measures: the device's and driver's
names and versions (run records, the `--backend auto` line), the CUDA-event timer,
and the one-line out-of-memory message."""
from __future__ import annotations

from ...errors import MinferError
from ..base import Timer
from .launch import cp


class CudaTimer(Timer):
    """CUDA events around the work queued between start() and stop()."""

    def __init__(self, backend):
        super().__init__(backend)
        self._t0, self._t1 = cp.cuda.Event(), cp.cuda.Event()

    def start(self) -> None:
        self.backend.synchronize()             # the device is idle when the clock starts
        self._t0.record()

    def stop(self) -> float:
        self._t1.record()
        self._t1.synchronize()
        return cp.cuda.get_elapsed_time(self._t0, self._t1) / 1e3


def device_info() -> dict[str, str | None]:
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"]
    return {"device": name.decode() if isinstance(name, bytes) else str(name),
            "driver": _nvidia_driver_version(),
            "cuda_driver": _cuda_version(cp.cuda.runtime.driverGetVersion()),
            "cuda_runtime": _cuda_version(cp.cuda.runtime.runtimeGetVersion())}


def oom_error(what: str, settings, store) -> MinferError:
    """One line: what ran out, how much is in use, what to turn off."""
    free, total = cp.cuda.runtime.memGetInfo()
    drop = (f"set MINFER_MMQ_Q6K_EXP=0 to drop the W_exp planes ({store.plane_bytes / 1e9:.2f} "
            f"GB allocated so far; ~1.52 GB on the 7B)" if settings.exp_planes
            else "the W_exp planes are already off (MINFER_MMQ_Q6K_EXP=0)")
    if settings.f16_weights:
        drop = (f"unset MINFER_F16_WEIGHTS to drop the kept f16 weights "
                f"({store.bytes.get('f16 weights', 0) / 1e9:.2f} GB so far), {drop}")
    return MinferError(f"GPU out of memory while {what} ({free / 2**30:.2f} of "
                       f"{total / 2**30:.2f} GiB free): {drop}, or use a smaller -c")


def _cuda_version(v: int) -> str:
    """CUDA's integer version (12080) -> "12.8"."""
    return f"{v // 1000}.{v % 1000 // 10}"


def _nvidia_driver_version() -> str | None:
    """The NVIDIA kernel driver's version, from /proc (Linux), else None."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            head = f.readline()
    except OSError:
        return None
    words = head.split()
    return next((w for w in words if w[:1].isdigit() and "." in w), None)
