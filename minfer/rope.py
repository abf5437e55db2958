"""RoPE's angles, defined once for both backends' tables.

    theta(p, i) = p * base^(-2i/hd) / factor_i,   i = 0 .. hd/2 - 1

computed in float64 and rounded once (by the caller) to f32: ggml forms the same
angles as an f32 running product, whose drift the exact values avoid. The
factors are the per-pair divisors a GGUF carries as `rope_freqs.weight` (Llama
3.1's "llama3" RoPE scaling, which llama.cpp applies as these frequency
factors); without them every factor is 1.
"""
from __future__ import annotations

import numpy as np


def inv_freq(hd: int, base: float, factors: np.ndarray | None = None) -> np.ndarray:
    """-> base^(-2i/hd) / factor_i, float64 (hd/2,)"""
    f = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)                # (hd/2,)
    return f if factors is None else f / np.asarray(factors, dtype=np.float64)


def angles(n_pos: int, hd: int, base: float, factors: np.ndarray | None = None) -> np.ndarray:
    """-> theta(p, i) for p < n_pos, float64 (n_pos, hd/2)"""
    return np.arange(n_pos, dtype=np.float64)[:, None] * inv_freq(hd, base, factors)[None, :]
