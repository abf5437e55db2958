"""Stop strings, generated tokens' logprobs and Engine.score at the front door, on the
CPU reference with the real SmolLM2-135M. Truth: for stops, the text of a run
without them cut before the first occurrence (minfer/text/stops.py's rule); for
logprobs and scores, minfer/logprobs.py applied to Engine.logits (one teacher-forced
forward from position 0, another computation than the decode steps: float32
rounding of other forward shapes, so values agree to 1e-4, not bit for bit)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minfer import MinferError, ScoreResult, SamplingParams, TokenLogprob
from minfer.cli import main
from minfer.logprobs import log_softmax, prompt_logprobs, top_logprobs

PROMPT = "The capital of France is"
N = 40
ATOL = 1e-4


@pytest.fixture(scope="module")
def plain(smollm2_engine):
    """The greedy run every stop test cuts: no stop, no logprobs."""
    return smollm2_engine.generate(PROMPT, max_tokens=N, ignore_eos=True)


def _stop_from(text: str) -> str:
    """A stop string taken from the middle of text, starting at a non-space."""
    i = len(text) // 2
    while text[i].isspace():
        i += 1
    return text[i:i + 4]


def _cut(text: str, stops) -> str:
    return text[:min(text.find(s) for s in stops if s in text)]


# --- stop strings ------------------------------------------------------------------
def test_a_stop_string_cuts_the_text_before_its_first_occurrence(smollm2_engine, plain):
    e = smollm2_engine
    stop = _stop_from(plain.text)
    pieces: list[str] = []
    got = e.generate(PROMPT, max_tokens=N, ignore_eos=True, stop=stop, on_text=pieces.append)
    assert got.text == _cut(plain.text, [stop]) and "".join(pieces) == got.text
    assert (got.stop, got.stop_string) == ("stop", stop) == (got.stats.stop, got.stats.stop_string)
    # ids: the unstopped run's, up to and including the token that completed the stop
    k = len(got.ids)
    assert got.ids == plain.ids[:k]
    assert e.detokenize(got.ids).startswith(got.text + stop)
    assert stop not in e.detokenize(got.ids[:-1])
    assert got.stats.n_generated == k < len(plain.ids)
    # the last token was never fed back: the K/V written are the prompt and ids[:-1]
    assert got.stats.n_written == len(got.prompt_ids) + k - 1
    d = got.to_dict()
    assert (d["stop"], d["stop_string"], d["text"]) == ("stop", stop, got.text)


def test_the_prefix_cache_after_a_stopped_run(smollm2_engine, plain):
    """What a stopped run left in the cache continues as a fresh prefill does."""
    e = smollm2_engine
    e.reset_prefix_cache()
    got = e.generate(PROMPT, max_tokens=N, ignore_eos=True, stop=_stop_from(plain.text))
    longer = got.prompt_ids + got.ids
    after = e.generate(longer, max_tokens=6, ignore_eos=True)
    e.reset_prefix_cache()
    fresh = e.generate(longer, max_tokens=6, ignore_eos=True)
    assert after.ids == fresh.ids == plain.ids[len(got.ids):len(got.ids) + 6]


def test_stops_never_hit_change_nothing(smollm2_engine, plain):
    got = smollm2_engine.generate(PROMPT, max_tokens=N, ignore_eos=True, stop=["\x00never", "zzzzqq"])
    assert (got.ids, got.text, got.stop, got.stop_string) == (plain.ids, plain.text, "max_tokens", None)
    assert smollm2_engine.generate(PROMPT, max_tokens=N, ignore_eos=True, stop=[]).ids == plain.ids


def test_of_several_stops_the_earliest_occurrence_wins(smollm2_engine, plain):
    t = plain.text
    late, early = _stop_from(t[len(t) // 2:]), _stop_from(t)
    want = _cut(t, [late, early])
    got = smollm2_engine.generate(PROMPT, max_tokens=N, ignore_eos=True, stop=[late, early])
    assert got.text == want and got.stop == "stop"
    assert got.stop_string == min((t.find(s), len(s), s) for s in (late, early) if s in t)[2]


def test_a_stop_decided_only_when_the_run_ends(smollm2_engine, plain):
    """Stops "XYZ\x01" and "YZ", the text ending in "XYZ": "YZ" is complete but the
    longer one, starting earlier, may still come, so the text is held until the run
    ends at max_tokens; then "YZ" cuts it (stop "stop"), alone and in a list."""
    e = smollm2_engine
    for k in range(N, 4, -1):
        t = e.detokenize(plain.ids[:k])
        if t.find(t[-2:]) == len(t) - 2:
            break
    else:
        pytest.fail("no prefix of the greedy run ends in two characters seen nowhere before")
    stops = [t[-3:] + "\x01", t[-2:]]
    pieces: list[str] = []
    got = e.generate(PROMPT, max_tokens=k, ignore_eos=True, stop=stops, on_text=pieces.append)
    listed = e.generate([PROMPT, "hi"], max_tokens=k, ignore_eos=True, stop=stops)[0]
    for g in (got, listed):
        assert (g.text, g.stop, g.stop_string, g.ids) == (t[:-2], "stop", t[-2:], plain.ids[:k])
    assert "".join(pieces) == got.text


def test_a_list_of_prompts_stops_and_reports_logprobs_as_each_alone(smollm2_engine, plain):
    e = smollm2_engine
    prompts = [PROMPT, "def add(a, b):", "1, 2, 3, 4,"]
    stop = [_stop_from(plain.text), "# Ex"]
    both = e.generate(prompts, max_tokens=N, ignore_eos=True, stop=stop, logprobs=2)
    # sequences leave the batch at different steps: two stop strings, then max_tokens
    assert [g.stop for g in both] == ["stop", "stop", "max_tokens"]
    assert [g.stop_string for g in both] == stop + [None] and len({len(g.ids) for g in both}) == 3
    for p, g in zip(prompts, both):
        alone = e.generate(p, max_tokens=N, ignore_eos=True, stop=stop, logprobs=2)
        assert (g.ids, g.text, g.stop, g.stop_string) == (alone.ids, alone.text, alone.stop, alone.stop_string)
        assert [(t.id, [i for i, _ in t.top]) for t in g.logprobs] == \
               [(t.id, [i for i, _ in t.top]) for t in alone.logprobs]
        np.testing.assert_allclose([t.logprob for t in g.logprobs], [t.logprob for t in alone.logprobs],
                                   atol=ATOL, rtol=0)
        # the K/V written: the prompt and every generated token but the last (never fed back)
        assert g.stats.n_written == alone.stats.n_written == len(g.prompt_ids) + len(g.ids) - 1
    # greedy ids on the list path are the same with logprobs as without
    assert [g.ids for g in e.generate(prompts, max_tokens=12)] == \
           [g.ids for g in e.generate(prompts, max_tokens=12, logprobs=0)]


@pytest.mark.parametrize("stop, match", [("", "non-empty"), ([""], "non-empty"), ([3], "non-empty"),
                                         (7, "string or a list")])
def test_bad_stops_are_one_line_errors_and_touch_no_cache(smollm2_engine, stop, match):
    e = smollm2_engine
    before = e.kv_stats()
    for prompt in ("hello", ["hello", "there"]):
        with pytest.raises(MinferError, match=match) as err:
            e.generate(prompt, max_tokens=4, stop=stop)
        assert "\n" not in str(err.value)
    assert e.kv_stats() == before               # checked before any sequence is admitted


# --- logprobs of generated tokens ----------------------------------------------------
def _reference_rows(e, g) -> np.ndarray:
    """The logits each generated token was chosen from: one teacher-forced forward of
    prompt + ids[:-1] (causal: row p-1+k is that of prompt + ids[:k])."""
    seq = g.prompt_ids + g.ids[:-1]
    return e.logits(seq)[len(g.prompt_ids) - 1:]


def test_greedy_logprobs_are_the_raw_distribution_and_change_no_token(smollm2_engine, plain):
    e = smollm2_engine
    n = 12
    zero = e.generate(PROMPT, max_tokens=n, ignore_eos=True, logprobs=0)
    assert zero.ids == plain.ids[:n]            # the host argmax picks what the device argmax picked
    assert len(zero.logprobs) == n and all(isinstance(t, TokenLogprob) and t.top == () for t in zero.logprobs)
    rows = _reference_rows(e, zero)
    want = log_softmax(rows)[np.arange(n), zero.ids]
    got = np.array([t.logprob for t in zero.logprobs])
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    assert (got <= 0).all() and [t.id for t in zero.logprobs] == zero.ids

    five = e.generate(PROMPT, max_tokens=n, ignore_eos=True, logprobs=5)
    assert five.ids == zero.ids
    ref_ids, ref_vals = top_logprobs(rows, 5)
    for k, t in enumerate(five.logprobs):
        ids, vals = [i for i, _ in t.top], [v for _, v in t.top]
        assert len(t.top) == 5 and vals == sorted(vals, reverse=True)
        assert ids[0] == t.id and vals[0] == t.logprob            # greedy: the chosen one is the top
        assert ids == ref_ids[k].tolist()
        np.testing.assert_allclose(vals, ref_vals[k], atol=ATOL, rtol=0)
    twenty = e.generate(PROMPT, max_tokens=2, ignore_eos=True, logprobs=20)
    assert all(len(t.top) == 20 for t in twenty.logprobs)


def test_sampled_logprobs_are_before_the_sampling_transforms(smollm2_engine):
    e = smollm2_engine
    sp = SamplingParams(temperature=1.3, top_k=20, repeat_penalty=1.2, seed=11)
    a = e.generate(PROMPT, max_tokens=10, ignore_eos=True, sampling=sp)
    b = e.generate(PROMPT, max_tokens=10, ignore_eos=True, sampling=sp, logprobs=3)
    assert a.ids == b.ids
    rows = _reference_rows(e, b)
    np.testing.assert_allclose([t.logprob for t in b.logprobs], log_softmax(rows)[np.arange(10), b.ids],
                               atol=ATOL, rtol=0)
    assert all(t.top[0][1] >= t.logprob - ATOL for t in b.logprobs)


def test_logprobs_off_reads_nothing_back_on_greedy_steps(smollm2_engine, monkeypatch):
    """logprobs=None keeps the fast path: greedy steps take the argmax on the backend."""
    e = smollm2_engine
    calls = []
    real = e.model.decode
    monkeypatch.setattr(e.model, "decode", lambda *a: calls.append(a) or real(*a))
    off = e.generate(PROMPT, max_tokens=5, ignore_eos=True)
    assert off.logprobs is None and off.to_dict()["logprobs"] is None and calls == []
    on = e.generate(PROMPT, max_tokens=5, ignore_eos=True, logprobs=1)
    assert len(calls) == 4 and on.ids == off.ids
    d = on.to_dict()["logprobs"]
    assert json.loads(json.dumps(d)) == d and d[0]["id"] == on.ids[0] and len(d[0]["top"]) == 1


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "3"])
def test_bad_logprobs_are_one_line_errors(smollm2_engine, bad):
    for prompt in ("hello", ["hello", "there"]):
        with pytest.raises(MinferError, match=r"logprobs must be None \(off\) or a whole number in \[0, 20\]") as e:
            smollm2_engine.generate(prompt, max_tokens=2, logprobs=bad)
        assert "\n" not in str(e.value)


# --- score ---------------------------------------------------------------------------
def test_score_is_prompt_logprobs_of_the_logits(smollm2_engine):
    e = smollm2_engine
    text = "The capital of France is Paris. The capital of Italy is Rome."
    s = e.score(text)
    assert isinstance(s, ScoreResult) and s.ids == e.tokenize(text)
    want = prompt_logprobs(e.logits(s.ids), s.ids)
    assert s.logprobs[0] is None and len(s.logprobs) == len(s.ids)
    np.testing.assert_allclose(s.logprobs[1:], want[1:], atol=ATOL, rtol=0)
    assert all(v <= 0 for v in s.logprobs[1:])
    assert s.total == pytest.approx(sum(s.logprobs[1:]), abs=1e-9)
    by_ids = e.score(np.array(s.ids))
    assert by_ids.ids == s.ids and by_ids.logprobs == s.logprobs and by_ids.total == s.total
    # a list -> a list, each as alone; one token has nothing to score
    many = e.score([text, s.ids[:5], [42]])
    assert [m.ids for m in many] == [s.ids, s.ids[:5], [42]]
    assert many[0].logprobs == s.logprobs
    np.testing.assert_allclose(many[1].logprobs[1:], s.logprobs[1:5], atol=ATOL, rtol=0)
    assert (many[2].logprobs, many[2].total) == ([None], 0.0)
    assert json.loads(json.dumps(s.to_dict()))["logprobs"][0] is None


def test_score_follows_greedy_generation(smollm2_engine, plain):
    """The greedy tokens are each the most likely under score's rows."""
    e = smollm2_engine
    g = e.generate(PROMPT, max_tokens=8, ignore_eos=True, logprobs=0)
    s = e.score(g.prompt_ids + g.ids)
    np.testing.assert_allclose(s.logprobs[len(g.prompt_ids):], [t.logprob for t in g.logprobs],
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("call, match", [
    (lambda e: e.score(""), "score: input is empty text"),
    (lambda e: e.score([]), "score: empty list"),
    (lambda e: e.score(np.array([], np.int64)), "empty input"),
    (lambda e: e.score(["ok", ""]), "score: input 1 is empty text"),
    (lambda e: e.score([5] * (e.n_ctx + 1)), "the input is 2049 tokens, longer than the context of 2048"),
    (lambda e: e.score(["ok", [5] * (e.n_ctx + 1)]), "input 1 of the list is 2049 tokens"),
    (lambda e: e.score([1, e.cfg.vocab_size]), r"input\[1\] = 49152 is not a token id"),
    (lambda e: e.score([{"role": "user", "content": "hi"}]), "input must be text or a flat sequence"),
])
def test_bad_scores_are_one_line_errors(smollm2_engine, call, match):
    with pytest.raises(MinferError, match=match) as e:
        call(smollm2_engine)
    assert "\n" not in str(e.value)


def test_the_package_exports_the_new_types():
    import minfer
    assert {"TokenLogprob", "ScoreResult"} <= set(minfer.__all__)
    assert minfer.TokenLogprob is TokenLogprob and minfer.ScoreResult is ScoreResult


# --- the command line ------------------------------------------------------------------
def _cli(capsys, path, *flags):
    capsys.readouterr()
    rc = main(["generate", "-m", str(path), "--backend", "cpu", "-q", "--no-warmup", "-c", "256",
               "-n", str(N), "--ignore-eos", "-p", PROMPT, *flags])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out, err


def test_cli_stop_and_its_json_field(smollm2_path, capsys, plain):
    out, _ = _cli(capsys, smollm2_path, "--json")
    r = json.loads(out)
    assert r["text"] == plain.text and r["stop_string"] is None
    stop = _stop_from(r["text"])
    out, err = _cli(capsys, smollm2_path, "--json", "--stop", stop, "--stop", "\x01unused")
    s = json.loads(out)
    assert (s["text"], s["stop"], s["stop_string"]) == (_cut(r["text"], [stop]), "stop", stop)
    assert s["ids"] == r["ids"][:len(s["ids"])] and f"(stop string {stop!r})" in err
    streamed, _ = _cli(capsys, smollm2_path, "--stop", stop)
    assert streamed == s["text"]                # streamed: the same text, the stop held back
    assert "\n" in r["text"]                    # --stop takes -p's escapes: \n is a newline
    nl, _ = _cli(capsys, smollm2_path, "--json", "--stop", "\\n")
    assert json.loads(nl)["text"] == r["text"][:r["text"].index("\n")]


def test_cli_empty_stop_is_one_line_error_before_the_model_opens(tmp_path):
    r = subprocess.run([sys.executable, "-m", "minfer", "generate", "-m", str(tmp_path / "missing.gguf"),
                        "-p", "hi", "--stop", ""], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ))
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minfer: error: stop: each stop string must be non-empty")
    assert "missing.gguf" not in r.stderr
