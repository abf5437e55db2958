"""The KV cache on the GPU, preallocated, and what it holds beside the keys and
values: the CUDA graphs that write it and the decode step queued on it (decode.py).

A cache is contiguous (position p at row p) or a sequence's view of a paged cache's
rows (minfer/kv/): the same k, v arrays as the paged storage, read through the
sequence's block table, which the kernels take (kernels/common.cuh's kv_row). The
table lives in device memory at a fixed address, so a graph captured on the view
replays for whichever sequence the table holds now.
"""
from __future__ import annotations

import math

import numpy as np

from ...config import ModelConfig
from ...kv.blocks import BLOCK_TOKENS
from .kernels.decode_attn import FA_HD
from .launch import DevicePos, cp


class CudaCache:
    """k, v (n_layer, n_rows, n_kv, hd), f16 at the flash attention's head dim and f32
    otherwise, zero-filled so that no position ever holds garbage (attention never
    reads past pos0 + T, but zeros make a bug show up as a wrong number, not a NaN).
    n_ctx: the positions one sequence of this cache holds (n_rows when contiguous).
    table: None (contiguous), or the sequence's block table, int32 (n_ctx / 64,)
    on the device (set_table)."""

    def __init__(self, cfg: ModelConfig, n_ctx: int, storage: "CudaCache | None" = None):
        self.n_ctx = n_ctx
        if storage is None:
            shape, dtype = self.layout(cfg, n_ctx)
            self.k = cp.zeros(shape, dtype=dtype)   # (n_layer, n_rows, n_kv, hd)
            self.v = cp.zeros(shape, dtype=dtype)   # (n_layer, n_rows, n_kv, hd)
            self.table = None
        else:
            self.k, self.v = storage.k, storage.v
            self.table = cp.zeros(-(-n_ctx // BLOCK_TOKENS), cp.int32)   # (blocks,)
        self.graphs: dict = {}                  # key -> graphs.Graph, or SEEN after a first eager run
        self.queued = None                      # decode.Queued: the decode step queued on the stream
        self.io = None                          # decode.DecodeIO: pinned buffers of the decode steps
        self.batch_slots: dict = {}             # (B, W) -> the buffers of a batched decode step (bind_decode)

    @property
    def n_rows(self) -> int:
        return self.k.shape[1]

    def bind_decode(self, batch) -> tuple:
        """Point a decode Batch's device copies at this cache's buffers for B rows and a
        table width W (blocks, rounded up to a power of two): the positions (B,) and
        tables (B, W) int32 a captured decode step reads, filled from the batch now.
        -> (the graph key's part, batch.device)"""
        B = batch.n_seq
        tables = batch.table_matrix()                                     # (B, blocks)
        W = min(1 << (tables.shape[1] - 1).bit_length(), self.n_rows // BLOCK_TOKENS)
        if tables.shape[1] < W:                                           # pad with each row's last block
            tables = np.concatenate([tables, np.repeat(tables[:, -1:], W - tables.shape[1], 1)], 1)
        slots = self.batch_slots.get((B, W))
        if slots is None:
            slots = self.batch_slots[(B, W)] = (cp.zeros(B, cp.int32), cp.zeros((B, W), cp.int32))
        pos, tab = slots
        pos.set(np.ascontiguousarray(batch.positions))
        tab.set(np.ascontiguousarray(tables))
        batch.device.update(pos=DevicePos(batch.max_pos, pos), tables=tab)
        return ("decode batch", B, W), batch.device

    def set_table(self, blocks, pad: int) -> None:
        """The sequence this view reads: its blocks, the rest of the table `pad` (a
        block no sequence shares: a decode step queued past the sequence's blocks
        writes only there, and the decode attention's L2 prefetch reads only valid
        rows). A queued decode step read the old table: it is dropped."""
        if len(blocks) > self.table.size or not all(0 <= b < self.n_rows // BLOCK_TOKENS for b in blocks):
            raise ValueError(f"set_table: {len(blocks)} blocks for a table of {self.table.size} "
                             f"over {self.n_rows // BLOCK_TOKENS} blocks")
        t = np.full(self.table.size, pad, np.int32)
        t[:len(blocks)] = blocks
        self.table.set(t)
        self.queued = None

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
