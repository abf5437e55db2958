"""The FastAPI app of `minfer serve`: the OpenAI-compatible routes over one
scheduler (scheduler.py), the API key and the body limit (`Guard`, in front of
every route), and every error as OpenAI's JSON (errors.py).

    POST /v1/completions        text or token ids in, text out (echo, logprobs)
    POST /v1/chat/completions   messages through the model's chat template
    GET  /v1/models             the one model served
    GET  /health                200 {"status": "ok"}: no API key needed
    GET  /metrics               Prometheus text (metrics.py)

A request is checked whole before it is queued: the body's JSON and schema (400,
422), the model's name (404), the fields this server cannot honour (400), the
prompt against the context and the KV cache (400). Then it waits for the
scheduler's events: streamed as server-sent events (sse.py) ending in
`data: [DONE]`, or collected into one response. A client that goes away is
cancelled at once (its sequence's blocks freed).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass

import numpy as np
from fastapi import FastAPI, Request
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..errors import MinferError
from ..generate import Generation, TokenLogprob, checked_logprobs
from ..kv.paged import PagedCache
from ..text.prompt import chat_ids, prompt_ids
from ..text.stops import StopMatcher
from . import sse
from .errors import APIError, error_response
from .metrics import Metrics
from .protocol import ChatRequest, CompletionRequest
from .scheduler import Scheduler, Work

MAX_BODY_BYTES = 4 << 20        # a request body larger than this is a 413
FINISH = {"eog": "stop", "stop": "stop", "max_tokens": "length", "context": "length"}
POLL_S = 0.25                   # how often a non-streaming request checks that its client is still there


@dataclass
class ServerState:
    engine: object                  # minfer.Engine: only the scheduler thread runs it
    model_id: str
    scheduler: Scheduler
    metrics: Metrics
    api_key: str | None
    max_body: int = MAX_BODY_BYTES
    created: int = 0


class Guard:
    """ASGI middleware in front of every route: the API key (a Bearer token, compared in
    constant time; /health is open) and the body limit (Content-Length, and the bytes
    actually received), each an OpenAI-style error before the app sees the request."""

    def __init__(self, app, api_key: str | None, max_body: int):
        self.app, self.max_body = app, max_body
        self.key = api_key.encode("utf-8") if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        if self.key is not None and scope.get("path") != "/health":
            auth = headers.get("authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                return await error_response(401, "a valid API key is needed: Authorization: Bearer KEY",
                                            code="invalid_api_key",
                                            headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        length = headers.get("content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return await error_response(400, "Content-Length is not a number")(scope, receive, send)
            if n > self.max_body:
                return await self._too_large(scope, receive, send)
        chunks, size = [], 0
        while True:                             # the body, counted as it arrives
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                return await self._too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()              # then the real channel: http.disconnect

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        return await error_response(413, f"the request body is larger than the limit of {self.max_body} bytes",
                                    code="body_too_large")(scope, receive, send)


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.scheduler.start()
        try:
            yield
        finally:
            state.scheduler.stop()

    app = FastAPI(title="minfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, api_key=state.api_key, max_body=state.max_body)
    state.created = state.created or int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        what = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return error_response(exc.status_code, what.get(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _bug(request, exc: Exception):
        # a bug: its traceback goes to the server's stderr (uvicorn logs it), the client
        # gets JSON without it
        return error_response(500, f"internal error ({type(exc).__name__}); see the server's log")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != state.model_id:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {state.model_id!r}",
                           "model", "model_not_found")
        return _model_card(state)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, state, await _parse(request, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, state, await _parse(request, ChatRequest))

    return app


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "minfer",
            "max_model_len": state.engine.n_ctx}


async def _parse(request: Request, schema):
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or None
        raise APIError(422, f"{loc}: {err['msg']}" if loc else err["msg"], loc, "invalid_value") from None


# --- one request ------------------------------------------------------------------------

def _prepare(state: ServerState, req) -> tuple[np.ndarray, str]:
    """The prompt's token ids and, for echo, its text (in a worker thread: a chat
    template may take up to its bound)."""
    e = state.engine
    tok = e.tokenizer
    try:
        if isinstance(req, ChatRequest):
            return np.asarray(chat_ids(tok, req.chat_messages()), np.int32), ""
        p = req.one_prompt()
        if isinstance(p, str):
            return np.asarray(prompt_ids(tok, p), np.int32), p
        ids = np.asarray(p, np.int64)
        bad = (ids < 0) | (ids >= e.cfg.vocab_size)
        if bad.any():
            i = int(np.argmax(bad))
            raise APIError(400, f"prompt[{i}] = {int(ids[i])} is not a token id of this model "
                                f"(0..{e.cfg.vocab_size - 1})", "prompt")
        return ids.astype(np.int32), tok.decode(ids.tolist())
    except MinferError as err:
        raise APIError(400, str(err), "messages" if isinstance(req, ChatRequest) else "prompt") from None


async def _generate(request: Request, state: ServerState, req):
    if req.model != state.model_id:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves {state.model_id!r}",
                       "model", "model_not_found")
    req.unsupported()
    chat = isinstance(req, ChatRequest)
    try:
        sampling = req.sampling()
        stop = StopMatcher(req.stops()).stops
        logprobs = checked_logprobs(req.n_logprobs() if chat else req.logprobs)
    except MinferError as e:
        raise APIError(400, str(e)) from None
    ids, echo = await run_in_threadpool(_prepare, state, req)
    e = state.engine
    what = "messages" if chat else "prompt"
    if len(ids) > e.n_ctx:
        raise APIError(400, f"the prompt is {len(ids)} tokens, longer than the context of {e.n_ctx} "
                            f"(--ctx-size)", what, "context_length_exceeded")
    max_tokens = req.max_new(e.n_ctx - len(ids))
    need = PagedCache.blocks_for(min(len(ids) + max_tokens + 1, e.n_ctx))
    have = state.scheduler.kv.pool.n_blocks - 1
    if need > have:
        raise APIError(400, f"the request needs {need} KV blocks (prompt and max_tokens), the cache holds "
                            f"{have} (--kv-memory)", what, "context_length_exceeded")
    loop = asyncio.get_running_loop()
    w = Work(ids=ids, max_tokens=max_tokens, sampling=sampling, stop=stop, logprobs=logprobs,
             ignore_eos=req.ignore_eos, loop=loop, events=asyncio.Queue())
    state.scheduler.submit(w)                   # 503 when the queue is full
    rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    shape = _Shape(state, rid, chat, req.echo if not chat else False, echo, logprobs)
    if req.stream:
        return StreamingResponse(_stream(state, w, shape, req.include_usage()), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    gen = await _collect(request, state, w)
    if gen is None:
        return JSONResponse({}, status_code=499)        # nobody is there to read it
    return JSONResponse(shape.whole(gen))


async def _collect(request: Request, state: ServerState, w: Work) -> Generation | None:
    """Wait for w's result (None: the client went away; it is cancelled)."""
    finished = False
    try:
        while True:
            try:
                ev = await asyncio.wait_for(w.events.get(), timeout=POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None
                continue
            if ev[0] == "done":
                finished = True
                return ev[1]
            if ev[0] == "error":
                finished = True
                raise ev[1]
    finally:
        if not finished:
            state.scheduler.cancel(w)


async def _stream(state: ServerState, w: Work, shape: "_Shape", include_usage: bool):
    finished = False
    try:
        for chunk in shape.opening():
            yield sse.event(chunk)
        while True:
            ev = await w.events.get()
            if ev[0] == "delta":
                yield sse.event(shape.chunk(ev[1], ev[2], None, include_usage))
            elif ev[0] == "done":
                finished = True
                gen = ev[1]
                yield sse.event(shape.chunk("", [], FINISH[gen.stop], include_usage))
                if include_usage:
                    yield sse.event({**shape.head(), "choices": [], "usage": _usage(gen)})
                yield sse.DONE
                return
            else:
                finished = True
                yield sse.event(ev[1].body())
                yield sse.DONE
                return
    finally:
        if not finished:                        # the client went away: free its blocks now
            state.scheduler.cancel(w)


# --- response bodies ----------------------------------------------------------------------

def _usage(gen: Generation) -> dict:
    s = gen.stats
    return {"prompt_tokens": s.n_prompt, "completion_tokens": s.n_generated,
            "total_tokens": s.n_prompt + s.n_generated, "prompt_tokens_details": {"cached_tokens": s.n_cached}}


class _Shape:
    """The JSON of one request's response and chunks (completion or chat)."""

    def __init__(self, state: ServerState, rid: str, chat: bool, echo: bool, echo_text: str, n_top: int | None):
        self.state, self.rid, self.chat, self.n_top = state, rid, chat, n_top
        self.echo_text = echo_text if echo else ""
        self.created = int(time.time())
        self.offset = len(self.echo_text)         # text_offset of the next token (completions)
        self.tok = state.engine.tokenizer
        self._streaming = False

    def head(self) -> dict:
        obj = ("chat.completion.chunk" if self._streaming else "chat.completion") if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.state.model_id}

    def opening(self) -> list[dict]:
        """The chunks a stream starts with: chat's role, completion's echo."""
        self._streaming = True
        if self.chat:
            return [{**self.head(), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]}]
        if self.echo_text:
            return [{**self.head(), "choices": [{"index": 0, "text": self.echo_text, "logprobs": None,
                                                 "finish_reason": None}]}]
        return []

    def chunk(self, text: str, lps: list[TokenLogprob], finish: str | None, include_usage: bool) -> dict:
        lp = self._logprobs(lps) if self.n_top is not None and lps else None
        if self.chat:
            choice = {"index": 0, "delta": {"content": text} if text or finish is None else {},
                      "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        out = {**self.head(), "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    def whole(self, gen: Generation) -> dict:
        lp = self._logprobs(gen.logprobs) if gen.logprobs is not None else None
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": gen.text}, "logprobs": lp,
                      "finish_reason": FINISH[gen.stop]}
        else:
            choice = {"index": 0, "text": self.echo_text + gen.text, "logprobs": lp,
                      "finish_reason": FINISH[gen.stop]}
        return {**self.head(), "choices": [choice], "usage": _usage(gen)}

    def _text(self, i: int) -> str:
        return self.tok.token_bytes(int(i)).decode("utf-8", errors="replace")

    def _logprobs(self, lps: list[TokenLogprob]) -> dict:
        if self.chat:
            def entry(i, v):
                b = self.tok.token_bytes(int(i))
                return {"token": b.decode("utf-8", errors="replace"), "logprob": v, "bytes": list(b)}
            return {"content": [{**entry(t.id, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]}
                                for t in lps], "refusal": None}
        tokens = [self._text(t.id) for t in lps]
        offsets = []
        for s in tokens:
            offsets.append(self.offset)
            self.offset += len(s)
        return {"tokens": tokens, "token_logprobs": [t.logprob for t in lps],
                "top_logprobs": [{self._text(i): v for i, v in t.top} for t in lps] if self.n_top else None,
                "text_offset": offsets}
