"""`minfer serve` through the official openai client: completions and chat, streamed
and not, stop strings, seeded sampling, logprobs, usage, the prefix cache, many
clients at once. Truth: the in-process Engine on the same model (`truth`, itself
checked against llama.cpp's outputs elsewhere), run alone on each request's prompt;
the server batches requests together and chunks prompts (--batch-size 64), so
equality also says that batching and chunking change no greedy token."""
from __future__ import annotations

import concurrent.futures as cf
import math

import numpy as np
import pytest

from minfer import SamplingParams

pytestmark = pytest.mark.model

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,"]
CHAT = [{"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three prime numbers."}]
N = 20


def _finish(gen) -> str:
    return {"eog": "stop", "stop": "stop", "max_tokens": "length", "context": "length"}[gen.stop]


def test_models_and_health(server):
    import httpx
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.model] == ["smollm2-135m-instruct-q4_1"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_greedy_completion_is_the_engines(server, truth, prompt):
    want = truth.generate(prompt, max_tokens=N)
    r = server.client().completions.create(model=server.model, prompt=prompt, max_tokens=N, temperature=0)
    c = r.choices[0]
    assert c.text == want.text and c.finish_reason == _finish(want)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_ids), len(want.ids))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.object == "text_completion" and r.id.startswith("cmpl-")


def test_token_ids_as_the_prompt(server, truth):
    ids = truth.tokenize(PROMPTS[0])
    want = truth.generate(ids, max_tokens=N)
    r = server.client().completions.create(model=server.model, prompt=ids, max_tokens=N, temperature=0)
    assert r.choices[0].text == want.text


def test_a_greedy_chat_is_the_engines_through_the_template(server, truth):
    want = truth.generate(CHAT, max_tokens=N)
    r = server.client().chat.completions.create(model=server.model, messages=CHAT, max_tokens=N, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == want.text
    assert c.finish_reason == _finish(want) and r.usage.prompt_tokens == len(want.prompt_ids)
    # max_completion_tokens is the newer name, and wins over max_tokens
    r2 = server.client().chat.completions.create(model=server.model, messages=CHAT, max_tokens=3,
                                                 max_completion_tokens=N, temperature=0)
    assert r2.choices[0].message.content == want.text


def test_streamed_text_equals_the_whole(server):
    cl = server.client()
    for prompt in PROMPTS[:2]:
        whole = cl.completions.create(model=server.model, prompt=prompt, max_tokens=N, temperature=0)
        chunks = list(cl.completions.create(model=server.model, prompt=prompt, max_tokens=N, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole.choices[0].text
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finals == [whole.choices[0].finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert all(c.usage is None for c in chunks[:-1])
    whole = cl.chat.completions.create(model=server.model, messages=CHAT, max_tokens=N, temperature=0)
    chunks = list(cl.chat.completions.create(model=server.model, messages=CHAT, max_tokens=N, temperature=0,
                                             stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_stop_strings(server, truth):
    plain = truth.generate(PROMPTS[2], max_tokens=40, ignore_eos=True)
    stop = plain.text[len(plain.text) // 2:][:5]
    assert stop.strip() and stop in plain.text
    want = plain.text[:plain.text.find(stop)]
    cl = server.client()
    r = cl.completions.create(model=server.model, prompt=PROMPTS[2], max_tokens=40, temperature=0,
                              stop=[stop, "\x00never"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = cl.completions.create(model=server.model, prompt=PROMPTS[2], max_tokens=40, temperature=0,
                                     stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want


def test_seeded_sampling_is_reproducible_and_the_engines(server, truth):
    cl = server.client()
    kw = dict(model=server.model, prompt=PROMPTS[2], max_tokens=N, temperature=0.9, top_p=0.95, seed=7)
    a, b = (cl.completions.create(**kw).choices[0].text for _ in range(2))
    want = truth.generate(PROMPTS[2], max_tokens=N, sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=7))
    assert a == b == want.text
    others = {cl.completions.create(**{**kw, "seed": s}).choices[0].text for s in (1, 2, 3)}
    assert len(others | {a}) > 1                    # the seed matters
    # vLLM's extras, top_k and min_p, reach the sampler too
    kw2 = {**kw, "extra_body": {"top_k": 5, "min_p": 0.05}}
    want2 = truth.generate(PROMPTS[2], max_tokens=N, sampling=SamplingParams(temperature=0.9, top_p=0.95, top_k=5,
                                                                            min_p=0.05, seed=7))
    assert cl.completions.create(**kw2).choices[0].text == want2.text


def test_completion_logprobs(server, truth):
    want = truth.generate(PROMPTS[0], max_tokens=8, logprobs=3)
    r = server.client().completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                           logprobs=3)
    lp = r.choices[0].logprobs
    tok = truth.tokenizer
    assert lp.tokens == [tok.token_bytes(t.id).decode("utf-8", "replace") for t in want.logprobs]
    np.testing.assert_allclose(lp.token_logprobs, [t.logprob for t in want.logprobs], atol=1e-4, rtol=0)
    for got, t in zip(lp.top_logprobs, want.logprobs):
        assert list(got) == [tok.token_bytes(i).decode("utf-8", "replace") for i, _ in t.top]
        np.testing.assert_allclose(list(got.values()), [v for _, v in t.top], atol=1e-4, rtol=0)
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:k]) for k in range(len(lp.tokens))]
    assert all(v <= 0 and math.isfinite(v) for v in lp.token_logprobs)


def test_chat_logprobs(server, truth):
    want = truth.generate(CHAT, max_tokens=6, logprobs=2)
    r = server.client().chat.completions.create(model=server.model, messages=CHAT, max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [bytes(c.bytes) for c in content] == [truth.tokenizer.token_bytes(t.id) for t in want.logprobs]
    np.testing.assert_allclose([c.logprob for c in content], [t.logprob for t in want.logprobs], atol=1e-4)
    assert [[bytes(x.bytes) for x in c.top_logprobs] for c in content] == \
           [[truth.tokenizer.token_bytes(i) for i, _ in t.top] for t in want.logprobs]


def test_echo_and_max_tokens_zero(server, truth):
    cl = server.client()
    want = truth.generate(PROMPTS[1], max_tokens=6)
    r = cl.completions.create(model=server.model, prompt=PROMPTS[1], max_tokens=6, temperature=0, echo=True)
    assert r.choices[0].text == PROMPTS[1] + want.text
    z = cl.completions.create(model=server.model, prompt=PROMPTS[1], max_tokens=0, temperature=0)
    assert z.choices[0].text == "" and z.usage.completion_tokens == 0 and z.choices[0].finish_reason == "length"


def test_the_prefix_cache_is_shared_and_counted(server):
    cl = server.client()
    doc = "A shared document that several requests start with. " * 20      # > 2 blocks of 64 tokens
    before = server.metrics()
    cl.completions.create(model=server.model, prompt=doc + "First question?", max_tokens=2, temperature=0)
    second = cl.completions.create(model=server.model, prompt=doc + "Second one?", max_tokens=2, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 128 and cached % 64 == 0
    after = server.metrics()
    assert after["minfer_prompt_tokens_cached_total"] - before["minfer_prompt_tokens_cached_total"] >= cached


def test_sixteen_clients_at_once_each_get_their_own_text(server, truth):
    """16 streaming clients at once (8 run, the rest queue, prompts chunked into the
    steps of the running ones): each stream's text is the engine's for its prompt alone."""
    prompts = [f"{p} {k}" for k in range(4) for p in PROMPTS]
    want = {p: truth.generate(p, max_tokens=12).text for p in prompts}

    def one(p):
        cl = server.client()
        chunks = cl.completions.create(model=server.model, prompt=p, max_tokens=12, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks)

    with cf.ThreadPoolExecutor(16) as pool:
        got = dict(zip(prompts, pool.map(one, prompts, timeout=300)))
    assert got == want


def test_metrics_are_prometheus_text(server):
    """Every sample line `name{labels} value` under its HELP and TYPE; histograms with
    cumulative buckets ending in +Inf equal to _count; the series the issue names."""
    import re

    import httpx
    server.client().completions.create(model=server.model, prompt="Hi", max_tokens=3, temperature=0)
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    types, samples = {}, []
    sample = re.compile(r'^([a-z_:][a-z0-9_:]*)(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? (-?[0-9.e+]+|\+Inf)$')
    for line in r.text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
        elif not line.startswith("# HELP "):
            m = sample.match(line)
            assert m, line
            samples.append((m.group(1), m.group(2) or "", float(m.group(4))))
    for name, _, _ in samples:
        base = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        assert base in types, name
    for h in ("minfer_time_to_first_token_seconds", "minfer_inter_token_latency_seconds"):
        assert types[h] == "histogram"
        buckets = [v for n, lab, v in samples if n == h + "_bucket"]
        assert buckets == sorted(buckets) and len(buckets) > 3
        assert buckets[-1] == next(v for n, _, v in samples if n == h + "_count") > 0
    for g in ("queue_depth", "running_sequences", "kv_blocks_used", "kv_blocks_total"):
        assert types["minfer_" + g] == "gauge"
    for c in ("requests_total", "prompt_tokens_total", "prompt_tokens_cached_total", "generation_tokens_total"):
        assert types["minfer_" + c] == "counter"
    m = server.metrics()
    assert m["minfer_generation_tokens_total"] >= 3 and m['minfer_requests_total{outcome="ok"}'] >= 1
