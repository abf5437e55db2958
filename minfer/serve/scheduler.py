"""The one thread that owns the engine: continuous batching.

Request handlers (on uvicorn's event loop) `submit` a Work and read its events from
an asyncio queue; nothing but this thread touches the engine, its KV cache or the
BatchRunner (minfer/batched.py). The loop:

    1. take the cancellations (a client gone: its sequence leaves the batch and its
       blocks go back to the pool at once) and the new requests
    2. admit waiting requests, oldest first, while fewer than `parallel` run and the
       pool has the blocks of their whole run (a request that waits keeps its place)
    3. one BatchRunner step: one forward over every running sequence's next token
       and chunks of the prompts still prefilling, under the step's token budget
    4. hand each advanced request its new text (and logprobs), and its result when
       it is done, through loop.call_soon_threadsafe

Admission is bounded: at most `max_queue` requests wait; one more is refused at
once with a 503 and Retry-After (the handler's answer), never queued without bound.
"""
from __future__ import annotations

import asyncio
import collections
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

from ..batched import BatchRunner, Seq
from ..errors import MinferError
from .errors import APIError

RETRY_AFTER_S = 1           # what a 503 tells the client to wait


@dataclass
class Work:
    """One request as the scheduler sees it."""
    ids: np.ndarray                     # the prompt's token ids (checked to fit)
    max_tokens: int
    sampling: object                    # minfer.SamplingParams
    stop: tuple
    logprobs: int | None
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrival: float = field(default_factory=time.perf_counter)
    seq: Seq | None = None
    # what has been handed to the request so far
    n_pieces: int = 0
    n_lps: int = 0
    n_out: int = 0
    t_last: float | None = None         # when its last token came

    def send(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:            # the event loop is closed: the server is gone
            pass


class Scheduler:
    def __init__(self, engine, kv, parallel: int, max_queue: int, token_budget: int, metrics):
        self.engine, self.kv, self.metrics = engine, kv, metrics
        self.parallel, self.max_queue = int(parallel), int(max_queue)
        self.runner = BatchRunner(engine, kv, token_budget)
        self._cond = threading.Condition()
        self._waiting: collections.deque[Work] = collections.deque()     # guarded by _cond
        self._cancels: list[Work] = []                                    # guarded by _cond
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="minfer-scheduler", daemon=True)
        self.n_running = 0              # read by the metrics (a gauge), written by the thread
        self.kv_used = 1

    # --- the handlers' side (event loop thread) ------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, w: Work) -> None:
        """Queue w, or APIError 503 (Retry-After) when max_queue requests already wait
        or the server is stopping."""
        with self._cond:
            if self._stopping:
                raise APIError(503, "the server is shutting down", code="shutting_down",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            if len(self._waiting) >= self.max_queue:
                self.metrics.inc("requests_total", outcome="rejected")
                raise APIError(503, f"the server is busy: {len(self._waiting)} requests are waiting "
                                    f"(--max-queue); retry later", code="queue_full",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            self._waiting.append(w)
            self._cond.notify()

    def cancel(self, w: Work) -> None:
        """The client is gone: drop w wherever it is (its blocks freed at once)."""
        with self._cond:
            self._cancels.append(w)
            self._cond.notify()

    def queue_depth(self) -> int:
        with self._cond:
            return len(self._waiting)

    def stop(self, timeout: float = 10.0) -> None:
        """Admit nothing more; cancel what is left and end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    # --- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._cancels or self.runner.running or self._stopping):
                    self._cond.wait()
                cancels, self._cancels = self._cancels, []
                for w in cancels:
                    if w in self._waiting:
                        self._waiting.remove(w)
                        self.metrics.inc("requests_total", outcome="cancelled")
                stopping = self._stopping
            for w in cancels:
                if w.seq is not None and not w.seq.done:
                    self.runner.cancel(w.seq)
                    self.metrics.inc("requests_total", outcome="cancelled")
            if stopping:
                self._drop_all("the server is shutting down")
                return
            self._admit()
            if self.runner.running:
                self._step()
            self.n_running = len(self.runner.running)
            self.kv_used = self.kv.pool.n_used()

    def _admit(self) -> None:
        while len(self.runner.running) < self.parallel:
            with self._cond:
                if not self._waiting:
                    return
                w = self._waiting[0]
            try:
                w.seq = self.runner.add(w.ids, w.max_tokens, ignore_eos=w.ignore_eos, sampling=w.sampling,
                                        stop=w.stop, logprobs=w.logprobs, tag=w)
            except MinferError as e:
                if self.runner.running:
                    return              # it waits, first in line, for blocks to come back
                # alone and still no room (the handler checked the pool's size): refuse it
                with self._cond:
                    self._waiting.popleft()
                self.metrics.inc("requests_total", outcome="error")
                w.send(("error", APIError(503, str(e), code="kv_cache_full",
                                          headers={"Retry-After": str(RETRY_AFTER_S)})))
                continue
            with self._cond:
                self._waiting.popleft()
            self.metrics.inc("prompt_tokens_total", len(w.ids))
            self.metrics.inc("prompt_tokens_cached_total", w.seq.stats.n_cached)

    def _step(self) -> None:
        try:
            advanced = self.runner.step()
        except MinferError as e:
            self._drop_running(f"the engine failed: {e}", 503, "engine_error")
            return
        except Exception:                                       # a bug: say so, keep serving
            traceback.print_exc(file=sys.stderr)
            self._drop_running("internal error in the engine step (see the server's log)", 500, None)
            return
        now = time.perf_counter()
        for s in advanced:
            w: Work = s.tag
            n_new = len(s.out) - w.n_out
            if n_new:
                if w.t_last is None:
                    self.metrics.observe_ttft(now - w.arrival)
                else:
                    self.metrics.observe_itl((now - w.t_last) / n_new)
                w.t_last = now
                self.metrics.inc("generation_tokens_total", n_new)
            text = "".join(s.pieces[w.n_pieces:])
            lps = s.logprobs[w.n_lps:] if s.logprobs is not None else []
            w.n_pieces, w.n_out = len(s.pieces), len(s.out)
            w.n_lps += len(lps)
            if text or lps:
                w.send(("delta", text, list(lps)))
            if s.done:
                self.metrics.inc("requests_total", outcome="ok")
                w.send(("done", s.result()))

    def _drop_running(self, message: str, status: int, code: str | None) -> None:
        """End every running request with an error (a failed step)."""
        for s in list(self.runner.running):
            self.runner.cancel(s)
            self.metrics.inc("requests_total", outcome="error")
            s.tag.send(("error", APIError(status, message, code=code)))
        self.n_running = 0
        self.kv_used = self.kv.pool.n_used()

    def _drop_all(self, message: str) -> None:
        """End every running and waiting request (the server is stopping)."""
        self._drop_running(message, 503, "shutting_down")
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for w in waiting:
            self.metrics.inc("requests_total", outcome="error")
            w.send(("error", APIError(503, message, code="shutting_down")))
