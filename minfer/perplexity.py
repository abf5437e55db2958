"""Perplexity by llama.cpp's method (its `llama-perplexity`, default mode).

Tokenize the whole text (special tokens not parsed; BOS only if the model adds
one), cut it into len(tokens) // n_ctx chunks of n_ctx tokens, evaluate each
chunk from an empty cache (with BOS as its first token if the model adds one),
and average the negative log-likelihood of token j+1 given the logits at j for
j in [n_ctx/2, n_ctx - 1): the first half of each chunk is context only.
PPL = exp(mean NLL); the +/- is llama.cpp's: ppl * sqrt(var(NLL) / (count - 1)).

Chunks go through the model in groups, as llama-perplexity's -b puts
n_seq = b / n_ctx chunks into one batch: a group is one forward_batch, each chunk
a sequence from position 0 over its own blocks of a paged cache, the LM head on
its scored half only. The figures are summed chunk by chunk in chunk order, so a
group changes them only by the rounding of products over more rows. A group of
one chunk is today's forward on a contiguous cache (on the CUDA backend it
replays the layers' captured graph from the third chunk on, which forward_batch
does not capture).
"""
from __future__ import annotations

import math
import time
import numbers
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
from .errors import MinferError
from .generate import check_finite
from .kv.batch import Batch, Span
from .kv.paged import PagedCache
from .progress import bar

DEFAULT_BATCH = 2048    # llama.cpp's -b default: 4 chunks of 512 per forward


@dataclass
class PerplexityResult:
    ppl: float
    err: float
    n_chunks: int
    count: int                                     # scored tokens
    running: list[float] = field(default_factory=list)   # PPL after each chunk
    forward_s: float = 0.0                         # wall time of the forwards (logits on the host), load
                                                   # and scoring excluded
    chunks_per_forward: int = 1

    @property
    def forward_tps(self) -> float | None:
        """Tokens evaluated per second of forwards (n_chunks * n_ctx tokens)."""
        return self.n_chunks * self.n_ctx / self.forward_s if self.forward_s > 0 else None

    n_ctx: int = 0


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """logits (n, vocab), targets int (n,) -> -log softmax(logits)[target] (n,) in float64"""
    l64 = logits.astype(np.float64)
    m = l64.max(axis=-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(l64 - m).sum(axis=-1))
    return lse - l64[np.arange(len(targets)), targets]


def _check_context(n_ctx: int) -> None:
    if n_ctx < 4:
        raise MinferError(f"perplexity context must be at least 4 tokens, got {n_ctx}")


def chunks_per_forward(n_ctx: int, batch_size: int | None = None) -> int:
    """How many chunks of n_ctx one forward evaluates (llama-perplexity's n_seq).

    batch_size None: llama.cpp's default -b 2048 as llama-perplexity uses it, which
    rounds it down to whole chunks (n_batch = min(n_batch, n_seq * n_ctx)), at least
    one. A batch size given must be whole chunks: a positive multiple of n_ctx (where
    llama.cpp would round it down, or split a chunk over several batches below
    n_ctx, which here would only change the memory used, not the figures).
    Needs no model, so the CLI checks it before the model opens."""
    _check_context(n_ctx)
    if batch_size is None:
        return max(1, DEFAULT_BATCH // n_ctx)
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise MinferError(f"the batch size must be a positive number of tokens, got {batch_size!r}")
    if batch_size % n_ctx:
        k = batch_size // n_ctx
        near = f"{k * n_ctx} or {(k + 1) * n_ctx}" if k else f"{n_ctx} (one chunk at a time)"
        raise MinferError(f"batch size {batch_size} is not a multiple of the context {n_ctx}: a forward "
                          f"evaluates whole chunks (try -b {near})")
    return int(batch_size // n_ctx)


def perplexity_tokens(tok, text: str, n_ctx: int) -> np.ndarray:
    """The text's tokens, checked to fill at least two chunks of n_ctx -> int32 (n,).
    Needs only the tokenizer, so the CLI checks before it loads the weights."""
    _check_context(n_ctx)
    tokens = np.asarray(tok.encode(text, parse_special=False), dtype=np.int32)
    if len(tokens) < 2 * n_ctx:       # llama.cpp's requirement too
        raise MinferError(f"the text has {len(tokens)} tokens; perplexity at context {n_ctx} "
                          f"needs at least {2 * n_ctx}")
    return tokens


def _one_at_a_time(engine, chunks: np.ndarray, first: int) -> Iterator[np.ndarray]:
    """chunks (n, n_ctx) -> each chunk's logits from position first (n_ctx - first, vocab),
    one forward per chunk on one contiguous cache. From position 0 every cached entry
    a chunk reads is rewritten first, so reusing the cache is the same as starting
    from an empty one."""
    cache = engine.new_cache(chunks.shape[1])
    for chunk in chunks:
        yield engine.model.forward(chunk, 0, cache, logits_from=first)


def _grouped(engine, chunks: np.ndarray, per: int, first: int) -> Iterator[np.ndarray]:
    """The same logits, per chunks at a time in one forward_batch each: every chunk a
    sequence at position 0 with its own blocks. The blocks are handed out once and
    every group reuses them: a group writes all of its sequences' positions before
    attention reads them, as one chunk does its contiguous cache."""
    n, n_ctx = chunks.shape
    nb = PagedCache.blocks_for(n_ctx)
    kv = PagedCache(engine.backend, per * nb + 1)                  # + the pad block
    tables = [tuple(kv.pool.allocate(nb)) for _ in range(per)]
    for g in range(0, n, per):
        group = chunks[g:g + per]                                   # (k, n_ctx)
        batch = Batch([Span(0, n_ctx, t) for t in tables[:len(group)]], logits_from=first)
        logits = engine.model.forward_batch(group.reshape(-1), batch, kv.storage)   # (k * (n_ctx - first), vocab)
        yield from logits.reshape(len(group), n_ctx - first, -1)


def perplexity(engine, text: str, n_ctx: int = 512, progress: bool = True,
               on_chunk: Callable[[int, float], None] | None = None,
               tokens: np.ndarray | None = None, max_chunks: int | None = None,
               batch_size: int | None = None) -> PerplexityResult:
    """tokens: perplexity_tokens(engine.tokenizer, text, n_ctx) if already computed.
    max_chunks: evaluate only the first max_chunks chunks (llama-perplexity's --chunks).
    batch_size: tokens per forward, whole chunks (llama-perplexity's -b; see
    chunks_per_forward: None is its default 2048, n_ctx is one chunk at a time)."""
    tok = engine.tokenizer
    per = chunks_per_forward(n_ctx, batch_size)
    if n_ctx > engine.n_ctx:
        raise MinferError(f"perplexity context {n_ctx} exceeds the engine's context {engine.n_ctx}")
    if tokens is None:
        tokens = perplexity_tokens(tok, text, n_ctx)
    if max_chunks is not None and max_chunks < 1:
        raise MinferError(f"the number of chunks must be at least 1, got {max_chunks}")
    n_chunks = len(tokens) // n_ctx
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    first = n_ctx // 2
    chunks = tokens[:n_chunks * n_ctx].reshape(n_chunks, n_ctx).copy()     # (n_chunks, n_ctx)
    if tok.add_bos:             # llama.cpp puts BOS first in every chunk
        chunks[:, 0] = tok.bos_id
    per = min(per, n_chunks)
    logits_of = _one_at_a_time(engine, chunks, first) if per == 1 else _grouped(engine, chunks, per, first)
    nll_sum = nll2_sum = 0.0
    count = 0
    running: list[float] = []
    forward_s = 0.0
    with bar(total=n_chunks, enabled=progress, desc="perplexity", unit="chunk", leave=False) as pbar:
        for c, chunk in enumerate(chunks):
            t0 = time.perf_counter()
            logits = next(logits_of)                                        # (n_ctx - first, vocab)
            forward_s += time.perf_counter() - t0
            check_finite(logits, f"in chunk {c + 1}")
            nll = token_nll(logits[:-1], chunk[first + 1:])                 # (n_ctx - 1 - first,)
            nll_sum += float(nll.sum())
            nll2_sum += float(np.square(nll).sum())
            count += len(nll)
            running.append(math.exp(nll_sum / count))
            if on_chunk is not None:
                on_chunk(c + 1, running[-1])
            pbar.update(1)
    mean = nll_sum / count
    var = nll2_sum / count - mean * mean
    ppl = math.exp(mean)
    err = ppl * math.sqrt(var / (count - 1)) if var > 0 else 0.0
    return PerplexityResult(ppl=ppl, err=err, n_chunks=n_chunks, count=count, running=running,
                            forward_s=forward_s, chunks_per_forward=per, n_ctx=n_ctx)
