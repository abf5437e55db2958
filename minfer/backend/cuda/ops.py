"""The f32 layer ops around the GEMMs, one wrapper per kernel:

    rmsnorm  kernels/norm.cu         one block per row
    rope     kernels/rope.cu         one thread per rotated pair, cos/sin from rope_table
    swiglu   kernels/elementwise.cu  grid-stride, one element per thread
    add      kernels/elementwise.cu  grid-stride (residual add; out may be a)
    argmax   kernels/argmax.cu       greedy id and an all-finite flag, one block
    advance_feed  kernels/argmax.cu  a decode step's [token, pos] input <- [its id, pos + 1]
"""
from __future__ import annotations

import numpy as np

from ...rope import angles as rope_angles
from .launch import blocks_1d, check, cp, kernel, launch_grid_stride, out_array, pos_args, pos_value
from .nvrtc import K


def rope_table(n_pos: int, hd: int, base: float, factors: np.ndarray | None = None) -> np.ndarray:
    """cos/sin of the RoPE angles (minfer/rope.py), rounded once to f32 -> (n_pos, hd/2, 2)"""
    theta = rope_angles(n_pos, hd, base, factors)                        # (n_pos, hd/2) f64
    return np.stack([np.cos(theta), np.sin(theta)], axis=-1).astype(np.float32)


def rmsnorm(x, w, eps: float, out=None, dtype=None):
    """x (T, d), w (d,) -> x / sqrt(mean(x^2) + eps) * w  (T, d), f32; dtype=float16
    rounds each value once to f16 (the f16 engine's operand, written directly)"""
    check(x, "rmsnorm x", cp.float32, ndim=2)
    T, d = x.shape
    check(w, "rmsnorm w", cp.float32, (d,))
    half = dtype is not None and np.dtype(dtype) == np.float16
    y = out_array(out, (T, d), "rmsnorm out", cp.float16 if half else None)    # (T, d)
    if T:
        kernel("norm.cu", "rmsnorm_f16" if half else "rmsnorm_f32")(
            (T,), (K["NORM_F16_THREADS" if half else "NORM_THREADS"],), (x, w, y, np.int32(d), np.float32(eps)))
    return y


def rope(x, cos_sin, pos, neox: bool, out=None):
    """x (T, n_heads, hd) at positions pos.. (an int or a launch.DevicePos), cos_sin
    (n_pos, hd/2, 2) -> rotated (T, n_heads, hd); NeoX halves or adjacent pairs; out may be x"""
    check(x, "rope x", cp.float32, ndim=3)
    check(cos_sin, "rope cos_sin", cp.float32, ndim=3)
    T, n_heads, hd = x.shape
    if hd % 2 or cos_sin.shape[1:] != (hd // 2, 2):
        raise ValueError(f"rope: table {cos_sin.shape} does not fit head dim {hd}")
    pos0 = pos_value(pos)
    if pos0 < 0 or pos0 + T > cos_sin.shape[0]:
        raise ValueError(f"rope: positions {pos0}..{pos0 + T - 1} outside the table of {cos_sin.shape[0]}")
    y = out_array(out, x.shape, "rope out")                                  # (T, n_heads, hd)
    n_pairs = T * n_heads * (hd // 2)
    if n_pairs:
        kernel("rope.cu", "rope_f32")((blocks_1d(n_pairs),), (K["THREADS_1D"],),
                                      (x, y, cos_sin, np.int32(T), np.int32(n_heads), np.int32(hd),
                                       *pos_args(pos), np.int32(bool(neox))))
    return y


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


def argmax(logits, out=None):
    """logits f32 (1, n) or (n,) -> int32 (2,) on the device: [the first index of the
    maximum, 1 if every logit is finite else 0]"""
    check(logits, "argmax logits", cp.float32)
    out = out_array(out, (2,), "argmax out", cp.int32)
    kernel("argmax.cu", "argmax_f32")((1,), (K["ARGMAX_THREADS"],), (logits, np.int32(logits.size), out))
    return out


def advance_feed(out, feed) -> None:
    """out int32 (2,) (argmax's [id, finite]), feed int32 (2,) [token, pos] on the
    device -> feed = [id, pos + 1]: the input of the next decode step"""
    check(out, "advance_feed out", cp.int32, (2,))
    check(feed, "advance_feed feed", cp.int32, (2,))
    kernel("argmax.cu", "advance_feed")((1,), (1,), (out, feed))
