"""Generation: prefill the prompt, then decode one token at a time, greedy (the argmax
taken on the backend) or drawn by minfer/sampling.py from the step's logits; the
rules that end a run (end-of-generation tokens, max_tokens, the context, stop
strings) and what a run reports per token (its logprobs)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from .errors import MinferError
from .logprobs import MAX_TOP_LOGPROBS, log_softmax, top_logprobs
from .sampling import SamplingParams, sample
from .text.stops import StopMatcher


def check_finite(logits: np.ndarray, where: str) -> None:
    """Stop on NaN/Inf logits (damaged weights) instead of taking the argmax of
    garbage: a host check of the logits the forward already returned (decode
    steps are checked on the backend, Transformer.decode_greedy)."""
    if not np.isfinite(logits).all():
        raise MinferError(f"the model produced non-finite logits (NaN or Inf) {where}; "
                          f"its weights may be damaged")


def checked_logprobs(n) -> int | None:
    """logprobs= as given: None (off) or a whole number of top entries in [0, 20]."""
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= MAX_TOP_LOGPROBS:
        raise MinferError(f"logprobs must be None (off) or a whole number in [0, {MAX_TOP_LOGPROBS}] "
                          f"(the top entries per token), got {n!r}")
    return int(n)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token and its log-probability under the model's raw distribution
    at that step (softmax of the logits, before penalties, temperature, top-k/p,
    min-p: minfer/logprobs.py), with the `top` most likely tokens of that step as
    (id, logprob) pairs, the highest first (OpenAI's top_logprobs; empty for
    logprobs=0). A sampled token need not be among them."""
    id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of(cls, logits: np.ndarray, token: int, n: int) -> "TokenLogprob":
        """token's entry from the logits (vocab,) it was chosen from, with the top n."""
        lp = float(log_softmax(logits)[token])
        if not n:
            return cls(int(token), lp)
        ids, vals = top_logprobs(logits, n)
        return cls(int(token), lp, tuple(zip(ids.tolist(), vals.tolist())))

    def to_dict(self) -> dict:
        return {"id": self.id, "logprob": self.logprob, "top": [list(t) for t in self.top]}


class TextOut:
    """A run's text as it is produced: each token decoded (UTF-8 sequences split
    across tokens held back until whole), then held back by the stop strings
    (minfer/text/stops.py: a tail that may still become one waits until decided).
    The one-prompt loop and the batched one both use it, so they stream and stop
    alike."""

    def __init__(self, tokenizer, stop=None):
        self._dec = tokenizer.stream_decoder()
        self._stops = StopMatcher(stop)

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    @property
    def matched(self) -> str | None:
        return self._stops.matched

    def push(self, token: int) -> str:
        """The text safe to emit after one more token ("" once stopped)."""
        piece = self._dec.push(token)
        return self._stops.push(piece) if piece else ""

    def finish(self) -> str:
        """At the end of the run: what is still held back (cut before a stop string
        it completes)."""
        rest = self._dec.flush()
        out = self._stops.push(rest) if rest else ""
        return out + self._stops.flush()


@dataclass
class GenerationStats:
    n_prompt: int = 0
    n_cached: int = 0           # prompt tokens whose K/V came from the prefix cache (not prefilled)
    n_generated: int = 0        # tokens produced (an end-of-generation token is not counted)
    prompt_s: float = 0.0       # prefill wall time
    decode_s: float = 0.0       # wall time of the decode steps after the first token
    stop: str = ""              # "eog" | "max_tokens" | "context" | "stop"
    n_written: int = 0          # positions whose K/V the run wrote or found: prompt + decoded inputs
    # the stop string that ended the text (stop == "stop"), else None. Kept here beside
    # `stop`: the two say together why the run ended, and the decode loop reports
    # through its stats alone
    stop_string: str | None = None

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
    # the generated tokens: an end-of-generation token is not included; after a stop
    # string, every token up to and including the one whose text decided the stop
    # (llama.cpp's server keeps them too; OpenAI returns text alone), so ids decode to
    # more than .text: to the text, the stop string and what followed it in that token
    ids: list[int]
    text: str                   # exactly the text streamed: the ids decoded, UTF-8 completed,
                                # cut before a stop string
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None      # one per id when asked for (logprobs=), else None

    @property
    def stop(self) -> str:
        """Why generation ended: "eog" (an end-of-generation token), "max_tokens"
        (as many as asked for), "context" (the context is full) or "stop" (a stop
        string: .stop_string)."""
        return self.stats.stop

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, None if none did."""
        return self.stats.stop_string

    def to_dict(self) -> dict:
        s = self.stats
        return {"prompt_ids": self.prompt_ids, "ids": self.ids, "text": self.text, "stop": s.stop,
                "stop_string": s.stop_string,
                "logprobs": None if self.logprobs is None else [t.to_dict() for t in self.logprobs],
                "n_prompt": s.n_prompt, "n_cached": s.n_cached, "n_generated": s.n_generated,
                "prompt_s": s.prompt_s, "decode_s": s.decode_s,
                "prompt_tps": s.prompt_tps, "decode_tps": s.decode_tps}


def generate(engine, prompt_ids, n_predict: int, ignore_eos: bool = False,
             on_text: Callable[[str], None] | None = None,
             stats: GenerationStats | None = None, cache=None,
             sampling: SamplingParams | None = None, start: int = 0, stop=None,
             logprobs: int | None = None,
             on_logprob: Callable[[TokenLogprob], None] | None = None) -> Iterator[int]:
    """Yield up to n_predict tokens after prompt_ids: greedy, or drawn as `sampling`
    says (None or a greedy SamplingParams: the argmax).

    start: positions 0..start-1 of the prompt already hold their K/V in cache (a
    prefix cache hit): only the rest is prefilled; start < len(prompt_ids).

    Stops early on any of the tokenizer's end-of-generation ids (unless
    ignore_eos), when the context is full, or once the text holds one of the `stop`
    strings (stats.stop "stop", stats.stop_string which; the token that decided it
    is the last one yielded). on_text receives the decoded text piece by piece
    (UTF-8 sequences split across tokens, and a tail that may be the start of a stop
    string, are held back until decided), never the stop string or what follows it.
    logprobs (None: off): on_logprob receives each yielded token's TokenLogprob with
    the top `logprobs` entries of its step.
    A step that samples, or reports logprobs, reads the step's logits back to the
    host (the greedy step without logprobs takes its argmax on the backend and reads
    back the id alone).
    """
    prompt = np.asarray(prompt_ids, dtype=np.int32)
    if prompt.size == 0:
        raise MinferError("empty prompt: give at least one token")
    if n_predict < 0:
        raise MinferError(f"number of tokens to predict must be >= 0, got {n_predict}")
    logprobs = checked_logprobs(logprobs)
    text = TextOut(engine.tokenizer, stop)          # checks the stop strings
    stats = stats if stats is not None else GenerationStats()
    stats.n_prompt = int(prompt.size)
    if not 0 <= start < prompt.size:
        raise ValueError(f"generate: start {start} for a prompt of {prompt.size} tokens")
    stats.n_cached = stats.n_written = int(start)
    model, tok = engine.model, engine.tokenizer
    cache = cache if cache is not None else engine.new_cache()
    eog = set() if ignore_eos else set(tok.eog_ids)

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
    on_device = greedy and logprobs is None     # the argmax on the backend, no logits read back
    out: list[int] = []

    def choose(logits, at: int) -> int:
        # greedy on the host: the first maximum, as the backend's argmax takes it
        return int(np.argmax(logits)) if greedy else sample(logits, sampling, at, prompt, out)

    nxt = choose(logits, pos)
    for i in range(n_predict):
        if nxt in eog:
            stats.stop = "eog"
            break
        stats.n_generated += 1
        out.append(nxt)
        if logprobs is not None and on_logprob is not None:
            on_logprob(TokenLogprob.of(logits, nxt, logprobs))      # logits: the row nxt came from
        piece = text.push(nxt)
        if piece and on_text is not None:
            on_text(piece)
        yield nxt
        if text.stopped:
            break                               # before nxt is decoded: n_written stays right
        if i == n_predict - 1:
            break
        if pos >= cache.n_ctx:
            stats.stop = "context"
            break
        if i == 0:
            t1 = time.perf_counter()                            # decode timing starts here
        if on_device:
            nxt = model.decode_greedy(nxt, pos, cache)          # the argmax is taken on the backend
        else:
            logits = model.decode(nxt, pos, cache)              # (vocab,)
            check_finite(logits, f"at position {pos}")
            nxt = choose(logits, pos + 1)
        pos += 1
        stats.n_written = pos
    stats.decode_s = time.perf_counter() - t1
    rest = text.finish()
    if rest and on_text is not None:
        on_text(rest)
    if text.stopped:
        # also when the run ended otherwise with a stop string in the text that was
        # waiting on an earlier candidate: the text is cut at a stop string either way
        stats.stop, stats.stop_string = "stop", text.matched


def complete(engine, prompt_ids, max_tokens: int, ignore_eos: bool = False,
             on_text: Callable[[str], None] | None = None, cache=None,
             sampling: SamplingParams | None = None, start: int = 0, stop=None,
             logprobs: int | None = None) -> Generation:
    """Run `generate` to its end -> Generation (ids, text, stop reason, timings, and
    the logprobs when asked for). on_text still receives the text piece by piece as
    it is produced."""
    pieces: list[str] = []

    def take(piece: str) -> None:
        pieces.append(piece)
        if on_text is not None:
            on_text(piece)

    stats = GenerationStats()
    lps: list[TokenLogprob] | None = None if logprobs is None else []
    ids = [int(i) for i in generate(engine, prompt_ids, max_tokens, ignore_eos=ignore_eos,
                                    on_text=take, stats=stats, cache=cache, sampling=sampling,
                                    start=start, stop=stop, logprobs=logprobs,
                                    on_logprob=None if lps is None else lps.append)]
    return Generation(prompt_ids=[int(i) for i in np.asarray(prompt_ids).reshape(-1)], ids=ids,
                      text="".join(pieces), stats=stats, logprobs=lps)
