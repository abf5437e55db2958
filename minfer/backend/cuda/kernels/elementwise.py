"""kernels/elementwise.cu: grid-stride f32 element ops, one element per thread.

    swiglu  silu(gate) * up
    add     a + b (the residual add; out may be a)
"""
from __future__ import annotations

from ..launch import check, cp, launch_grid_stride, out_array


def _same_shape_f32(a, b, what: str, out):
    check(a, f"{what} a", cp.float32)
    check(b, f"{what} b", cp.float32, a.shape)
    return out_array(out, a.shape, f"{what} out")


def swiglu(gate, up, out=None):
    """gate, up (T, d_ff) -> silu(gate) * up (T, d_ff)"""
    y = _same_shape_f32(gate, up, "swiglu", out)
    launch_grid_stride("elementwise.cu", "swiglu_f32", gate.size, (gate, up, y))
    return y


def add(a, b, out=None):
    """a + b, same shape (residual add); out may be a"""
    y = _same_shape_f32(a, b, "add", out)
    launch_grid_stride("elementwise.cu", "add_f32", a.size, (a, b, y))
    return y
