"""Weights on the GPU: registration, the q6_K layout, W_exp planes and memory accounting.

Every 2-D tensor is uploaded once: q4_K and q8_0 as stored, q6_K padded to a
224-byte block stride (q6k_layout.py), f16/f32 as arrays. The q6_K tensors
`blk.N.attn_v.weight`, `blk.N.ffn_down.weight` and `output.weight` with an
input dimension divisible by 256 also get a W_exp plane, the dense centered
int8 form of the weight, unless the settings turn planes off:
- a plane is named `{name}__exp{od}x{id}`, so a same-name registration of
  another shape can never find a stale plane;
- the map that launches consult is keyed by the PADDED weight's device pointer
  (what a launch holds), never by the plane's own pointer;
- a registration failure leaves that key out, warns loudly once per process,
  and the weight's GEMMs count `q6k fallback!`.
With the opt-in MINFER_F16_WEIGHTS=1 (settings.f16_weights), every weight the
f16 engine reads also keeps an f16 copy made at load (from its plane when it
has one: the values the per-GEMM dequantization gives), keyed by the same
pointer; the f16 engine's GEMMs then read it instead of dequantizing.
The planes' allocated bytes are checked against the sum of od x id over the
GGUF tensor table (`expected_plane_bytes`), an inventory independent of the
planes themselves.
"""
from __future__ import annotations

import re
import sys
import weakref
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT

from ...errors import MinferError
from ...format import quants
from .kernels.dequant import ROW_KERNELS
from .kernels.dequant_f16 import dequant_f16
from .kernels.mmq import MMQ_TYPES
from .kernels.quants32 import Q32_TYPES
from .launch import cp
from .q6k_layout import expand_q6k_dense, pad_q6k
from .settings import CudaSettings

_PLANE_NAME = re.compile(r"blk\.\d+\.(attn_v|ffn_down)\.weight|output\.weight")

# tables, not linears of the layer stack: never dequantized whole into the f16
# scratch when the int8 MMQ can serve them (the 7B's LM head alone would need a
# 1.09 GB scratch; it sees one row in prefill, or every position in perplexity,
# where the MMQ serves it); a table of a type the MMQ lacks takes the f16 engine
TABLES = frozenset({"token_embd.weight", "output.weight"})

# every type a 2-D weight may have on the GPU
SUPPORTED = tuple(ROW_KERNELS) + tuple(t for t in Q32_TYPES if t not in ROW_KERNELS)
_F16_TYPES = MMQ_TYPES + Q32_TYPES                 # dequantized for the f16 engine

_warned_miss = False                 # one loud warning per process


def is_plane_tensor(name: str, qtype, shape) -> bool:
    """Does the W_exp bundle cover this GGUF tensor? (q6_K, a covered name, and an
    input dimension that is a whole number of 256-element super-blocks, which the
    plane's launch geometry and the 16-byte alignment of its cp.async sources need)"""
    return (QT(qtype) == QT.Q6_K and len(shape) == 2 and bool(_PLANE_NAME.fullmatch(name))
            and int(shape[-1]) % quants.QK_K == 0)


def expected_plane_bytes(tensors, settings: CudaSettings) -> int:
    """sum of od x id over the plane tensors of a GGUF tensor table (name -> TensorInfo):
    what the registered planes must occupy (0 when planes are off)."""
    if not settings.exp_planes:
        return 0
    return sum(int(np.prod(t.shape, dtype=np.int64)) for name, t in tensors.items()
               if is_plane_tensor(name, t.qtype, t.shape))


def plane_check(expected: int, planes: dict) -> str | None:
    """None when the planes occupy exactly `expected` bytes, else why not."""
    allocated = sum(int(p.nbytes) for p in planes.values())
    if allocated == expected:
        return None
    return (f"W_exp planes hold {allocated:,} bytes, the tensor table needs {expected:,} "
            f"({len(planes)} planes registered)")


@dataclass(eq=False)
class GpuWeight:
    """A registered weight (n_out, n_in). data is on the device: q4_K/q8_0 uint8
    (n_out, row_bytes) as stored, q6_K uint8 (n_out, n_in/256*224) PADDED, f16
    uint16 (n_out, n_in), f32 float32 (n_out, n_in)."""
    name: str
    qtype: QT
    n_out: int
    n_in: int
    data: object
    plane_tensor: bool = False       # covered by the W_exp bundle (is_plane_tensor)

    @property
    def ptr(self) -> int:
        return int(self.data.data.ptr)

    @property
    def table(self) -> bool:
        return self.name in TABLES

    @property
    def on_f16_engine(self) -> bool:
        """Can a GEMM of this weight take the f16 engine (gemm.gemm_path's rule, which
        sizes the f16 weight scratch here)?"""
        return self.qtype in _F16_TYPES and not (self.table and self.qtype in MMQ_TYPES)


class WeightStore:
    """The registered weights' planes, pointer map and memory, for one backend."""

    def __init__(self, settings):
        self.settings = settings                  # () -> the backend's CudaSettings (read at registration)
        self.planes: dict[str, object] = {}       # "{name}__exp{od}x{id}" -> int8 (od, id) plane
        self.by_ptr: dict[int, object] = {}       # padded weight device pointer -> its plane
        self.bytes = {"q4_K weights": 0, "q6_K padded": 0, "other": 0}
        self.f16: dict[int, object] = {}          # weight device pointer -> its f16 copy (f16_weights)
        self.f16_elems = 0                        # elements of the largest weight the f16 engine takes

    def register(self, name: str, info, raw: np.ndarray) -> GpuWeight:
        """info: minfer.format.gguf.TensorInfo of a 2-D tensor; raw: uint8 (rows, row_bytes) host bytes."""
        qtype = QT(info.qtype)
        shape = tuple(int(s) for s in info.shape)
        n_in = shape[-1]
        n_out = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        if qtype not in SUPPORTED:
            raise MinferError(f"{name}: tensor type {qtype.name} is not supported by the CUDA "
                              f"backend (supported: {', '.join(t.name for t in SUPPORTED)})")
        rb = quants.row_bytes(qtype, n_in)
        raw = np.asarray(raw)
        if raw.dtype != np.uint8 or raw.size != n_out * rb:
            raise MinferError(f"{name}: {raw.size} bytes of {raw.dtype} do not hold a "
                              f"{qtype.name} tensor of shape {shape}")
        host = np.ascontiguousarray(raw.reshape(n_out, rb))
        kind = {QT.Q4_K: "q4_K weights", QT.Q6_K: "q6_K padded"}.get(qtype, "other")
        if qtype == QT.Q6_K:
            host = pad_q6k(host)                                          # (n_out, nb*224)
        elif qtype == QT.F16:
            host = host.view(np.uint16)                                   # (n_out, n_in)
        elif qtype == QT.F32:
            host = host.view(np.float32)                                  # (n_out, n_in)
        w = GpuWeight(name, qtype, n_out, n_in, cp.asarray(host),
                      plane_tensor=is_plane_tensor(name, qtype, shape))
        self.bytes[kind] += w.data.nbytes
        weakref.finalize(w, self._forget, kind, w.data.nbytes)
        if w.on_f16_engine:
            self.f16_elems = max(self.f16_elems, n_out * n_in)
        if w.plane_tensor and self.settings().exp_planes:
            self._register_plane(w, host)
        if self.settings().f16_weights and w.on_f16_engine and not w.table:
            self._keep_f16(w)
        return w

    def _keep_f16(self, w: GpuWeight) -> None:
        """The f16 copy of a weight (settings.f16_weights): the f16 engine's own
        dequantization, once, into an array of its own."""
        w16 = dequant_f16(w.data, w.qtype, w.n_out, w.n_in,
                          out=cp.empty(w.n_out * w.n_in, cp.float16), w_exp=self.plane_of(w))
        self.f16[w.ptr] = w16                                             # (n_out, n_in)
        self.bytes["f16 weights"] = self.bytes.get("f16 weights", 0) + w16.nbytes
        weakref.finalize(w, self._forget_f16, w.ptr, w16)

    def _register_plane(self, w: GpuWeight, padded_host: np.ndarray) -> None:
        exp_name = f"{w.name}__exp{w.n_out}x{w.n_in}"
        try:
            if self.settings().force_exp_miss:
                raise RuntimeError("settings.force_exp_miss (simulated failure)")
            plane = cp.asarray(expand_q6k_dense(padded_host, w.n_out, w.n_in))   # (od, id) int8
        except Exception as e:  # noqa: BLE001 - any alloc/upload failure: no plane, loud once
            global _warned_miss
            if not _warned_miss:
                _warned_miss = True
                print(f"minfer: WARNING: W_exp plane registration failed for {w.name} "
                      f"({type(e).__name__}: {e}); q6_K GEMMs run the in-kernel expansion "
                      f"(EXP=false) and count as 'q6k fallback!'", file=sys.stderr, flush=True)
            return
        self.planes[exp_name] = plane
        self.by_ptr[w.ptr] = plane
        weakref.finalize(w, self._forget_plane, w.ptr, exp_name, plane)

    def _forget(self, kind: str, nbytes: int) -> None:
        """A GpuWeight was garbage-collected: its bytes are free again."""
        self.bytes[kind] -= nbytes

    def _forget_plane(self, ptr: int, exp_name: str, plane) -> None:
        if self.by_ptr.get(ptr) is plane:
            del self.by_ptr[ptr]
        if self.planes.get(exp_name) is plane:
            del self.planes[exp_name]

    def _forget_f16(self, ptr: int, w16) -> None:
        if self.f16.get(ptr) is w16:
            del self.f16[ptr]
            self.bytes["f16 weights"] -= w16.nbytes

    def f16_of(self, w: GpuWeight):
        """The f16 copy kept for w (settings.f16_weights), or None."""
        return self.f16.get(w.ptr)

    def plane_of(self, w: GpuWeight):
        """The W_exp plane registered for w (looked up by its padded pointer), or None."""
        return self.by_ptr.get(w.ptr)

    @property
    def plane_bytes(self) -> int:
        return sum(int(p.nbytes) for p in self.planes.values())
