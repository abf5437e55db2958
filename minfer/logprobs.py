"""Log-probabilities of tokens from logits: the NumPy reference of the semantics.

These are the model's own distribution, softmax of the raw logits, BEFORE any
sampling transform (penalties, temperature, top-k, top-p, min-p: minfer/sampling.py):
what vLLM returns by default ("raw logprobs") and what perplexity scores.

Arithmetic: float64 throughout, max-subtracted, then rounded once to float32.
log p_i = (x_i - m) - log1p(sum of exp(x_j - m) over every j but the first
maximum), so the most likely token's log-probability stays accurate when it is
near 0 (1 + 1e-14 would lose most of the 1e-14), and logits of +-1e4 neither
overflow nor underflow into -inf.

Non-finite logits are reported, not hidden and not an error: a row with a NaN or
a +inf, or with nothing but -inf, has no distribution and gives NaN throughout; a
-inf logit in an otherwise finite row (a masked token) gives -inf.
"""
from __future__ import annotations

import numpy as np

from .errors import MinferError

MAX_TOP_LOGPROBS = 20           # OpenAI's top_logprobs maximum


def _logits(logits, name: str, ndims: tuple[int, ...]) -> np.ndarray:
    try:
        x = np.asarray(logits, dtype=np.float64)
    except (TypeError, ValueError):
        raise MinferError(f"logprobs: {name} must be an array of numbers") from None
    if x.ndim not in ndims or x.shape[-1] == 0:
        want = " or ".join({1: "(vocab,)", 2: "(n, vocab)"}[d] for d in ndims)
        raise MinferError(f"logprobs: {name} must have the shape {want} with vocab > 0, got {x.shape}")
    return x


def _ids(ids, n: int, vocab: int) -> np.ndarray:
    a = np.asarray(ids)
    if a.shape != (n,) or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise MinferError(f"logprobs: ids must be {n} token ids (one per row), got shape {a.shape} "
                          f"of {a.dtype}")
    a = a.astype(np.int64)
    bad = (a < 0) | (a >= vocab)
    if bad.any():
        raise MinferError(f"logprobs: token id {int(a[bad][0])} is outside the vocabulary [0, {vocab})")
    return a


def _log_softmax64(x: np.ndarray) -> np.ndarray:
    """x (..., vocab) float64 -> log-softmax over the last axis, float64."""
    with np.errstate(all="ignore"):
        m = x.max(axis=-1, keepdims=True)                        # NaN if any NaN
        d = x - m
        e = np.exp(d)
        np.put_along_axis(e, np.argmax(x, axis=-1)[..., None], 0.0, axis=-1)
        out = d - np.log1p(e.sum(axis=-1, keepdims=True))
    out[np.broadcast_to(~np.isfinite(m), out.shape)] = np.nan   # no distribution
    return out


def log_softmax(logits) -> np.ndarray:
    """logits (n, vocab) or (vocab,) -> float32 log-probabilities of the same shape."""
    return _log_softmax64(_logits(logits, "logits", (1, 2))).astype(np.float32)


def token_logprobs(logits, ids) -> np.ndarray:
    """logits (n, vocab), ids (n,) -> (n,) float32: the log-probability of ids[i]
    under row i."""
    x = _logits(logits, "logits", (2,))
    a = _ids(ids, x.shape[0], x.shape[1])
    lp = _log_softmax64(x)
    return lp[np.arange(a.size), a].astype(np.float32)


def top_logprobs(logits, n: int) -> tuple[np.ndarray, np.ndarray]:
    """logits (rows, vocab) -> the n most likely tokens of each row: ids (rows, n)
    int32 and their log-probabilities (rows, n) float32, the highest first; of equal
    ones the lower token id first. n is clipped to vocab; n=0 gives (rows, 0).
    A (vocab,) row gives (n,) and (n,). NaN log-probabilities sort last."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= MAX_TOP_LOGPROBS:
        raise MinferError(f"logprobs: top_logprobs={n!r} must be a whole number in [0, {MAX_TOP_LOGPROBS}]")
    x = _logits(logits, "logits", (1, 2))
    lp = _log_softmax64(x.reshape(-1, x.shape[-1]))
    k = min(int(n), lp.shape[1])
    ids = np.empty((lp.shape[0], k), np.int64)
    if k:
        key = np.where(np.isnan(lp), np.inf, -lp)               # ascending key: most likely first
        kth = np.partition(key, k - 1, axis=1)[:, k - 1]
        for r in range(lp.shape[0]):
            cand = np.flatnonzero(key[r] <= kth[r])              # ascending ids: the stable sort
            ids[r] = cand[np.argsort(key[r, cand], kind="stable")[:k]]   # keeps ties by id
    vals = np.take_along_axis(lp, ids, axis=1).astype(np.float32)
    shape = x.shape[:-1] + (k,)
    return ids.astype(np.int32).reshape(shape), vals.reshape(shape)


def prompt_logprobs(logits_all, ids) -> np.ndarray:
    """logits after every position of a prompt (T, vocab), the prompt's ids (T,)
    -> (T,) float32: entry t the log-probability of ids[t] under row t-1; entry 0 is
    NaN, the first token having no prediction (vLLM's prompt_logprobs and OpenAI's
    echo + logprobs give it as null). Row T-1, the prediction after the prompt, is
    not used."""
    x = _logits(logits_all, "logits_all", (2,))
    a = _ids(ids, x.shape[0], x.shape[1])
    out = np.full(a.size, np.nan, np.float32)
    if a.size > 1:
        lp = _log_softmax64(x[:-1])
        out[1:] = lp[np.arange(a.size - 1), a[1:]]
    return out
