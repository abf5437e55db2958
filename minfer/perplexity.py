"""Perplexity by llama.cpp's method (its `llama-perplexity`, default mode).

Tokenize the whole text (special tokens not parsed; BOS only if the model adds
one), cut it into len(tokens) // n_ctx chunks of n_ctx tokens, evaluate each
chunk from an empty cache (with BOS as its first token if the model adds one),
and average the negative log-likelihood of token j+1 given the logits at j for
j in [n_ctx/2, n_ctx - 1): the first half of each chunk is context only.
PPL = exp(mean NLL); the +/- is llama.cpp's: ppl * sqrt(var(NLL) / (count - 1)).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from .errors import MinferError
from .generate import check_finite
from .progress import bar


@dataclass
class PerplexityResult:
    ppl: float
    err: float
    n_chunks: int
    count: int                                     # scored tokens
    running: list[float] = field(default_factory=list)   # PPL after each chunk


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """logits (n, vocab), targets int (n,) -> -log softmax(logits)[target] (n,) in float64"""
    l64 = logits.astype(np.float64)
    m = l64.max(axis=-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(l64 - m).sum(axis=-1))
    return lse - l64[np.arange(len(targets)), targets]


def perplexity_tokens(tok, text: str, n_ctx: int) -> np.ndarray:
    """The text's tokens, checked to fill at least two chunks of n_ctx -> int32 (n,).
    Needs only the tokenizer, so the CLI checks before it loads the weights."""
    if n_ctx < 4:
        raise MinferError(f"perplexity context must be at least 4 tokens, got {n_ctx}")
    tokens = np.asarray(tok.encode(text, parse_special=False), dtype=np.int32)
    if len(tokens) < 2 * n_ctx:       # llama.cpp's requirement too
        raise MinferError(f"the text has {len(tokens)} tokens; perplexity at context {n_ctx} "
                          f"needs at least {2 * n_ctx}")
    return tokens


def perplexity(engine, text: str, n_ctx: int = 512, progress: bool = True,
               on_chunk: Callable[[int, float], None] | None = None,
               tokens: np.ndarray | None = None, max_chunks: int | None = None) -> PerplexityResult:
    """tokens: perplexity_tokens(engine.tokenizer, text, n_ctx) if already computed.
    max_chunks: evaluate only the first max_chunks chunks (llama-perplexity's --chunks)."""
    tok = engine.tokenizer
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
    cache = engine.new_cache(n_ctx)
    nll_sum = nll2_sum = 0.0
    count = 0
    running: list[float] = []
    for c in bar(range(n_chunks), enabled=progress, desc="perplexity", unit="chunk", leave=False):
        chunk = tokens[c * n_ctx:(c + 1) * n_ctx].copy()                     # (n_ctx,)
        if tok.add_bos:             # llama.cpp puts BOS first in every chunk
            chunk[0] = tok.bos_id
        # from position 0 every cached entry this chunk reads is rewritten first,
        # so reusing the cache is the same as starting from an empty one
        logits = engine.model.forward(chunk, 0, cache, logits_from=first)   # (n_ctx - first, vocab)
        check_finite(logits, f"in chunk {c + 1}")
        nll = token_nll(logits[:-1], chunk[first + 1:])                     # (n_ctx - 1 - first,)
        nll_sum += float(nll.sum())
        nll2_sum += float(np.square(nll).sum())
        count += len(nll)
        running.append(math.exp(nll_sum / count))
        if on_chunk is not None:
            on_chunk(c + 1, running[-1])
    mean = nll_sum / count
    var = nll2_sum / count - mean * mean
    ppl = math.exp(mean)
    err = ppl * math.sqrt(var / (count - 1)) if var > 0 else 0.0
    return PerplexityResult(ppl=ppl, err=err, n_chunks=n_chunks, count=count, running=running)
