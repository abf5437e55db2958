"""The KV cache of one conversation on the GPU, preallocated, and what it holds
beside the keys and values: the CUDA graphs that write it and the decode step
queued on it (decode.py)."""
from __future__ import annotations

import math

import numpy as np

from ...config import ModelConfig
from .kernels.decode_attn import FA_HD
from .launch import cp


class CudaCache:
    """k, v (n_layer, n_ctx, n_kv, hd), f16 at the flash attention's head dim and f32
    otherwise, zero-filled so that no position ever holds garbage (attention never
    reads past pos0 + T, but zeros make a bug show up as a wrong number, not a NaN)."""

    def __init__(self, cfg: ModelConfig, n_ctx: int):
        self.n_ctx = n_ctx
        shape, dtype = self.layout(cfg, n_ctx)
        self.k = cp.zeros(shape, dtype=dtype)   # (n_layer, n_ctx, n_kv, hd)
        self.v = cp.zeros(shape, dtype=dtype)   # (n_layer, n_ctx, n_kv, hd)
        self.graphs: dict = {}                  # key -> graphs.Graph, or SEEN after a first eager run
        self.queued = None                      # decode.Queued: the decode step queued on the stream
        self.io = None                          # decode.DecodeIO: pinned buffers of the decode steps

    @staticmethod
    def layout(cfg: ModelConfig, n_ctx: int) -> tuple[tuple[int, ...], object]:
        """-> (shape, dtype) of k and of v: f16 where the flash attention reads them."""
        dtype = cp.float16 if cfg.head_dim == FA_HD else cp.float32
        return (cfg.n_layer, n_ctx, cfg.n_head_kv, cfg.head_dim), dtype

    @classmethod
    def nbytes_for(cls, cfg: ModelConfig, n_ctx: int) -> int:
        """Device bytes a cache of n_ctx positions takes (k and v)."""
        shape, dtype = cls.layout(cfg, n_ctx)
        return 2 * math.prod(shape) * np.dtype(dtype).itemsize
