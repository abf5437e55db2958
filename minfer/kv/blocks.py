"""The paged KV cache's block pool, with automatic prefix caching (vLLM's design).

The cache is n_blocks blocks of block_tokens positions each; a sequence holds a
table of block ids, so its K/V need not be contiguous and sequences that share a
prompt prefix share the blocks that hold it. Every block is in exactly one state:

    free      refcount 0, no hash: on the free list, handed out first
    cached    refcount 0, registered hash: in the LRU order, still matchable,
              handed out (evicted, its hash dropped) when the free list is empty
    used      refcount > 0, with or without a hash

A full block's hash chains its parent's: h_i = H(h_{i-1} || tokens of block i),
so a hash names the whole prefix up to the block's end, not just its own tokens
(the same 64 tokens after a different prefix have different K/V). Only full
blocks are hashed: a partial block's content is still growing.

Pure bookkeeping: what a block's rows hold is the caller's business (it writes K/V
into the slots, then registers); the pool only counts, names and recycles ids.
"""
from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict

import numpy as np

from ..errors import MinferError

BLOCK_TOKENS = 64   # positions per block: the prefill flash attention's key tile and the decode attention's split are 64 keys, so a tile never straddles two blocks


def cache_rows(table, start: int, stop: int, block_tokens: int = BLOCK_TOKENS) -> np.ndarray:
    """The cache rows of positions start..stop-1 through a block table -> int64
    (stop - start,): table[p // bt] * bt + p % bt, the host side's form of the
    kernels' kv_row (kernels/common.cuh)."""
    p = np.arange(start, stop, dtype=np.int64)
    return np.asarray(table, np.int64)[p // block_tokens] * block_tokens + p % block_tokens


def token_array(tokens) -> np.ndarray:
    """tokens as int32 little-endian, the bytes the hash reads; ids outside int32 are a ValueError."""
    a = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if a.size and (a.min() < -2**31 or a.max() >= 2**31):
        raise ValueError("kv: token ids must fit in int32")
    return a.astype("<i4")


def chain_hash(parent: bytes, block: np.ndarray) -> bytes:
    """One block's hash from its parent's (b"" for the first block) and its int32 tokens.
    blake2b at 128 bits: a collision (two prefixes sharing K/V rows) is ~2^-64 at
    2^32 blocks, where Python's hash() would be 64 bits and seeded per process."""
    return hashlib.blake2b(parent + block.astype("<i4", copy=False).tobytes(), digest_size=16).digest()


def block_hashes(tokens, block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    """Chain hashes of the FULL blocks of tokens (a partial last block has none)."""
    a = token_array(tokens)
    out, parent = [], b""
    for i in range(len(a) // block_tokens):
        parent = chain_hash(parent, a[i * block_tokens:(i + 1) * block_tokens])
        out.append(parent)
    return out


class BlockPool:
    """Block ids, their refcounts and the prefix cache. Programming errors (releasing a
    free block, an id out of range) are ValueError; running out of blocks is the one
    MinferError, since it follows from the request (prompt length, batch) and the -c."""

    def __init__(self, n_blocks: int, block_tokens: int = BLOCK_TOKENS):
        if n_blocks < 1 or block_tokens < 1:
            raise MinferError(f"kv cache: {n_blocks} blocks of {block_tokens} positions: both must be at least 1")
        self.n_blocks, self.block_tokens = int(n_blocks), int(block_tokens)
        self._refs = [0] * self.n_blocks
        self._free = list(range(self.n_blocks - 1, -1, -1))   # popped from the end: block 0 first
        self._block_of: dict[bytes, int] = {}                   # hash -> the block that holds it
        self._hash_of: dict[int, bytes] = {}                    # block -> its hash (registered blocks only)
        self._lru: OrderedDict[int, None] = OrderedDict()       # cached blocks at refcount 0, oldest first
        self._queries = self._hits = self._evictions = 0

    # --- counts ---------------------------------------------------------------------

    def n_free(self) -> int:
        """Blocks allocate() can hand out now: free ones and cached-but-unreferenced ones."""
        return len(self._free) + len(self._lru)

    def n_used(self) -> int:
        return self.n_blocks - self.n_free()

    def n_cached(self) -> int:
        """Blocks holding a registered prefix, referenced or not."""
        return len(self._hash_of)

    def refcount(self, block: int) -> int:
        return self._refs[self._check(block)]

    def hash_of(self, block: int) -> bytes | None:
        """The prefix hash a block is registered under, None if unregistered."""
        return self._hash_of.get(self._check(block))

    def stats(self) -> dict:
        """Gauges (blocks by state) and counters (since creation), named for Prometheus:
        prefix_hit_tokens / prefix_queries_tokens is the share of the cacheable prompt
        tokens (full blocks, within match's limit) that the cache supplied."""
        return {"blocks": self.n_blocks, "used": self.n_used(), "cached": self.n_cached(),
                "free": self.n_free(), "prefix_queries_tokens": self._queries,
                "prefix_hit_tokens": self._hits, "evictions": self._evictions}

    # --- handing out and taking back ------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks, refcount 1 each, unregistered: free ones first, then the
        least recently used cached ones (their hashes dropped). All or nothing."""
        if n < 0:
            raise ValueError(f"kv: allocate({n})")
        if n > self.n_free():
            raise MinferError(f"kv cache: out of blocks: {n} asked for, {self.n_free()} free of {self.n_blocks} "
                              f"({self.block_tokens} positions each): a shorter prompt, fewer sequences at once or a larger cache")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._lru.popitem(last=False)
                del self._block_of[self._hash_of.pop(b)]
                self._evictions += 1
            self._refs[b] = 1
            out.append(b)
        return out

    def release(self, blocks) -> None:
        """Drop one reference per listed block; at 0 a registered block joins the LRU
        tail (most recently used), an unregistered one the free list. Blocks released
        in one call become cached in the order given: a sequence releases its table
        last block first, so its longest prefix is evicted before the blocks it hangs on.
        Checked before anything changes."""
        blocks = [self._check(b) for b in blocks]
        for b, k in Counter(blocks).items():
            if self._refs[b] < k:
                raise ValueError(f"kv: releasing block {b} {k} time(s) at refcount {self._refs[b]}")
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._lru[b] = None
                else:
                    self._free.append(b)

    def ref(self, blocks) -> None:
        """One more reference per listed block (a fork shares its parent's blocks). Only
        live blocks: a cached block at refcount 0 is revived through match()."""
        blocks = [self._check(b) for b in blocks]
        for b in blocks:
            if self._refs[b] == 0:
                raise ValueError(f"kv: ref() of block {b} at refcount 0")
        for b in blocks:
            self._refs[b] += 1

    # --- the prefix cache -----------------------------------------------------------

    def match(self, tokens, limit: int | None = None) -> list[int]:
        """The longest run of cached blocks that is a prefix of tokens[:limit], each
        with one more reference (a block at refcount 0 leaves the LRU order)."""
        if limit is not None and limit < 0:
            raise ValueError(f"kv: match limit {limit}")
        head = token_array(tokens)[:limit]
        hashes = block_hashes(head, self.block_tokens)
        out = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        for b in out:
            if self._refs[b] == 0:
                del self._lru[b]
            self._refs[b] += 1
        self._queries += len(hashes) * self.block_tokens
        self._hits += len(out) * self.block_tokens
        return out

    def register(self, blocks: list[int], tokens) -> None:
        """After the caller has written the K/V of tokens into blocks (blocks[i] holds
        tokens[i*bt:(i+1)*bt]), record the hash of every full block, so that later
        prompts with this prefix find them."""
        hashes = block_hashes(tokens, self.block_tokens)
        if len(blocks) < len(hashes):
            raise ValueError(f"kv: {len(hashes)} full blocks of tokens but {len(blocks)} blocks")
        self.register_hashes(list(blocks)[:len(hashes)], hashes)

    def register_hashes(self, blocks: list[int], hashes: list[bytes]) -> None:
        """register() with the chain hashes already known (a growing sequence keeps its
        own, so a block filling during decode costs one hash, not the whole history).
        A hash already held by another block keeps that block: this one stays
        unregistered and goes to the free list at refcount 0 (two sequences that
        computed the same prefix side by side). Checked before anything changes."""
        if len(blocks) != len(hashes):
            raise ValueError(f"kv: {len(blocks)} blocks, {len(hashes)} hashes")
        blocks = [self._check(b) for b in blocks]
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"kv: a block listed twice in {blocks}")
        for b, h in zip(blocks, hashes):
            if self._refs[b] == 0:
                raise ValueError(f"kv: registering block {b} at refcount 0")
            if self._hash_of.get(b, h) != h:
                raise ValueError(f"kv: block {b} is registered under another prefix")
        for b, h in zip(blocks, hashes):
            if b not in self._hash_of and h not in self._block_of:
                self._block_of[h] = b
                self._hash_of[b] = h

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached block (they become free); blocks in use keep
        their hashes, since a sequence still reads them and may hand them on."""
        for b in self._lru:
            del self._block_of[self._hash_of.pop(b)]
            self._free.append(b)
        self._lru.clear()

    def _check(self, block) -> int:
        b = int(block)
        if not 0 <= b < self.n_blocks:   # a negative id would index from the end silently
            raise ValueError(f"kv: block {block} outside 0..{self.n_blocks - 1}")
        return b
