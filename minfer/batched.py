"""Generation for many sequences at once, one forward a step (minfer/kv/batch.py).

`BatchRunner` holds the running sequences. A sequence can join between any two
steps and be cancelled at any time (its blocks go back to the pool at once); each
`step()` is ONE `Transformer.forward_batch`: the next token of every sequence that
is decoding, then chunks of the prompts still prefilling, in the order they joined,
under a budget of rows per step (chunked prefill, as vLLM and Sarathi-Serve do: a
long prompt is split across steps, so it never stalls the decoding sequences for
more than one step's worth of rows). A chunk is a `Span(pos0, n, table)`; the last
row of a sequence's span gives its logits, which a chunk that does not end its
prompt leaves unused.

`generate_many` (Engine.generate with a list of prompts) is a loop over it: every
sequence joins, then steps until none runs. Results come back in prompt order, each
what Engine.generate returns for one prompt.

A sequence leaves the batch when it stops (an end-of-generation token, its
max_tokens, the context, a stop string); the others go on. Tokens are chosen on the
host from each step's logits (greedy: the first maximum, as the one-prompt path's
device argmax; sampled: minfer/sampling.py, by the sequence's own seed and
positions, so a draw does not depend on the other sequences or on how its prompt
was chunked), so logprobs cost no extra read. The text and the stop strings go
through generate.TextOut, as one prompt's do. A sequence's prompt_s is the wall
time from the start of its first step to the end of the step that finished its
prompt, decode_s from there to its last step: steps are shared, so its tokens/s
figures understate the batch's.

The KV cache: a sequence reserves the blocks of its whole run when it joins
(prompt + max_tokens + 1, at most the context; all or nothing), so a running
sequence never waits for blocks and nothing is preempted. Each step registers the
blocks it filled in the prefix cache (minfer/kv/sequence.py), so a sequence that
joins later shares a prompt prefix that a running one has already computed; a step
that fails (non-finite logits) registers nothing.

The deterministic mode (Backend.deterministic): a step's decode rows and its prompt
chunks are two forwards, never one (a backend runs each kind of row on its own
kernels, which a mixed forward would not let it choose: the prompt chunks' Batch
says prefill), and the blocks that decode rows write are not registered (their K/V
come from other kernels than a prompt's rows, so a later prompt that shares them
would not get the bits of its own prefill).
"""
from __future__ import annotations

import time

import numpy as np

from .generate import Generation, GenerationStats, TextOut, TokenLogprob, check_finite
from .kv.batch import Batch, Span
from .sampling import SamplingParams, sample

MAX_PREFILL_ROWS = 16384        # rows of one forward (generate_many's budget): activations stay
                                # bounded; a longer prompt is prefilled in chunks of this many


class Seq:
    """One running sequence of a BatchRunner: its prompt, its blocks, what it has
    generated (ids, text pieces, logprobs) and why it stopped."""

    def __init__(self, ids: np.ndarray, blocks, tokenizer, max_tokens: int, n_ctx: int, eog: set,
                 sampling: SamplingParams | None, stop, logprobs: int | None, tag=None):
        self.ids, self.blocks, self.tag = ids, blocks, tag
        self.max_tokens, self.n_ctx, self.eog = max_tokens, n_ctx, eog
        self.sampling = sampling
        self.greedy = sampling is None or sampling.greedy
        self.out: list[int] = []
        self.stats = GenerationStats(n_prompt=len(ids), n_cached=blocks.n_cached)
        self.stats.n_written = blocks.n_cached       # positions whose K/V is in the cache
        self.nxt = -1                     # the token chosen last: the next step's input
        self.nxt_lp: TokenLogprob | None = None     # its entry, when logprobs are asked for
        self.done = False
        self.cancelled = False
        self.text, self.pieces = TextOut(tokenizer, stop), []   # the text emitted so far, piece by piece
        self.n_top = logprobs
        self.logprobs: list[TokenLogprob] | None = None if logprobs is None else []
        self._t0: float | None = None     # start of its first step
        self._t1: float | None = None     # end of the step that finished its prompt

    @property
    def prefilling(self) -> bool:
        return self.stats.n_written < len(self.ids)

    def result(self) -> Generation:
        """What Engine.generate returns for this sequence (after it is done)."""
        return Generation(prompt_ids=[int(t) for t in self.ids], ids=self.out, text="".join(self.pieces),
                          stats=self.stats, logprobs=self.logprobs)


class BatchRunner:
    """Sequences that join, step together and leave; one forward a step.

    engine: an Engine (its model, tokenizer, backend and context); kv: a PagedCache
    of that backend; token_budget: the most rows one step's forward takes (decode
    rows first, one a sequence; prompt chunks share the rest)."""

    def __init__(self, engine, kv, token_budget: int = MAX_PREFILL_ROWS):
        if token_budget < 1:
            raise ValueError(f"BatchRunner: a token budget of {token_budget} rows")
        self.engine, self.kv, self.token_budget = engine, kv, int(token_budget)
        self.running: list[Seq] = []          # in the order they joined

    def add(self, ids: np.ndarray, max_tokens: int, *, ignore_eos: bool = False,
            sampling: SamplingParams | None = None, stop=None, logprobs: int | None = None,
            tag=None) -> Seq:
        """A new sequence for the prompt ids (checked by the caller to fit the context;
        stop and logprobs checked as generate.generate takes them), its cached prefix
        matched and the blocks of its whole run reserved -> its Seq, running from the
        next step. A cache too full for it is the pool's MinferError, nothing changed."""
        e = self.engine
        blocks = self.kv.admit(ids)
        try:
            blocks.reserve(min(len(ids) + max_tokens + 1, e.n_ctx))
            eog = set() if ignore_eos else set(e.tokenizer.eog_ids)
            s = Seq(np.asarray(ids, np.int32), blocks, e.tokenizer, int(max_tokens), e.n_ctx, eog,
                    sampling, stop, logprobs, tag)
        except BaseException:
            blocks.free()
            raise
        self.running.append(s)
        return s

    def cancel(self, s: Seq) -> None:
        """End s now (if it is still running): it leaves the batch and its blocks go back
        to the pool (what it wrote stays in the prefix cache)."""
        if not s.done:
            s.done = s.cancelled = True
            self._leave(s)

    def n_rows_next(self) -> int:
        """Rows the next step would run."""
        dec = sum(1 for s in self.running if not s.prefilling)
        left = max(self.token_budget - dec, 0)
        return dec + min(left, sum(len(s.ids) - s.stats.n_written for s in self.running if s.prefilling))

    def step(self) -> list[Seq]:
        """One forward over the running sequences -> the sequences it advanced (a token
        chosen, or a prompt chunk written), finished ones included (done: they have
        left the batch and their blocks are back in the pool). Nothing to run: []."""
        t0 = time.perf_counter()
        rows: list[tuple[Seq, int]] = []                  # (sequence, its new rows)
        tokens, spans = [], []
        for s in self.running:                            # decode rows first
            if not s.prefilling:
                rows.append((s, 1))
                tokens.append(np.array([s.nxt], np.int32))
                spans.append(Span(s.stats.n_written, 1, tuple(s.blocks.table)))
        budget = self.token_budget - len(rows)
        for s in self.running:                            # then prompt chunks, in joining order
            if s.prefilling and budget > 0:
                a = s.stats.n_written
                n = min(len(s.ids) - a, budget)
                budget -= n
                rows.append((s, n))
                tokens.append(s.ids[a:a + n])
                spans.append(Span(a, n, tuple(s.blocks.table)))
                if s._t0 is None:
                    s._t0 = t0
        if not rows:
            return []
        logits = self._forward(rows, tokens, spans)                                            # (n_seq, vocab)
        for (s, n), row in zip(rows, logits):             # all checked before anything changes
            end = s.stats.n_written + n
            if end >= len(s.ids):                         # a decode row, or the prompt's last chunk
                check_finite(row, f"at position {end - 1}")
        t = time.perf_counter()
        for (s, n), row in zip(rows, logits):
            pos = s.stats.n_written
            if s.prefilling:
                s.blocks.append(s.ids[pos:pos + n])      # their K/V is in the cache now
            else:
                s.blocks.append([s.nxt], share=not self.engine.backend.deterministic)
            s.stats.n_written = pos + n
            if s.prefilling:
                continue                                  # a chunk that leaves more of the prompt
            if s._t1 is None:                             # the prompt is done: its first token
                s._t1 = t
                s.stats.prompt_s = t - s._t0
                s.stats.stop = "max_tokens"
                _choose(row, s.stats.n_written, s)
                _take(s)
            else:
                _choose(row, s.stats.n_written, s)
                _take(s)
            s.stats.decode_s = t - s._t1
            if s.done:
                self._finish(s)
        return [s for s, _ in rows]

    def _forward(self, rows, tokens, spans) -> np.ndarray:
        """The step's forward(s) -> logits (n_seq, vocab) in the order of rows: one over
        every row, or in the deterministic mode one over the decode rows and one over
        the prompt chunks (rows holds the decode rows first)."""
        e = self.engine
        if not e.backend.deterministic:
            return e.model.forward_batch(np.concatenate(tokens), Batch(spans), self.kv.storage)
        n_dec = sum(1 for s, _ in rows if not s.prefilling)
        parts = []
        for lo, hi, prefill in ((0, n_dec, False), (n_dec, len(rows), True)):
            if hi > lo:
                parts.append(e.model.forward_batch(np.concatenate(tokens[lo:hi]),
                                                   Batch(spans[lo:hi], prefill=prefill), self.kv.storage))
        return np.concatenate(parts)

    def _finish(self, s: Seq) -> None:
        s.pieces.append(s.text.finish())                  # as the one-prompt path streams it
        if s.text.stopped:                                # (finish may complete a stop string)
            s.stats.stop, s.stats.stop_string = "stop", s.text.matched
        self._leave(s)

    def _leave(self, s: Seq) -> None:
        self.running.remove(s)
        s.blocks.free()


def generate_many(engine, prompts: list[np.ndarray], max_tokens: int, kv, ignore_eos: bool = False,
                  sampling: SamplingParams | None = None, stop=None,
                  logprobs: int | None = None, on_text=None,
                  token_budget: int = MAX_PREFILL_ROWS) -> list[Generation]:
    """prompts: token id arrays (checked by the caller to fit the context); kv: the
    engine's PagedCache; stop, logprobs: as generate.generate takes them (checked by
    the caller), the same for every prompt. Every sequence's blocks are reserved
    before any work (all or nothing: a batch the cache cannot hold is one
    MinferError, nothing changed). on_text: one prompt's text as it is produced;
    token_budget: the rows of one step (BatchRunner's: a smaller one chunks prompts)."""
    if on_text is not None and len(prompts) != 1:
        raise ValueError("generate_many: on_text streams one prompt's text")
    runner = BatchRunner(engine, kv, token_budget)
    seqs: list[Seq] = []
    try:
        for ids in prompts:
            seqs.append(runner.add(ids, max_tokens, ignore_eos=ignore_eos, sampling=sampling, stop=stop,
                                   logprobs=logprobs))
        sent = 0
        while runner.running:
            runner.step()
            if on_text is not None and len(seqs[0].pieces) > sent:
                text = "".join(seqs[0].pieces[sent:])
                sent = len(seqs[0].pieces)
                if text:
                    on_text(text)
        return [s.result() for s in seqs]
    finally:
        for s in seqs:
            runner.cancel(s)


def _choose(logits, at: int, s: Seq) -> None:
    """s.nxt, to sit at position `at`, from this step's logits row (and its logprob
    entry: the row is not kept)."""
    s.nxt = int(np.argmax(logits)) if s.greedy else sample(logits, s.sampling, at, s.ids, s.out)
    if s.n_top is not None:
        s.nxt_lp = TokenLogprob.of(logits, s.nxt, s.n_top)


def _take(s: Seq) -> None:
    """Record s.nxt as generated, or end the sequence (as generate.generate does)."""
    if s.nxt in s.eog:
        s.stats.stop, s.done = "eog", True
        return
    if len(s.out) >= s.max_tokens:
        s.done = True
        return
    s.out.append(s.nxt)
    s.stats.n_generated += 1
    if s.logprobs is not None:
        s.logprobs.append(s.nxt_lp)
    s.pieces.append(s.text.push(s.nxt))
    if s.text.stopped:
        s.done = True                   # stats.stop "stop" at the end, with finish()'s case
    elif len(s.out) >= s.max_tokens:
        s.done = True
    elif s.stats.n_written >= s.n_ctx:
        s.stats.stop, s.done = "context", True
