"""A backend's paged KV cache: the storage (a new_cache whose rows are blocks), the
block pool that hands them out and keeps prefixes, and the sequences' views.

The pool keeps one block to itself (`pad`): a view's table is padded with it past
the sequence's blocks, so a write past them (a decode step queued one position
ahead) or a read of the whole table (the decode attention's L2 prefetch) touches no
block another sequence holds.
"""
from __future__ import annotations

from .blocks import BLOCK_TOKENS, BlockPool
from .sequence import SeqBlocks


class PagedCache:
    def __init__(self, backend, n_blocks: int):
        if n_blocks < 2:
            raise ValueError(f"a paged cache of {n_blocks} blocks: at least 2 (one is the pad)")
        self.backend = backend
        self.storage = backend.new_cache(n_blocks * BLOCK_TOKENS)     # (n_layer, n_blocks * 64, ...)
        self.pool = BlockPool(n_blocks)
        self.pad, = self.pool.allocate(1)

    @staticmethod
    def blocks_for(n_tokens: int) -> int:
        """Blocks that hold n_tokens positions."""
        return -(-int(n_tokens) // BLOCK_TOKENS)

    @property
    def n_tokens(self) -> int:
        """Positions the sequences can hold together (the pad block aside)."""
        return (self.pool.n_blocks - 1) * BLOCK_TOKENS

    def admit(self, prompt, match: bool = True) -> SeqBlocks:
        """A sequence for prompt, its cached prefix matched (unless match=False)."""
        return SeqBlocks(self.pool, prompt, match=match)

    def view(self, n_ctx: int):
        """A sequence view of n_ctx positions over the storage (Backend.sequence_cache)."""
        return self.backend.sequence_cache(self.storage, n_ctx)

    def show(self, view, seq: SeqBlocks) -> None:
        """Point view at seq's blocks (the rest of its table at the pad block)."""
        view.set_table(seq.table, self.pad)

    def stats(self) -> dict:
        return self.pool.stats()
