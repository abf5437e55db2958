"""Bad requests to `minfer serve`, raw over HTTP (httpx): each an OpenAI-style JSON
error {"error": {"message", "type", "param", "code"}} with its 4xx status, never a
traceback or a 500, and the server keeps serving. Also the API key, the queue
limit (503 with Retry-After) and a client that goes away mid-stream (its blocks
freed, seen in /metrics)."""
from __future__ import annotations

import json
import threading

import pytest

pytestmark = pytest.mark.model

httpx = pytest.importorskip("httpx")


def _error(r, status: int, type_: str = "invalid_request_error", param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    e = body["error"]
    assert e["type"] == type_ and e["message"] and "\n" not in e["message"] and "Traceback" not in e["message"]
    if param is not None:
        assert e["param"] == param
    if code is not None:
        assert e["code"] == code
    return e


def _post(server, path, body, **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers={"Content-Type": "application/json",
                                                                 **kw.pop("headers", {})}, timeout=60, **kw)


def _ok(server):
    r = _post(server, "/v1/completions", {"model": server.model, "prompt": "Hi", "max_tokens": 2,
                                          "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2


def test_bad_requests_get_their_json_errors_and_the_server_keeps_serving(server):
    m = server.model
    _error(_post(server, "/v1/completions", b"{not json"), 400, code="invalid_json")
    _error(_post(server, "/v1/completions", b"\xff\xfe"), 400, code="invalid_json")
    _error(_post(server, "/v1/completions", "[1, 2]"), 400, code="invalid_json")
    _error(_post(server, "/v1/completions", {"prompt": "a"}), 422, param="model")
    _error(_post(server, "/v1/completions", {"model": m, "prompt": "a", "max_tokens": -1}), 422, param="max_tokens")
    _error(_post(server, "/v1/completions", {"model": m, "prompt": "a", "temperature": "hot"}), 422,
           param="temperature")
    _error(_post(server, "/v1/chat/completions", {"model": m, "messages": []}), 422, param="messages")
    _error(_post(server, "/v1/completions", {"model": "gpt-4", "prompt": "a"}), 404, param="model",
           code="model_not_found")
    _error(_post(server, "/v1/completions", {"model": m, "prompt": "a", "n": 2}), 400, param="n")
    _error(_post(server, "/v1/completions", {"model": m, "prompt": ["a", "b"]}), 400, param="prompt")
    _error(_post(server, "/v1/completions", {"model": m, "prompt": ""}), 400, param="prompt")
    _error(_post(server, "/v1/completions", {"model": m, "prompt": [1, 10**9]}), 400, param="prompt")
    _error(_post(server, "/v1/completions", {"model": m, "prompt": "a", "stop": [""]}), 400, param="stop")
    _error(_post(server, "/v1/completions", {"model": m, "prompt": "a", "echo": True, "logprobs": 1}), 400,
           param="echo")
    _error(_post(server, "/v1/chat/completions", {"model": m, "messages": [{"role": "user", "content": "a"}],
                                                  "tools": [{"type": "function"}]}), 400, param="tools")
    _error(_post(server, "/v1/chat/completions", {"model": m, "messages": [{"role": "tool", "content": "a"}]}),
           400, param="messages[0].role")
    _error(_post(server, "/v1/chat/completions",
                 {"model": m, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400,
           param="messages[0].content[0]")
    _error(httpx.get(server.url + "/v1/nothing", timeout=30), 404)
    _error(httpx.get(server.url + "/v1/completions", timeout=30), 405)
    _error(httpx.get(server.url + "/v1/models/other", timeout=30), 404, code="model_not_found")
    _ok(server)


def test_unknown_fields_are_ignored(server):
    r = _post(server, "/v1/completions", {"model": server.model, "prompt": "Hi", "max_tokens": 2,
                                          "temperature": 0, "user": "u1", "some_future_field": {"x": 1}})
    assert r.status_code == 200


def test_a_prompt_longer_than_the_context_is_400_before_it_is_queued(server, n_ctx):
    N_CTX = n_ctx
    before = server.metrics()["minfer_prompt_tokens_total"]
    e = _error(_post(server, "/v1/completions", {"model": server.model, "prompt": [200] * (N_CTX + 1)}), 400,
               param="prompt", code="context_length_exceeded")
    assert str(N_CTX + 1) in e["message"]
    long_text = "word " * (2 * N_CTX)
    _error(_post(server, "/v1/chat/completions", {"model": server.model,
                                                  "messages": [{"role": "user", "content": long_text}]}),
           400, param="messages", code="context_length_exceeded")
    assert server.metrics()["minfer_prompt_tokens_total"] == before         # nothing was admitted
    _ok(server)


def test_a_body_over_the_limit_is_413(server):
    from minfer.serve.app import MAX_BODY_BYTES
    big = json.dumps({"model": server.model, "prompt": "x" * (MAX_BODY_BYTES + 10)})
    _error(_post(server, "/v1/completions", big), 413, code="body_too_large")

    def chunks():                                   # no Content-Length: counted as it arrives
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b" " * 65536
    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=60)
    _error(r, 413, code="body_too_large")
    _ok(server)


def test_the_api_key(serve):
    s = serve("--api-key", "sekret-123")
    _error(_post(s, "/v1/completions", {"model": s.model, "prompt": "a"}), 401, "authentication_error",
           code="invalid_api_key")
    _error(_post(s, "/v1/completions", {"model": s.model, "prompt": "a"},
                 headers={"Authorization": "Bearer sekret-12"}), 401, "authentication_error")
    _error(httpx.get(s.url + "/v1/models", headers={"Authorization": "sekret-123"}, timeout=30), 401,
           "authentication_error")
    _error(httpx.get(s.url + "/metrics", timeout=30), 401, "authentication_error")
    assert httpx.get(s.url + "/health", timeout=30).status_code == 200              # open, for probes
    import openai
    with pytest.raises(openai.AuthenticationError):
        s.client(api_key="wrong").models.list()
    r = s.client(api_key="sekret-123").completions.create(model=s.model, prompt="Hi", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens <= 2
    s.terminate()


def _stream_lines(s, body, out: list, started: threading.Event):
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
        out.append(r.status_code)
        for line in r.iter_lines():
            if line:
                out.append(line)
                started.set()
    started.set()


def test_a_full_queue_is_503_with_retry_after(serve, truth):
    s = serve("--parallel", "1", "--max-queue", "1")
    long = {"model": s.model, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    a_out, a_started = [], threading.Event()
    threading.Thread(target=_stream_lines, args=(s, long, a_out, a_started), daemon=True).start()
    assert a_started.wait(60) and a_out[0] == 200           # A runs
    b_res = []
    b = threading.Thread(target=lambda: b_res.append(_post(s, "/v1/completions", {
        "model": s.model, "prompt": "def add(a, b):", "max_tokens": 6, "temperature": 0})), daemon=True)
    b.start()
    assert s.wait_metric("minfer_queue_depth", 1)["minfer_queue_depth"] == 1          # B waits
    r = _post(s, "/v1/completions", {"model": s.model, "prompt": "Hi", "max_tokens": 2})
    _error(r, 503, "server_busy", code="queue_full")
    assert int(r.headers["Retry-After"]) >= 1
    b.join(180)                                             # B runs after A
    assert b_res and b_res[0].status_code == 200
    assert b_res[0].json()["choices"][0]["text"] == truth.generate("def add(a, b):", max_tokens=6).text
    assert s.metrics()['minfer_requests_total{outcome="rejected"}'] == 1
    s.terminate()


def test_a_client_that_goes_away_mid_stream_frees_its_blocks(server):
    base = server.wait_metric("minfer_running_sequences", 0)
    assert base["minfer_kv_blocks_used"] == 1               # the pad block alone
    cancelled = base.get('minfer_requests_total{outcome="cancelled"}', 0)
    body = {"model": server.model, "prompt": "Once upon a time " * 40, "max_tokens": 600, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        n = 0
        for line in r.iter_lines():
            n += bool(line)
            if n == 3:
                mid = server.metrics()
                break
    assert mid["minfer_running_sequences"] == 1 and mid["minfer_kv_blocks_used"] > 1     # its run's blocks reserved
    after = server.wait_metric("minfer_kv_blocks_used", 1, timeout=30)
    assert after["minfer_kv_blocks_used"] == 1 and after["minfer_running_sequences"] == 0
    assert after['minfer_requests_total{outcome="cancelled"}'] == cancelled + 1
    gen = after["minfer_generation_tokens_total"] - base["minfer_generation_tokens_total"]
    assert gen < 600                                        # it did not run to its end
    _ok(server)
