"""Choosing the next token from the logits: greedy, or a seeded draw after the usual
transforms. The NumPy reference of the semantics every backend follows.

The order of the transforms, vLLM's (the OpenAI-compatible servers' convention):

    1. penalties: repetition over the last REPEAT_LAST_N tokens, prompt included
       (llama.cpp's: a positive logit divided by it, a negative one multiplied);
       frequency (minus count x penalty) and presence (minus the penalty once) over
       the generated tokens (OpenAI's and vLLM's)
    2. temperature 0: the argmax (the first index of the maximum): exactly the greedy
       streams; otherwise the logits divided by the temperature
    3. top-k (the k largest), top-p (the smallest set whose probability reaches p,
       the largest first), min-p (probability at least min_p times the largest's),
       each applied to what the step before left, on the tempered probabilities
    4. a draw by inverse CDF of one uniform number keyed by (seed, position)

The uniform number comes from a counter-based generator: SplitMix64 of the seed,
then of that plus the position, its top 53 bits over 2^53. A request's draw at
position p depends on its seed and p alone, never on other requests in a batch or
on how the prompt was split, and a device kernel can compute the same number.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import MinferError

_MASK = (1 << 64) - 1
REPEAT_LAST_N = 64                  # llama.cpp's --repeat-last-n default


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0        # 0: greedy
    top_k: int = 0                  # 0: off
    top_p: float = 1.0              # 1: off
    min_p: float = 0.0              # 0: off
    repeat_penalty: float = 1.0     # 1: off (llama.cpp's --repeat-penalty)
    frequency_penalty: float = 0.0  # OpenAI's
    presence_penalty: float = 0.0   # OpenAI's
    seed: int = 0

    def __post_init__(self):
        checks = (("temperature", self.temperature >= 0, "at least 0"),
                  ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "a whole number, 0 (off) or more"),
                  ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
                  ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
                  ("repeat_penalty", self.repeat_penalty > 0, "above 0"),
                  ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
                  ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
                  ("seed", isinstance(self.seed, int) and 0 <= self.seed <= _MASK, "a whole number in [0, 2^64)"))
        for name, ok, want in checks:
            value = getattr(self, name)
            if not ok or (isinstance(value, float) and not np.isfinite(value)):
                raise MinferError(f"sampling: {name}={value!r} must be {want}")

    @property
    def greedy(self) -> bool:
        """The argmax of the unchanged logits: temperature 0 and no penalty."""
        return (self.temperature == 0 and self.repeat_penalty == 1
                and self.frequency_penalty == 0 and self.presence_penalty == 0)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def uniform(seed: int, pos: int) -> float:
    """The uniform number in [0, 1) of a draw at position pos under seed."""
    return (_splitmix64((_splitmix64(seed) + pos) & _MASK) >> 11) * 2.0 ** -53


def penalized(logits: np.ndarray, params: SamplingParams, context=(), generated=()) -> np.ndarray:
    """logits (vocab,) f32 with step 1's penalties: repetition on the last
    REPEAT_LAST_N tokens of context + generated, frequency and presence on generated."""
    out = np.array(logits, np.float32)
    if params.repeat_penalty != 1:
        recent = np.unique(np.asarray((list(context) + list(generated))[-REPEAT_LAST_N:], np.int64))
        x, rp = out[recent], np.float32(params.repeat_penalty)
        out[recent] = np.where(x > 0, x / rp, x * rp)
    if (params.frequency_penalty or params.presence_penalty) and len(generated):
        ids, counts = np.unique(np.asarray(generated, np.int64), return_counts=True)
        out[ids] -= (np.float32(params.frequency_penalty) * counts.astype(np.float32)
                     + np.float32(params.presence_penalty))
    return out


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a draw is made from (steps 2-3, temperature > 0): float64 (vocab,),
    zero outside what top-k, top-p and min-p keep, summing to 1."""
    z = np.asarray(logits, np.float64) / params.temperature
    keep = np.ones(z.shape, bool)
    if 0 < params.top_k < z.size:                   # the k largest; of equal ones, the first by index
        kth = np.partition(z, -params.top_k)[-params.top_k]
        keep = z > kth
        keep[np.flatnonzero(z == kth)[:params.top_k - int(keep.sum())]] = True
    p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    p /= p.sum()
    if params.top_p < 1:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]              # mass of the larger ones
        p[order[before >= params.top_p]] = 0.0
        p /= p.sum()
    if params.min_p > 0:
        p[p < params.min_p * p.max()] = 0.0
        p /= p.sum()
    return p


def sample(logits: np.ndarray, params: SamplingParams, pos: int, context=(), generated=()) -> int:
    """The next token from logits (vocab,), to sit at position pos, after the prompt
    (context) and the tokens generated so far."""
    z = penalized(logits, params, context, generated) if not params.greedy else logits
    if params.temperature == 0:
        return int(np.argmax(z))
    p = probabilities(z, params)
    u = uniform(params.seed, pos)
    c = np.cumsum(p)
    i = int(np.searchsorted(c, u * c[-1], side="right"))    # lands on a kept token
    return min(i, int(np.flatnonzero(p)[-1]))                # (u * c[-1] < c[-1] but for rounding)
