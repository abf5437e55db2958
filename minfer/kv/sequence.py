"""One sequence's blocks in a BlockPool: its block table and the tokens whose K/V are
in the cache. Its own file, not blocks.py: the pool is shared state with one job
(ids, refcounts, the prefix cache), this is one request's view of it, which the
scheduler creates and drops per request.

The life of a sequence, the caller's side (the backend writes K/V, this records):

    seq = SeqBlocks(pool, prompt)          # the cached prefix matched: seq.n_cached
    new = prompt[seq.n_cached:]            # never empty: the last prompt token is always computed
    seq.reserve(seq.n_cached + len(new))   # blocks for every position to be written
    forward(new, slots=seq.slots(seq.n_cached, seq.n_cached + len(new)))  -> first generated g1
    seq.append(new)                        # their K/V is now in the cache
    # each decode step feeds the token produced by the step before:
    seq.reserve(seq.n_cached + 1); forward([g1], slots=seq.slots(p, p + 1)) -> g2; seq.append([g1])
    seq.free()

append() takes the tokens whose K/V IS in the cache, which during decode trails
generation by one: g1 is produced by the prefill but its K/V is written by the
next step, so that step appends g1, not g2. A token appended too early would be
hashed into a block whose rows do not hold it yet, and another prompt could match it.
"""
from __future__ import annotations

import numpy as np

from ..errors import MinferError
from .blocks import BlockPool, block_hashes, cache_rows, chain_hash, token_array


class SeqBlocks:
    """One sequence's blocks in a pool: its block table, how many of its tokens have K/V in the cache."""

    def __init__(self, pool: BlockPool, tokens, match: bool = True):
        """match=False: nothing taken from the prefix cache (every position is
        computed: scoring, which needs each position's logits)."""
        prompt = [int(t) for t in token_array(tokens)]
        if not prompt:
            raise MinferError("kv cache: an empty prompt: there is no token to compute")
        self.pool, self.prompt = pool, prompt
        # limit len - 1: the last prompt token is computed even when all of it is
        # cached (its logits start generation), so a prompt of exactly k blocks
        # matches at most k - 1 (vLLM's rule)
        self.table: list[int] = pool.match(prompt, limit=len(prompt) - 1) if match else []
        self.tokens: list[int] = prompt[:len(self.table) * pool.block_tokens]   # K/V in the cache
        self._hashes = block_hashes(self.tokens, pool.block_tokens)             # of tokens' full blocks
        self._freed = False
        self._shared = True             # its blocks may still be registered (append's share)

    @property
    def n_cached(self) -> int:
        """Positions 0..n_cached-1 have their K/V in the cache."""
        return len(self.tokens)

    def reserve(self, n_total: int) -> None:
        """Blocks so that positions 0..n_total-1 have one. All or nothing: MinferError
        (the pool's) when it is short, and the table is as it was."""
        self._live()
        bt = self.pool.block_tokens
        need = -(-int(n_total) // bt) - len(self.table)
        if need > 0:
            self.table += self.pool.allocate(need)

    def append(self, ids, share: bool = True) -> None:
        """Record that the K/V of ids, at positions n_cached.., are now written (see the
        module docstring for which tokens those are during decode); every block they
        fill is registered in the pool's prefix cache. share=False: these rows are not
        to be found by other prompts, nor is any block from here on (the deterministic
        mode's decode rows, computed by other kernels than a prompt's rows would be)."""
        self._live()
        self._shared = self._shared and share
        ids = [int(t) for t in token_array(ids)]
        bt = self.pool.block_tokens
        if len(self.tokens) + len(ids) > len(self.table) * bt:
            raise ValueError(f"kv: {len(self.tokens) + len(ids)} positions written, "
                             f"{len(self.table) * bt} reserved: reserve() first")
        self.tokens += ids
        start = len(self._hashes)
        for i in range(start, len(self.tokens) // bt):
            parent = self._hashes[-1] if self._hashes else b""
            self._hashes.append(chain_hash(parent, np.asarray(self.tokens[i * bt:(i + 1) * bt])))
        if len(self._hashes) > start and self._shared:
            self.pool.register_hashes(self.table[start:len(self._hashes)], self._hashes[start:])

    def slots(self, start: int, stop: int) -> np.ndarray:
        """(stop - start,) int32: the cache rows of positions start..stop-1
        (blocks.cache_rows)."""
        self._live()
        bt = self.pool.block_tokens
        if not 0 <= start <= stop <= len(self.table) * bt:
            raise ValueError(f"kv: slots({start}, {stop}) outside the {len(self.table) * bt} reserved positions")
        return cache_rows(self.table, start, stop, bt).astype(np.int32)

    def free(self) -> None:
        """Release every block, last first (so the pool evicts this sequence's longest
        prefix before the shorter ones it extends). A second call does nothing."""
        if not self._freed:
            self.pool.release(self.table[::-1])
            self.table, self._freed = [], True

    def _live(self) -> None:
        if self._freed:
            raise ValueError("kv: the sequence's blocks were freed")
