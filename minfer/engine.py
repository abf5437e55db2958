"""One loaded model: file, config, tokenizer, backend, weights and graph, built in order
(docs/DESIGN.md, data flow), and the calls a Python user makes on it (Engine).
The CLI, tests and benchmarks all start here."""
from __future__ import annotations

import contextlib
import numbers
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .backend import get_backend
from .backend.base import Backend
from .config import ModelConfig
from .errors import MinferError
from .batched import generate_many
from .generate import Generation, checked_logprobs, complete
from .graph.transformer import Transformer
from .graph.weights import Weights, load_weights
from .kv.paged import PagedCache
from .logprobs import prompt_logprobs
from .sampling import SamplingParams
from .text.prompt import chat_ids, check_fits, prompt_ids, render_chat
from .text.stops import StopMatcher

DEFAULT_MAX_CTX = 4096      # default context: the model's training context, capped here
KV_CONTEXTS = 2             # the paged cache holds this many contexts by default: a conversation
                            # kept for its next turn beside a new prompt
MAX_CTX = 2**31 - 1         # positions are int32 on the device; memory bounds it far sooner


@dataclass
class ModelFile:
    """The parts of a model that need no weights: enough to tokenize and to check a
    prompt before paying for the weight load."""
    gf: Any                 # minfer.format.gguf.GGUFFile
    cfg: ModelConfig
    tokenizer: Any          # minfer.text.tokenizer.Tokenizer
    n_ctx: int

    @classmethod
    def open(cls, path, n_ctx: int | None = None) -> "ModelFile":
        """Map the file and check the model contract (minfer/contract.py) before the
        tokenizer is built or anything large is allocated."""
        from .contract import check_model
        from .format.gguf import open_gguf
        from .text.tokenizer import Tokenizer

        path = Path(path)
        if not path.exists():
            raise MinferError(f"{path}: no such model file")
        if not path.is_file():
            raise MinferError(f"{path}: not a regular file")
        gf = open_gguf(str(path))
        try:
            cfg = ModelConfig.from_gguf(gf)
            check_model(gf, cfg)
            if n_ctx is None:
                n_ctx = min(cfg.n_ctx_train, DEFAULT_MAX_CTX)
            if isinstance(n_ctx, bool) or not isinstance(n_ctx, numbers.Integral) \
                    or not 1 <= n_ctx <= MAX_CTX:
                raise MinferError(f"context size must be between 1 and {MAX_CTX}, got {n_ctx!r}")
            return cls(gf=gf, cfg=cfg, tokenizer=Tokenizer.from_gguf(gf), n_ctx=int(n_ctx))
        except BaseException:
            gf.close()              # a rejected file keeps no mapping open
            raise


@dataclass
class ScoreResult:
    """What `Engine.score` returns for one input: its token ids, each token's
    log-probability given the tokens before it (raw: softmax of the logits,
    minfer/logprobs.py), and their sum."""
    ids: list[int]
    # one per id; the first is None, having no tokens before it (OpenAI's echo
    # convention: null), so logprobs[t] lines up with ids[t]
    logprobs: list[float | None]
    total: float                # the sum of logprobs[1:] (0.0 for one token): log P(ids[1:] | ids[0])

    def to_dict(self) -> dict:
        return {"ids": self.ids, "logprobs": self.logprobs, "total": self.total}


@dataclass(repr=False)
class Engine:
    """A loaded model, and the Python front door to it:

        from minfer import Engine
        with Engine.load("model.gguf") as engine:          # backend "auto": cuda if usable, else cpu
            out = engine.generate("def fibonacci(n):", max_tokens=64)
            print(out.text, out.stop, out.stats.decode_tps)

    generate / score / logits / tokenize / detokenize / apply_chat_template are the calls
    for users; the parts (.cfg .tokenizer .backend .weights .model, new_cache())
    stay public for the tests, the benchmarks and the scripts.
    """
    gf: Any                 # minfer.format.gguf.GGUFFile
    cfg: ModelConfig
    tokenizer: Any          # minfer.text.tokenizer.Tokenizer
    backend: Backend
    weights: Weights
    model: Transformer
    n_ctx: int              # default context of new_cache() and of the front door's calls
    kv_tokens: int | None = None    # positions of the front door's paged KV cache (None: KV_CONTEXTS contexts)
    _kv: Any = field(default=None, init=False)          # the front door's PagedCache, made once
    _view: Any = field(default=None, init=False)        # its sequence view: one sequence at a time
    _closed: bool = field(default=False, init=False)

    @classmethod
    def load(cls, path=None, backend: str = "auto", n_ctx: int | None = None,
             progress: bool = True, settings: dict | None = None, warmup: bool = True,
             kv_tokens: int | None = None, deterministic: bool = False) -> "Engine":
        """Open, check and load a GGUF model.

        path: the GGUF file (None: the default model, pulled if not cached).
        backend: "auto" (cuda when cupy and a device are usable, else cpu), "cpu" or "cuda".
        n_ctx: the context in tokens (default: min(training context, 4096)).
        progress: report on stderr: the backend "auto" chose (one line) and, on a
        terminal, a progress bar while the weights load.
        settings: CUDA backend settings by field name (minfer/backend/cuda/settings.py),
        over the environment's: for tests and benchmarks.
        warmup: run `warmup()` before returning (as `minfer generate` does), so the
        first call pays no one-time start-up of the backend.
        kv_tokens: positions of the paged KV cache that the calls share, and whose
        full blocks keep prefixes for later calls (default: KV_CONTEXTS contexts).
        deterministic: a generation's bytes do not depend on the other prompts of its
        call, on how its prompt was chunked, or on what the prefix cache held
        (Backend.deterministic; every prompt, one or many, runs through
        minfer/batched.py, whose decode rows then keep their blocks to themselves).
        """
        if path is None:
            from .pull import ensure_model
            path = ensure_model(progress=progress)
        if kv_tokens is not None and (isinstance(kv_tokens, bool) or not isinstance(kv_tokens, numbers.Integral)
                                      or kv_tokens < 1):
            raise MinferError(f"kv_tokens must be a positive number of positions, got {kv_tokens!r}")
        if not isinstance(deterministic, bool):
            raise MinferError(f"deterministic is True or False, got {deterministic!r}")
        engine = cls.from_file(ModelFile.open(path, n_ctx), backend, progress, settings)
        engine.kv_tokens = kv_tokens
        engine.backend.set_deterministic(deterministic)
        if warmup:
            engine.warmup()
        return engine

    @classmethod
    def from_file(cls, mf: ModelFile, backend: str = "auto", progress: bool = True,
                  settings: dict | None = None) -> "Engine":
        be = get_backend(backend, mf.cfg, announce=progress, settings=settings)
        with be.guard("loading the weights"):
            weights = load_weights(mf.gf, mf.cfg, be, progress=progress)
        # Backends copy what they need at load, so the mapping can go: a file
        # truncated or replaced underneath cannot fault a later step (SIGBUS).
        # gf keeps its metadata and tensor table; gf.raw() now raises.
        if not mf.gf.close():
            raise RuntimeError(f"the {be.name} backend kept a view of the mapped model file "
                               f"after load; it must copy what it needs")
        return cls(gf=mf.gf, cfg=mf.cfg, tokenizer=mf.tokenizer, backend=be, weights=weights,
                   model=Transformer(mf.cfg, be, weights), n_ctx=mf.n_ctx)

    def warmup(self) -> float:
        """Short prefills (the backend's warmup_lengths) on throwaway caches and a
        one-token generation of three tokens through the front door (its prefill and
        two greedy decode steps on the front door's cache view), as llama.cpp's warm-up run:
        what a backend does once per process on first use (the CUDA backend:
        cuBLASLt's handle and the GEMM kernels it preloads per weight shape, the
        kernel modules from CuPy's cache, the scratch buffers) and once per cache (the
        decode step's CUDA graph, captured on a cache's second step) happens here
        instead of inside the first prompt's timing. A one-token prompt fills no
        block, so nothing is left in the prefix cache.
        -> seconds it took. Launch counters are reset afterwards, so they count the
        caller's work only."""
        self._check_open()
        tok = next((t for t in (self.tokenizer.bos_id, self.tokenizer.eos_id) if t is not None), 0)
        t0 = time.perf_counter()
        lengths = [t for t in self.backend.warmup_lengths if t <= self.n_ctx] or [1]
        for T in lengths:
            self.model.forward(np.full(T, tok, np.int32), 0, self.backend.new_cache(T + 1))
        # as a call makes them: the first decode step eager, the second captured
        self.generate([tok], max_tokens=min(3, self.n_ctx - 1) if self.n_ctx > 1 else 0, ignore_eos=True)
        self.backend.synchronize()
        self.backend.reset_counters()
        return time.perf_counter() - t0

    def new_cache(self, n_ctx: int | None = None):
        """An empty KV cache for n_ctx positions (default: the engine's context)."""
        self._check_open()
        return self.backend.new_cache(n_ctx or self.n_ctx)

    # --- the front door ---------------------------------------------------------------
    def tokenize(self, text: str, *, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """text -> token ids. add_bos None: the model's own rule; parse_special:
        special-token text such as <|im_start|> becomes its token."""
        if not isinstance(text, str):
            raise MinferError(f"tokenize takes text (str), got {type(text).__name__}")
        return self.tokenizer.encode(text, parse_special=parse_special, add_bos=add_bos)

    def detokenize(self, ids, *, special: bool = True) -> str:
        """token ids -> text; special=False leaves out control tokens (BOS, <|im_end|>)."""
        return self.tokenizer.decode(self._token_ids(ids, "ids", allow_empty=True).tolist(), special=special)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The model's chat template around messages [{"role": ..., "content": ...}]
        -> prompt text (with the model's BOS/EOS texts where the template puts them)."""
        return render_chat(self.tokenizer, messages, add_generation_prompt)

    def generate(self, prompt, max_tokens: int = 128, *, chat: bool = False, system: str | None = None,
                 ignore_eos: bool = False, on_text: Callable[[str], None] | None = None,
                 sampling: SamplingParams | None = None, stop: str | list[str] | None = None,
                 logprobs: int | None = None) -> Generation:
        """Generation -> Generation (.text, .ids, .prompt_ids, .stop, .stats timings):
        greedy, or drawn as `sampling` says (minfer.SamplingParams: temperature,
        top_k, top_p, min_p, penalties, seed; the same seed gives the same text).
        A list of prompts -> a list of Generations, in order: one forward prefills
        them all and each decode step advances all of them (minfer/batched.py).
        A prompt whose start an earlier call left in the KV cache prefills only the
        rest (stats.n_cached).

        prompt: text (tokenized with the model's BOS rule, special-token text parsed),
        token ids, or a list of chat messages. chat=True renders text as the user
        message of the chat template, after an optional `system` message.
        Stops after max_tokens, at an end-of-generation token (unless ignore_eos),
        when the context is full, or at the first occurrence of a `stop` string (a
        string or a list) in the generated text: .text ends before it (as OpenAI's
        API), .stop is "stop" and .stop_string says which; .ids keep every token up
        to and including the one whose text decided the stop (as llama.cpp's server;
        OpenAI returns text alone). on_text receives the text as it is produced,
        a tail that may be the start of a stop string held back until decided.

        logprobs: None (off: greedy steps read back the chosen id alone), 0 (each
        generated token's log-probability), or n in 1..20 (also the n most likely
        tokens of its step) -> .logprobs, a minfer.TokenLogprob per id: the raw
        distribution (softmax of the logits, before penalties and temperature). A
        greedy step with logprobs reads its logits back and takes the same argmax on
        the host (the first maximum).
        """
        self._check_open()
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise MinferError(f"sampling takes a minfer.SamplingParams, got {type(sampling).__name__}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral) or max_tokens < 0:
            raise MinferError(f"max_tokens must be a number >= 0, got {max_tokens!r}")
        stop = StopMatcher(stop).stops          # checked here: a bad one touches no cache
        logprobs = checked_logprobs(logprobs)
        if _is_batch(prompt):
            if on_text is not None:
                raise MinferError("on_text streams one prompt's text: give one prompt, or no on_text")
            if len(prompt) == 0:
                raise MinferError("empty prompt: give text, token ids, messages, or a list of prompts")
            ids = [self._prompt_ids(p, chat, system) for p in prompt]
            for i, p in enumerate(ids):
                check_fits(len(p), self.n_ctx, f"prompt {i} of the batch")
            return generate_many(self, ids, int(max_tokens), self._front_cache()[0], ignore_eos=ignore_eos,
                                 sampling=sampling, stop=stop, logprobs=logprobs)
        ids = self._prompt_ids(prompt, chat, system)
        check_fits(len(ids), self.n_ctx)
        if self.backend.deterministic:          # the rows of one prompt as of many (batched.py)
            return generate_many(self, [ids], int(max_tokens), self._front_cache()[0], ignore_eos=ignore_eos,
                                 sampling=sampling, stop=stop, logprobs=logprobs, on_text=on_text)[0]
        with self._sequence(ids, min(len(ids) + int(max_tokens) + 1, self.n_ctx)) as (view, seq):
            out = complete(self, ids, max_tokens, ignore_eos=ignore_eos, on_text=on_text,
                           cache=view, sampling=sampling, start=seq.n_cached, stop=stop, logprobs=logprobs)
            # the positions whose K/V this call wrote: its full blocks now keep the prefix
            # (a run ended by a stop string wrote all but its last token, as any other)
            written = [int(i) for i in ids] + out.ids
            seq.append(written[seq.n_cached:out.stats.n_written])
            return out

    def _prompt_ids(self, prompt, chat: bool, system: str | None) -> np.ndarray:
        """One prompt (text, token ids or chat messages) -> its token ids."""
        if isinstance(prompt, str):
            if system is not None and not chat:
                raise MinferError("a system message needs chat=True")
            return np.asarray(prompt_ids(self.tokenizer, prompt, chat=chat, system=system), np.int32)
        if _is_messages(prompt):
            if system is not None:
                raise MinferError("with a list of messages, give the system message as its first message")
            return np.asarray(chat_ids(self.tokenizer, list(prompt)), np.int32)
        if chat or system is not None:
            raise MinferError("chat=True needs text or a list of messages, not token ids")
        return self._token_ids(prompt, "prompt")

    def logits(self, ids) -> np.ndarray:
        """The logits after every position of ids (from position 0) -> float32
        (len(ids), vocab), as computed (not checked for NaN). Every position is
        computed (none is taken from the prefix cache); its full blocks are kept
        for later calls."""
        self._check_open()
        tokens = self._token_ids(ids, "ids")
        check_fits(len(tokens), self.n_ctx)
        with self._sequence(tokens, len(tokens), match=False) as (view, seq):
            out = self.model.forward(tokens, 0, view, logits_from=0)
            seq.append(tokens)
            return out

    def score(self, inputs) -> ScoreResult | list[ScoreResult]:
        """Each token's log-probability given the tokens before it (teacher forcing:
        Engine.logits of the whole input, then minfer.logprobs.prompt_logprobs) ->
        a ScoreResult (.ids, .logprobs with None first, .total); a list of inputs ->
        a list of ScoreResults, in order.

        An input is text (tokenized with the model's BOS rule, special-token text
        parsed, as generate does) or token ids; it must fit the context."""
        self._check_open()
        batch = _is_batch(inputs)
        if batch and len(inputs) == 0:
            raise MinferError("score: empty list: give text, token ids, or a list of them")
        seqs = []
        for i, x in enumerate(inputs if batch else [inputs]):
            what = f"input {i}" if batch else "input"
            if isinstance(x, str):
                if not x:
                    raise MinferError(f"score: {what} is empty text: nothing to score")
                ids = np.asarray(prompt_ids(self.tokenizer, x), np.int32)
            else:
                ids = self._token_ids(x, what)
            check_fits(len(ids), self.n_ctx, f"{what} of the list" if batch else "the input")
            seqs.append(ids)
        out = []
        for ids in seqs:                        # every input checked before any is computed
            lp = prompt_logprobs(self.logits(ids), ids)
            out.append(ScoreResult(ids=ids.tolist(), logprobs=[None] + lp[1:].tolist(),
                                   total=float(lp[1:].astype(np.float64).sum())))
        return out if batch else out[0]

    def reset_prefix_cache(self) -> None:
        """Forget every kept prefix (vLLM's reset_prefix_cache): the next call
        prefills its whole prompt."""
        self._check_open()
        self._front_cache()[0].pool.reset_prefix_cache()

    @property
    def kv_cache(self) -> PagedCache:
        """The paged KV cache every front-door call shares (made on first use): what a
        caller that runs its own minfer.batched.BatchRunner (the server) steps over."""
        self._check_open()
        return self._front_cache()[0]

    def kv_stats(self) -> dict:
        """The front door's paged KV cache: blocks (all, used, cached, free) and the
        prefix cache's tokens asked about and found (minfer.kv.blocks.BlockPool.stats)."""
        self._check_open()
        return self._front_cache()[0].stats()

    def close(self) -> None:
        """Drop the weights and caches and let the backend give back its memory;
        any later call raises. Also what leaving a `with` block does."""
        if self._closed:
            return
        self._closed = True
        self._kv = self._view = None
        self.weights = self.model = None
        self.backend.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ", closed" if self._closed else ""
        return f"Engine({self.gf.path!r}, backend={self.backend.name!r}, n_ctx={self.n_ctx}{state})"

    # --- helpers ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise MinferError("this engine is closed")

    @contextlib.contextmanager
    def _sequence(self, ids, n_total: int, match: bool = True):
        """One call's sequence in the front door's paged cache: its cached prefix matched
        (unless match=False), blocks reserved for n_total positions (all or nothing),
        the view pointed at them -> (view, SeqBlocks); its blocks released afterwards,
        also when the call fails (what the caller appended stays in the prefix cache)."""
        kv, view = self._front_cache()
        seq = kv.admit(ids, match=match)
        try:
            seq.reserve(n_total)
            kv.show(view, seq)
            yield view, seq
        finally:
            seq.free()

    def _front_cache(self):
        """(PagedCache, its view): made once for every front-door call, so that the
        calls share prefixes and a backend's graphs captured on the view stay valid
        (a call points the view at its sequence's blocks)."""
        if self._kv is None:
            n = self.kv_tokens if self.kv_tokens is not None else KV_CONTEXTS * self.n_ctx
            self._kv = PagedCache(self.backend, max(PagedCache.blocks_for(n), PagedCache.blocks_for(self.n_ctx)) + 1)
            self._view = self._kv.view(self.n_ctx)
        return self._kv, self._view

    def _token_ids(self, ids, what: str, allow_empty: bool = False) -> np.ndarray:
        """ids as int32 (n,), each a token of this model's vocabulary."""
        a = np.asarray(ids)
        if a.size == 0 and a.ndim == 1:
            if allow_empty:
                return a.astype(np.int32)
            raise MinferError(f"empty {what}: give at least one token id")
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise MinferError(f"{what} must be text or a flat sequence of integer token ids, "
                              f"got {type(ids).__name__} of {a.dtype} with shape {a.shape}")
        vocab = self.cfg.vocab_size
        bad = (a < 0) | (a >= vocab)
        if bad.any():
            i = int(np.argmax(bad))
            raise MinferError(f"{what}[{i}] = {int(a[i])} is not a token id of this model (0..{vocab - 1})")
        return a.astype(np.int32)


def _is_batch(x) -> bool:
    """A list of prompts (texts, token id lists or arrays, message lists), not one
    prompt of token ids or messages."""
    return isinstance(x, (list, tuple)) and (len(x) == 0 or all(
        isinstance(p, (str, np.ndarray)) or (isinstance(p, (list, tuple)) and not isinstance(p, str))
        for p in x))


def _is_messages(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(m, dict) for m in x)
