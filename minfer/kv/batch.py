"""The rows of one forward over several sequences (FlashAttention's varlen layout):
each sequence a run of new tokens at its own start position, over its own block
table of a paged cache. Backend-agnostic: the host arrays every backend reads; a
backend keeps its device copies in `device` (made once per batch, shared by every
layer).

Rows are the sequences' new tokens concatenated in order: sequence s owns rows
starts[s]..starts[s+1]-1, at positions pos0_s.. . The linears run once over all
rows; RoPE takes each row's position; attention lets a row see only its own
sequence's keys, causally; the LM head runs on the rows asked for.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import MinferError
from .blocks import BLOCK_TOKENS, cache_rows


@dataclass(frozen=True)
class Span:
    """One sequence's part of a forward: n new tokens at positions pos0..pos0+n-1
    (pos0 = its tokens already in the cache), its block table covering them."""
    pos0: int
    n: int
    table: tuple[int, ...]


class Batch:
    """spans -> the forward's row layout. logits_from: None for each sequence's last
    row (generation), k for each sequence's rows k.. (0: every row, scoring; n/2:
    perplexity's scored half), as Transformer.forward takes it. prefill: every row
    is a prompt's (a backend in the deterministic mode runs such rows on the prompt
    rows' kernels, even one a sequence)."""

    def __init__(self, spans, logits_from: int | None = None, block_tokens: int = BLOCK_TOKENS,
                 prefill: bool = False):
        spans = [s if isinstance(s, Span) else Span(int(s[0]), int(s[1]), tuple(int(b) for b in s[2]))
                 for s in spans]
        if not spans:
            raise MinferError("an empty batch: give at least one sequence")
        if logits_from is not None and not 0 <= logits_from < min(s.n for s in spans):
            raise ValueError(f"batch: logits from row {logits_from} of sequences of "
                             f"{min(s.n for s in spans)} and more rows")
        for i, s in enumerate(spans):
            if s.n < 1 or s.pos0 < 0:
                raise MinferError(f"sequence {i} of the batch has {s.n} new tokens at position {s.pos0}: "
                                  f"each needs at least one, at a position >= 0")
            if s.pos0 + s.n > len(s.table) * block_tokens:
                raise ValueError(f"batch: sequence {i}'s {len(s.table)} blocks do not cover "
                                 f"positions up to {s.pos0 + s.n}")
        self.spans, self.block_tokens, self.logits_from = spans, block_tokens, logits_from
        self.prefill = bool(prefill)
        n = np.array([s.n for s in spans], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)     # (n_seq + 1,)
        self.n_rows = int(self.starts[-1])
        pos = np.concatenate([np.arange(s.pos0, s.pos0 + s.n) for s in spans])  # (T,)
        rows = np.concatenate([cache_rows(s.table, s.pos0, s.pos0 + s.n, block_tokens) for s in spans])
        self.rows = np.stack([pos, rows], axis=1).astype(np.int32)             # (T, 2): position, cache row
        self.max_pos = int(pos.max())
        if logits_from is None:
            self.logit_rows = (self.starts[1:] - 1).astype(np.int64)            # (n_seq,)
        else:                                                                    # (R,)
            self.logit_rows = np.concatenate([np.arange(self.starts[i] + logits_from, self.starts[i + 1])
                                              for i in range(len(spans))]).astype(np.int64)
        self.device: dict = {}              # a backend's copies of the arrays above

    @property
    def n_seq(self) -> int:
        return len(self.spans)

    @property
    def decode(self) -> bool:
        """A decode step: one new row per sequence (one sequence or many: a row's
        kernels are the same either way, so a sequence's step does not change when
        its neighbours finish), not rows of prompts."""
        return self.n_rows == self.n_seq and not self.prefill

    def table_matrix(self) -> np.ndarray:
        """(n_seq, max blocks) int32: each sequence's table, padded with its own last
        block (a valid block: a read of the whole row, such as the decode attention's
        L2 prefetch, stays inside the sequence's own rows)."""
        width = max(len(s.table) for s in self.spans)
        return np.array([list(s.table) + [s.table[-1]] * (width - len(s.table)) for s in self.spans], np.int32)

    @property
    def positions(self) -> np.ndarray:
        """(T,) int32: each row's position."""
        return self.rows[:, 0]

    def seq_rows(self, s: int) -> slice:
        return slice(int(self.starts[s]), int(self.starts[s + 1]))

    def key_rows(self, s: int) -> np.ndarray:
        """(pos0 + n,) int64: the cache rows of sequence s's positions 0..pos0+n-1 (the
        keys its last row sees)."""
        sp = self.spans[s]
        return cache_rows(sp.table, 0, sp.pos0 + sp.n, self.block_tokens)
