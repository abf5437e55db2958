"""Generation for many prompts at once: one forward prefills every prompt (each after
its cached prefix), then each decode step advances every running sequence by one
token in one forward (minfer/kv/batch.py). Results come back in prompt order, each
what Engine.generate returns for one prompt.

A sequence leaves the batch when it stops (an end-of-generation token, its
max_tokens, the context, a stop string); the others go on. Tokens are chosen on the
host from each step's logits (greedy: the first maximum, as the one-prompt path's
device argmax; sampled: minfer/sampling.py, by the sequence's own seed and
positions, so a draw does not depend on the other sequences), so logprobs cost no
extra read. The text and the stop strings go through generate.TextOut, as one
prompt's do. Each result's prompt_s and decode_s are the batch's wall times (all
sequences together), so its own tokens/s figures understate the batch's.
"""
from __future__ import annotations

import time

import numpy as np

from .generate import Generation, GenerationStats, TextOut, TokenLogprob, check_finite
from .kv.batch import Batch, Span
from .sampling import SamplingParams, sample

MAX_PREFILL_ROWS = 16384        # rows of one prefill forward: activations stay bounded; a longer
                                # prompt is a forward of its own


class _Seq:
    def __init__(self, i, ids, blocks, text: TextOut, logprobs: int | None):
        self.i, self.ids, self.blocks = i, ids, blocks
        self.out: list[int] = []
        self.stats = GenerationStats(n_prompt=len(ids), n_cached=blocks.n_cached)
        self.nxt = -1                     # the token chosen last: the next step's input
        self.nxt_lp: TokenLogprob | None = None     # its entry, when logprobs are asked for
        self.done = False
        self.text, self.pieces = text, []           # the text emitted so far, piece by piece
        self.n_top = logprobs
        self.logprobs: list[TokenLogprob] | None = None if logprobs is None else []


def generate_many(engine, prompts: list[np.ndarray], max_tokens: int, kv, ignore_eos: bool = False,
                  sampling: SamplingParams | None = None, stop=None,
                  logprobs: int | None = None) -> list[Generation]:
    """prompts: token id arrays (checked by the caller to fit the context); kv: the
    engine's PagedCache; stop, logprobs: as generate.generate takes them (checked by
    the caller), the same for every prompt. Every sequence's blocks are reserved
    before any work (all or nothing: a batch the cache cannot hold is one
    MinferError, nothing changed)."""
    model, tok = engine.model, engine.tokenizer
    eog = set() if ignore_eos else set(tok.eog_ids)
    greedy = sampling is None or sampling.greedy
    seqs: list[_Seq] = []
    try:
        for i, ids in enumerate(prompts):
            b = kv.admit(ids)
            seqs.append(_Seq(i, ids, b, TextOut(tok, stop), logprobs))
            b.reserve(min(len(ids) + max_tokens + 1, engine.n_ctx))
        t0 = time.perf_counter()
        for group in _prefill_groups(seqs):
            tokens = np.concatenate([s.ids[s.blocks.n_cached:] for s in group])
            spans = [Span(s.blocks.n_cached, len(s.ids) - s.blocks.n_cached, tuple(s.blocks.table)) for s in group]
            logits = model.forward_batch(tokens, Batch(spans), kv.storage)          # (len(group), vocab)
            for s, row in zip(group, logits):
                check_finite(row, f"at position {len(s.ids) - 1}")
                s.stats.n_written = len(s.ids)
                _choose(row, sampling, greedy, len(s.ids), s)
        engine.backend.synchronize()
        t_prefill = time.perf_counter() - t0
        for s in seqs:
            s.stats.prompt_s = t_prefill
            s.stats.stop = "max_tokens"
            _take(s, eog, max_tokens, engine.n_ctx)
        t1 = time.perf_counter()
        while True:
            live = [s for s in seqs if not s.done]
            if not live:
                break
            spans = [Span(s.stats.n_written, 1, tuple(s.blocks.table)) for s in live]
            logits = model.forward_batch(np.array([s.nxt for s in live], np.int32), Batch(spans), kv.storage)
            for s, row in zip(live, logits):
                pos = s.stats.n_written
                check_finite(row, f"at position {pos}")
                s.stats.n_written += 1
                _choose(row, sampling, greedy, pos + 1, s)
                _take(s, eog, max_tokens, engine.n_ctx)
        t_decode = time.perf_counter() - t1
        results = []
        for s in seqs:
            s.stats.decode_s = t_decode
            written = [int(t) for t in s.ids] + s.out
            s.blocks.append(written[s.blocks.n_cached:s.stats.n_written])
            text = "".join(s.pieces) + s.text.finish()      # as the one-prompt path streams it
            if s.text.stopped:                              # (finish may complete a stop string)
                s.stats.stop, s.stats.stop_string = "stop", s.text.matched
            results.append(Generation(prompt_ids=[int(t) for t in s.ids], ids=s.out, text=text, stats=s.stats,
                                      logprobs=s.logprobs))
        return results
    finally:
        for s in seqs:
            s.blocks.free()


def _prefill_groups(seqs):
    """Consecutive sequences whose new tokens fill at most MAX_PREFILL_ROWS rows (a
    longer one alone)."""
    group, rows = [], 0
    for s in seqs:
        n = len(s.ids) - s.blocks.n_cached
        if group and rows + n > MAX_PREFILL_ROWS:
            yield group
            group, rows = [], 0
        group.append(s)
        rows += n
    if group:
        yield group


def _choose(logits, sampling, greedy: bool, at: int, s: _Seq) -> None:
    """s.nxt from this step's logits row (and its logprob entry: the row is not kept)."""
    s.nxt = int(np.argmax(logits)) if greedy else sample(logits, sampling, at, s.ids, s.out)
    if s.n_top is not None:
        s.nxt_lp = TokenLogprob.of(logits, s.nxt, s.n_top)


def _take(s: _Seq, eog, max_tokens: int, n_ctx: int) -> None:
    """Record s.nxt as generated, or end the sequence (as generate.generate does)."""
    if s.nxt in eog:
        s.stats.stop, s.done = "eog", True
        return
    if len(s.out) >= max_tokens:
        s.done = True
        return
    s.out.append(s.nxt)
    s.stats.n_generated += 1
    if s.logprobs is not None:
        s.logprobs.append(s.nxt_lp)
    s.pieces.append(s.text.push(s.nxt))
    if s.text.stopped:
        s.done = True                   # stats.stop "stop" at the end, with finish()'s case
    elif len(s.out) >= max_tokens:
        s.done = True
    elif s.stats.n_written >= n_ctx:
        s.stats.stop, s.done = "context", True

