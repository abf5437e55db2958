"""Generation: prefill the prompt, then decode one token at a time, greedy (the argmax
taken on the backend) or drawn by minfer/sampling.py from the step's logits."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from .errors import MinferError
from .sampling import SamplingParams, sample


def check_finite(logits: np.ndarray, where: str) -> None:
    """Stop on NaN/Inf logits (damaged weights) instead of taking the argmax of
    garbage: a host check of the logits the forward already returned (decode
    steps are checked on the backend, Transformer.decode_greedy)."""
    if not np.isfinite(logits).all():
        raise MinferError(f"the model produced non-finite logits (NaN or Inf) {where}; "
                          f"its weights may be damaged")


@dataclass
class GenerationStats:
    n_prompt: int = 0
    n_cached: int = 0           # prompt tokens whose K/V came from the prefix cache (not prefilled)
    n_generated: int = 0        # tokens produced (an end-of-generation token is not counted)
    prompt_s: float = 0.0       # prefill wall time
    decode_s: float = 0.0       # wall time of the decode steps after the first token
    stop: str = ""              # "eog" | "max_tokens" | "context"
    n_written: int = 0          # positions whose K/V the run wrote or found: prompt + decoded inputs

    @property
    def prompt_tps(self) -> float | None:
        """Prompt tokens prefilled per second (those from the prefix cache are not
        counted); None if nothing was timed."""
        return (self.n_prompt - self.n_cached) / self.prompt_s if self.prompt_s > 0 else None

    @property
    def decode_tps(self) -> float | None:
        """Tokens per second of the decode steps (the first token comes from the
        prefill); None with fewer than two generated tokens: no step was timed."""
        n = self.n_generated - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else None


@dataclass
class Generation:
    """One generation: what `Engine.generate` returns and `minfer generate --json`
    prints."""
    prompt_ids: list[int]
    ids: list[int]              # the generated tokens (an end-of-generation token is not included)
    text: str                   # exactly the text streamed: the ids decoded, UTF-8 completed
    stats: GenerationStats

    @property
    def stop(self) -> str:
        """Why generation ended: "eog" (an end-of-generation token), "max_tokens"
        (as many as asked for) or "context" (the context is full)."""
        return self.stats.stop

    def to_dict(self) -> dict:
        s = self.stats
        return {"prompt_ids": self.prompt_ids, "ids": self.ids, "text": self.text, "stop": s.stop,
                "n_prompt": s.n_prompt, "n_cached": s.n_cached, "n_generated": s.n_generated,
                "prompt_s": s.prompt_s, "decode_s": s.decode_s,
                "prompt_tps": s.prompt_tps, "decode_tps": s.decode_tps}


def generate(engine, prompt_ids, n_predict: int, ignore_eos: bool = False,
             on_text: Callable[[str], None] | None = None,
             stats: GenerationStats | None = None, cache=None,
             sampling: SamplingParams | None = None, start: int = 0) -> Iterator[int]:
    """Yield up to n_predict tokens after prompt_ids: greedy, or drawn as `sampling`
    says (None or a greedy SamplingParams: the argmax).

    start: positions 0..start-1 of the prompt already hold their K/V in cache (a
    prefix cache hit): only the rest is prefilled; start < len(prompt_ids).

    Stops early on any of the tokenizer's end-of-generation ids (unless
    ignore_eos) or when the context is full. on_text receives the decoded text
    piece by piece (UTF-8 sequences split across tokens are held back until whole).
    A step that samples reads the step's logits back to the host (the greedy step
    takes its argmax on the backend and reads back the id alone).
    """
    prompt = np.asarray(prompt_ids, dtype=np.int32)
    if prompt.size == 0:
        raise MinferError("empty prompt: give at least one token")
    if n_predict < 0:
        raise MinferError(f"number of tokens to predict must be >= 0, got {n_predict}")
    stats = stats if stats is not None else GenerationStats()
    stats.n_prompt = int(prompt.size)
    if not 0 <= start < prompt.size:
        raise ValueError(f"generate: start {start} for a prompt of {prompt.size} tokens")
    stats.n_cached = stats.n_written = int(start)
    model, tok = engine.model, engine.tokenizer
    cache = cache if cache is not None else engine.new_cache()
    eog = set() if ignore_eos else set(tok.eog_ids)
    dec = tok.stream_decoder()

    t0 = time.perf_counter()
    logits = model.forward(prompt[start:], start, cache)[-1]    # (vocab,)
    stats.n_written = int(prompt.size)
    engine.backend.synchronize()
    stats.prompt_s = time.perf_counter() - t0
    check_finite(logits, f"at position {prompt.size - 1}")
    pos = int(prompt.size)
    stats.stop = "max_tokens"
    t1 = time.perf_counter()
    greedy = sampling is None or sampling.greedy
    out: list[int] = []

    def choose(logits, at: int) -> int:
        return int(np.argmax(logits)) if greedy else sample(logits, sampling, at, prompt, out)

    nxt = choose(logits, pos)
    for i in range(n_predict):
        if nxt in eog:
            stats.stop = "eog"
            break
        stats.n_generated += 1
        out.append(nxt)
        if on_text is not None:
            piece = dec.push(nxt)
            if piece:
                on_text(piece)
        yield nxt
        if i == n_predict - 1:
            break
        if pos >= cache.n_ctx:
            stats.stop = "context"
            break
        if i == 0:
            t1 = time.perf_counter()                            # decode timing starts here
        if greedy:
            nxt = model.decode_greedy(nxt, pos, cache)          # the argmax is taken on the backend
        else:
            logits = model.decode(nxt, pos, cache)              # (vocab,)
            check_finite(logits, f"at position {pos}")
            nxt = choose(logits, pos + 1)
        pos += 1
        stats.n_written = pos
    stats.decode_s = time.perf_counter() - t1
    if on_text is not None:
        rest = dec.flush()
        if rest:
            on_text(rest)


def complete(engine, prompt_ids, max_tokens: int, ignore_eos: bool = False,
             on_text: Callable[[str], None] | None = None, cache=None,
             sampling: SamplingParams | None = None, start: int = 0) -> Generation:
    """Run `generate` to its end -> Generation (ids, text, stop reason, timings).
    on_text still receives the text piece by piece as it is produced."""
    pieces: list[str] = []

    def take(piece: str) -> None:
        pieces.append(piece)
        if on_text is not None:
            on_text(piece)

    stats = GenerationStats()
    ids = [int(i) for i in generate(engine, prompt_ids, max_tokens, ignore_eos=ignore_eos,
                                    on_text=take, stats=stats, cache=cache, sampling=sampling,
                                    start=start)]
    return Generation(prompt_ids=[int(i) for i in np.asarray(prompt_ids).reshape(-1)], ids=ids,
                      text="".join(pieces), stats=stats)
