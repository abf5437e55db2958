"""minfer/kv: the block pool and its prefix cache (blocks.py), one sequence's table
(sequence.py). The edge cases one by one, then a randomized run checked after every
operation against an independent model that keys the cache by token tuples (no
hashes) and keeps its own refcounts and LRU order. CPU only, pure bookkeeping."""
from __future__ import annotations

import random

import numpy as np
import pytest

from minfer.errors import MinferError
from minfer.kv.blocks import BLOCK_TOKENS, BlockPool, block_hashes
from minfer.kv.sequence import SeqBlocks

BT = 4   # small blocks keep the token lists readable


def _admit(pool, tokens):
    """A sequence through its prefill: match, reserve, 'write', append."""
    seq = SeqBlocks(pool, tokens)
    seq.reserve(len(tokens))
    seq.append(list(tokens)[seq.n_cached:])
    return seq


def test_block_hashes_chain_full_blocks_only():
    t = list(range(10))
    h = block_hashes(t, 4)
    assert len(h) == 2 and all(isinstance(x, bytes) and len(x) == 16 for x in h)
    assert block_hashes(t[:8], 4) == h and block_hashes(t[:3], 4) == []
    assert block_hashes(np.array(t, np.int64), 4) == h == block_hashes(np.array(t, np.int32), 4)
    # the same block tokens after a different prefix hash differently: the chain
    assert block_hashes([9, 9, 9, 9, 4, 5, 6, 7], 4)[1] != h[1]
    assert BLOCK_TOKENS == 64 and len(block_hashes(range(130))) == 2
    with pytest.raises(ValueError):
        block_hashes([2**31], 4)


def test_short_prompt_matches_nothing_and_registers_once_a_block_fills():
    pool = BlockPool(8, BT)
    seq = _admit(pool, [1, 2, 3])
    assert seq.n_cached == 3 and seq.table == [0] and pool.n_cached() == 0
    seq.reserve(4)
    seq.append([7])                      # the generated token's K/V, one step later
    assert pool.n_cached() == 1 and pool.hash_of(0) == block_hashes([1, 2, 3, 7], BT)[0]
    other = SeqBlocks(pool, [1, 2, 3, 7, 8])
    assert other.table == [0] and other.n_cached == 4 and pool.refcount(0) == 2


def test_rows_appended_unshared_register_no_block_from_there_on():
    """append(share=False) (the deterministic mode's decode rows): the block they
    complete and every later one stay out of the prefix cache; the prompt's full
    blocks before them are found as usual."""
    pool = BlockPool(8, BT)
    seq = _admit(pool, [1, 2, 3, 4, 5, 6])                   # one full block registered
    assert pool.n_cached() == 1
    seq.reserve(12)
    seq.append([7, 8], share=False)                          # completes block 1: not registered
    seq.append([9, 10, 11, 12])                              # block 2, after them: not either
    assert pool.n_cached() == 1 and seq.n_cached == 12
    other = SeqBlocks(pool, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert other.n_cached == 4 and other.table == seq.table[:1]


def test_prompt_of_exactly_k_blocks_matches_k_minus_1():
    pool = BlockPool(8, BT)
    first = _admit(pool, list(range(8)))
    assert pool.n_cached() == 2
    again = SeqBlocks(pool, list(range(8)))
    assert again.table == first.table[:1] and again.n_cached == 4   # the last token is always computed
    longer = SeqBlocks(pool, list(range(9)))
    assert longer.table == first.table and longer.n_cached == 8


def test_shared_prefix_refcounts_and_freeing_one_keeps_the_blocks():
    pool = BlockPool(8, BT)
    a = _admit(pool, list(range(10)))            # blocks 0, 1 full, 2 partial
    b = _admit(pool, list(range(9)) + [99])
    assert b.table[:2] == a.table[:2] and b.table[2] != a.table[2]
    assert [pool.refcount(x) for x in a.table] == [2, 2, 1]
    a.free()
    a.free()                                     # idempotent
    assert [pool.refcount(x) for x in b.table] == [1, 1, 1]
    assert pool.n_used() == 3 and pool.n_cached() == 2 and pool.n_free() == 5
    b.free()
    assert pool.n_used() == 0 and pool.n_cached() == 2 and pool.n_free() == 8
    with pytest.raises(ValueError):
        b.reserve(20)


def test_eviction_is_lru_and_evicted_blocks_no_longer_match():
    pool = BlockPool(4, BT)
    for base in (100, 200, 300):                 # three one-block prompts, cached, released in order
        _admit(pool, [base + i for i in range(5)]).free()
    assert pool.n_cached() == 3 and pool.n_free() == 4
    SeqBlocks(pool, [100, 101, 102, 103, 0]).free()    # touch 100: now the most recent
    got = pool.allocate(2)                       # the never-used block, then the oldest cached: 200's
    assert pool.stats()["evictions"] == 1
    assert SeqBlocks(pool, [200, 201, 202, 203, 0]).table == []
    assert len(SeqBlocks(pool, [300, 301, 302, 303, 0]).table) == 1
    assert len(SeqBlocks(pool, [100, 101, 102, 103, 0]).table) == 1
    pool.release(got)


def test_free_order_evicts_the_tail_of_a_prefix_first():
    pool = BlockPool(3, BT)
    seq = _admit(pool, list(range(12)))
    seq.free()
    pool.release(pool.allocate(1))               # evicts one: the last block, not the first
    assert len(SeqBlocks(pool, list(range(12)) + [0]).table) == 2


def test_different_prefix_with_the_same_block_tokens_does_not_match():
    pool = BlockPool(8, BT)
    _admit(pool, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    _admit(pool, [9, 9, 9, 9, 0])
    seq = SeqBlocks(pool, [9, 9, 9, 9, 5, 6, 7, 8, 0])
    assert len(seq.table) == 1 and seq.n_cached == 4


def test_allocate_failing_changes_nothing():
    pool = BlockPool(4, BT)
    _admit(pool, [1, 2, 3, 4, 5]).free()         # one cached, the rest free
    held = pool.allocate(1)
    before = (pool.stats(), [pool.refcount(b) for b in range(4)], [pool.hash_of(b) for b in range(4)])
    with pytest.raises(MinferError, match=r"4 asked for, 3 free") as e:
        pool.allocate(4)
    assert "\n" not in str(e.value)
    assert before == (pool.stats(), [pool.refcount(b) for b in range(4)], [pool.hash_of(b) for b in range(4)])
    seq = SeqBlocks(pool, [1, 2, 3, 4, 5])
    table = list(seq.table)
    with pytest.raises(MinferError):
        seq.reserve(100)
    assert seq.table == table and pool.n_used() == 2
    pool.release(held)


def test_register_keeps_an_existing_hash_and_the_duplicate_is_freed():
    pool = BlockPool(8, BT)
    a, b = SeqBlocks(pool, [1, 2, 3, 4, 5]), SeqBlocks(pool, [1, 2, 3, 4, 5])   # side by side: no match yet
    for s in (a, b):
        s.reserve(5)
    a.append([1, 2, 3, 4, 5])
    b.append([1, 2, 3, 4, 5])
    assert pool.hash_of(a.table[0]) is not None and pool.hash_of(b.table[0]) is None
    assert pool.n_cached() == 1
    b.free()
    assert pool.n_free() == 6 and pool.n_cached() == 1
    assert SeqBlocks(pool, [1, 2, 3, 4, 0]).table == a.table[:1]


def test_programming_errors_are_value_errors():
    pool = BlockPool(4, BT)
    blocks = pool.allocate(2)
    pool.register(blocks, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="another prefix"):
        pool.register(blocks, [5, 6, 7, 8])
    with pytest.raises(ValueError):
        pool.register(blocks[:1], list(range(8)))    # two full blocks, one block
    with pytest.raises(ValueError):
        pool.release([blocks[1], blocks[1]])         # refcount 1, released twice: nothing changes
    assert pool.refcount(blocks[1]) == 1
    with pytest.raises(ValueError):
        pool.release([-1])
    pool.release(blocks)
    with pytest.raises(ValueError):
        pool.release(blocks[:1])
    with pytest.raises(ValueError):
        pool.ref(blocks[:1])
    with pytest.raises(MinferError):
        SeqBlocks(pool, [])
    seq = SeqBlocks(pool, [1, 2])
    with pytest.raises(ValueError, match="reserve"):
        seq.append([1, 2])


def test_ref_slots_and_reset():
    pool = BlockPool(8, BT)
    seq = _admit(pool, list(range(6)))
    pool.ref(seq.table)
    assert [pool.refcount(b) for b in seq.table] == [2, 2]
    pool.release(seq.table)
    assert seq.slots(2, 6).dtype == np.int32
    t = seq.table
    assert seq.slots(0, 6).tolist() == [t[0] * BT + i for i in range(4)] + [t[1] * BT, t[1] * BT + 1]
    with pytest.raises(ValueError):
        seq.slots(0, 9)
    _admit(pool, [50, 51, 52, 53, 54]).free()
    assert pool.n_cached() == 2
    pool.reset_prefix_cache()                     # the free one's hash goes, the live one's stays
    assert pool.n_cached() == 1 and pool.hash_of(t[0]) is not None and pool.n_free() == 6
    assert SeqBlocks(pool, [50, 51, 52, 53, 0]).table == []


def test_stats_counters():
    pool = BlockPool(8, BT)
    _admit(pool, list(range(10)))                 # limit 9: 2 full blocks asked about, none found
    _admit(pool, list(range(10)))                 # 2 asked, 2 found
    _admit(pool, [1, 2])                          # none asked
    assert pool.stats() == {"blocks": 8, "used": 5, "cached": 2, "free": 3,
                            "prefix_queries_tokens": 16, "prefix_hit_tokens": 8, "evictions": 0}


# --- the randomized run against an independent model ------------------------------

class Model:
    """The pool's rules over token tuples: content[prefix] = block, its own
    refcounts, free set and LRU list."""

    def __init__(self, n):
        self.refs, self.free, self.lru, self.content, self.prefix_of = [0] * n, set(range(n)), [], {}, {}

    def allocated(self, got):
        k = max(0, len(got) - len(self.free))
        if k == 0:
            assert set(got) <= self.free
        else:
            assert set(got) == self.free | set(self.lru[:k])
            for b in self.lru[:k]:
                del self.content[self.prefix_of.pop(b)]
            self.lru = self.lru[k:]
        self.free -= set(got)
        for b in got:
            self.refs[b] = 1

    def matched(self, tokens, limit):
        out = []
        for i in range(len(tokens[:limit]) // BT):
            b = self.content.get(tuple(tokens[:(i + 1) * BT]))
            if b is None:
                break
            out.append(b)
        for b in out:
            if self.refs[b] == 0:
                self.lru.remove(b)
            self.refs[b] += 1
        return out

    def written(self, table, tokens):
        for i in range(len(tokens) // BT):
            key, b = tuple(tokens[:(i + 1) * BT]), table[i]
            if b not in self.prefix_of and key not in self.content:
                self.content[key], self.prefix_of[b] = b, key

    def released(self, blocks):
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                (self.lru.append if b in self.prefix_of else self.free.add)(b)


@pytest.mark.parametrize("seed", range(4))
def test_randomized_against_a_model(seed):
    rng = random.Random(seed)
    n = 24
    pool, model, live = BlockPool(n, BT), Model(n), []
    stems = [[rng.randrange(3) for _ in range(rng.randrange(1, 14))] for _ in range(6)]
    for step in range(1500):
        op = rng.random()
        if op < 0.35 or not live:                   # admit a prompt sharing a stem
            prompt = rng.choice(stems)[:rng.randrange(1, 14)] + [rng.randrange(3) for _ in range(rng.randrange(4))]
            seq = SeqBlocks(pool, prompt)
            assert seq.table == model.matched(prompt, len(prompt) - 1), step
            live.append(seq)
        elif op < 0.8:                              # write some tokens (prompt rest or generated)
            seq = rng.choice(live)
            rest = seq.prompt[seq.n_cached:] or [rng.randrange(3)]
            ids = rest[:rng.randrange(1, len(rest) + 1)]
            before = len(seq.table)
            try:
                seq.reserve(seq.n_cached + len(ids))
            except MinferError:
                assert pool.n_free() < -(-(seq.n_cached + len(ids)) // BT) - before
                continue
            model.allocated(seq.table[before:])
            seq.append(ids)
            model.written(seq.table, seq.tokens)
        else:                                       # finish one
            seq = live.pop(rng.randrange(len(live)))
            model.released(seq.table[::-1])
            seq.free()
        refs = [pool.refcount(b) for b in range(n)]
        assert refs == model.refs, step
        assert sum(refs) == sum(len(s.table) for s in live)
        cached0 = [b for b in range(n) if refs[b] == 0 and pool.hash_of(b) is not None]
        assert set(cached0) == set(model.lru) and sorted(model.free) == [b for b in range(n) if refs[b] == 0 and b not in cached0]
        assert all(pool.hash_of(b) == block_hashes(p, BT)[-1] for b, p in model.prefix_of.items())
        assert pool.n_free() + pool.n_used() == n and pool.n_used() == sum(r > 0 for r in refs)
        assert len(model.free) + len(model.lru) + pool.n_used() == n
        assert pool.n_cached() == len(model.prefix_of)
    st = pool.stats()
    assert st["evictions"] > 0 and 0 < st["prefix_hit_tokens"] < st["prefix_queries_tokens"]
