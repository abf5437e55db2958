"""kernels/rope.cu: RoPE on f32 rows, one thread per rotated pair, cos/sin from
rope_table (the prompt path's RoPE + KV store in one launch is decode_attn.py's
rope_store_kv_f16).
"""
from __future__ import annotations

import numpy as np

from ....rope import angles as rope_angles
from ..launch import blocks_1d, check, cp, kernel, or_null, out_array, pos_args, pos_value
from ..nvrtc import K


def rope_table(n_pos: int, hd: int, base: float, factors: np.ndarray | None = None) -> np.ndarray:
    """cos/sin of the RoPE angles (minfer/rope.py), rounded once to f32 -> (n_pos, hd/2, 2)"""
    theta = rope_angles(n_pos, hd, base, factors)                        # (n_pos, hd/2) f64
    return np.stack([np.cos(theta), np.sin(theta)], axis=-1).astype(np.float32)


def rope(x, cos_sin, pos, neox: bool, out=None, rows=None):
    """x (T, n_heads, hd) at positions pos.. (an int or a launch.DevicePos), or with
    rows ((T, 2) int32 device: position, cache row; a batch of sequences, whose
    positions the caller checked) at rows[:, 0]; cos_sin (n_pos, hd/2, 2) -> rotated
    (T, n_heads, hd); NeoX halves or adjacent pairs; out may be x"""
    check(x, "rope x", cp.float32, ndim=3)
    check(cos_sin, "rope cos_sin", cp.float32, ndim=3)
    T, n_heads, hd = x.shape
    if hd % 2 or cos_sin.shape[1:] != (hd // 2, 2):
        raise ValueError(f"rope: table {cos_sin.shape} does not fit head dim {hd}")
    pos0 = pos_value(pos)
    if rows is not None:
        check(rows, "rope rows", cp.int32, (T, 2))
    elif pos0 < 0 or pos0 + T > cos_sin.shape[0]:
        raise ValueError(f"rope: positions {pos0}..{pos0 + T - 1} outside the table of {cos_sin.shape[0]}")
    y = out_array(out, x.shape, "rope out")                                  # (T, n_heads, hd)
    n_pairs = T * n_heads * (hd // 2)
    if n_pairs:
        kernel("rope.cu", "rope_f32")((blocks_1d(n_pairs),), (K["THREADS_1D"],),
                                      (x, y, cos_sin, np.int32(T), np.int32(n_heads), np.int32(hd),
                                       *pos_args(pos), np.int32(bool(neox)), or_null(rows)))
    return y
