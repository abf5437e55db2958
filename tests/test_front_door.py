"""The Python front door (`from minfer import Engine`) on the synthetic model
(3 layers, the 7B's tokenizer and chat template): generate, logits, tokenize,
chat, close; and the backend that `auto` chooses."""
from __future__ import annotations

import numpy as np
import pytest

from minfer import Engine, Generation, MinferError
from minfer.tools.synth import synth_model

N_CTX = 64


@pytest.fixture(scope="module")
def model_path(synth_dir):
    return synth_model(synth_dir)


@pytest.fixture(scope="module")
def engine(model_path):
    eng = Engine.load(model_path, backend="cpu", n_ctx=N_CTX, progress=False)
    yield eng
    eng.close()


def test_the_package_exports_the_front_door():
    import minfer
    import minfer.engine
    assert minfer.Engine is minfer.engine.Engine
    assert {"Engine", "Generation", "MinferError", "__version__"} <= set(minfer.__all__)
    with pytest.raises(AttributeError):
        minfer.NoSuchName  # noqa: B018


def test_tokenize_and_detokenize(engine):
    tok = engine.tokenizer
    text = "def f(x):\n    return x"
    ids = engine.tokenize(text)
    assert ids[0] == tok.bos_id                          # this tokenizer adds a BOS
    assert engine.tokenize(text, add_bos=False) == ids[1:]
    assert engine.detokenize(ids[1:]) == text
    assert engine.detokenize(ids, special=False) == text   # the BOS is a control token
    assert engine.detokenize([]) == ""
    user = "<｜User｜>"
    assert len(engine.tokenize(user, add_bos=False)) == 1
    assert len(engine.tokenize(user, add_bos=False, parse_special=False)) > 1


def test_generate_returns_text_ids_stop_and_timings(engine):
    pieces: list[str] = []
    out = engine.generate("The capital of France is", max_tokens=6, ignore_eos=True, on_text=pieces.append)
    assert isinstance(out, Generation)
    assert out.prompt_ids == engine.tokenize("The capital of France is")
    assert len(out.ids) == 6 and out.stop == "max_tokens"
    assert out.text == "".join(pieces) == engine.detokenize(out.ids)
    s = out.stats
    assert (s.n_prompt, s.n_generated) == (len(out.prompt_ids), 6)
    assert s.prompt_s > 0 and s.prompt_tps > 0 and s.decode_tps > 0
    # the same ids as the prompt continue the same way (the engine's cache is reused)
    again = engine.generate(np.array(out.prompt_ids), max_tokens=6, ignore_eos=True)
    assert again.ids == out.ids and again.prompt_ids == out.prompt_ids


def test_warmup_leaves_no_trace(engine):
    """The warm-up run (generate's default, as llama.cpp's) uses a cache of its own:
    a generation after it gives the same ids as before it."""
    before = engine.generate("The capital of France is", max_tokens=5, ignore_eos=True).ids
    assert engine.warmup() > 0
    assert engine.generate("The capital of France is", max_tokens=5, ignore_eos=True).ids == before


def test_load_warms_up_unless_told_not_to(model_path, monkeypatch):
    """Engine.load runs the warm-up before it returns (the first call then pays no
    start-up), as `minfer generate` does; warmup=False leaves it to the caller."""
    calls = []
    real = Engine.warmup
    monkeypatch.setattr(Engine, "warmup", lambda self: calls.append(self) or real(self))
    with Engine.load(model_path, backend="cpu", n_ctx=N_CTX, progress=False) as eng:
        assert calls == [eng]
    with Engine.load(model_path, backend="cpu", n_ctx=N_CTX, progress=False, warmup=False):
        assert len(calls) == 1


def test_warmup_skips_lengths_past_the_context(model_path, monkeypatch):
    """A backend's warm-up lengths longer than the engine's context are left out (a
    one-token forward when none fits)."""
    with Engine.load(model_path, backend="cpu", n_ctx=8, progress=False) as eng:
        seen = []
        real = eng.model.forward
        monkeypatch.setattr(eng.model, "forward", lambda ids, *a, **k: seen.append(len(ids)) or real(ids, *a, **k))
        monkeypatch.setattr(eng.backend, "warmup_lengths", (2, 256))
        eng.warmup()
        monkeypatch.setattr(eng.backend, "warmup_lengths", (256,))
        eng.warmup()
    # the prefills (decode_greedy is not a forward): 2, then 1 (none fits), each warm-up
    # followed by the one-token prefill of the front door's cache before its decode steps
    assert seen == [2, 1, 1, 1]


def test_generation_stops_at_the_context(engine):
    out = engine.generate([7] * (N_CTX - 2), max_tokens=10, ignore_eos=True)
    assert out.stop == "context" and len(out.ids) == 3     # positions 62, 63 and the prefill's


def test_one_generated_token_has_no_decode_rate(engine):
    out = engine.generate("hi", max_tokens=1, ignore_eos=True)
    assert len(out.ids) == 1 and out.stats.decode_tps is None
    assert out.to_dict()["decode_tps"] is None


def test_logits_are_those_greedy_generation_followed(engine):
    out = engine.generate("hello world", max_tokens=5, ignore_eos=True)
    seq = out.prompt_ids + out.ids
    logits = engine.logits(seq)
    assert logits.shape == (len(seq), engine.cfg.vocab_size) and logits.dtype == np.float32
    p = len(out.prompt_ids)
    # teacher forcing over the whole sequence picks the tokens the decode steps picked
    assert logits[p - 1:-1].argmax(axis=-1).tolist() == out.ids
    last = engine.model.forward(np.array(seq), 0, engine.new_cache())[-1]
    np.testing.assert_allclose(logits[-1], last, rtol=1e-4, atol=1e-4)


def test_chat(engine):
    tok = engine.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
    text = engine.apply_chat_template(messages)
    assert "Be brief." in text and "hi there" in text
    closed = engine.apply_chat_template(messages, add_generation_prompt=False)
    assert text.startswith(closed) and text != closed
    out = engine.generate("hi there", max_tokens=2, chat=True, system="Be brief.", ignore_eos=True)
    # this template writes the BOS text itself: parsed once, not doubled by the tokenizer
    assert out.prompt_ids == engine.tokenize(text, add_bos=False)
    assert out.prompt_ids.count(tok.bos_id) == 1
    from_messages = engine.generate(messages, max_tokens=2, ignore_eos=True)
    assert from_messages.prompt_ids == out.prompt_ids and from_messages.ids == out.ids


@pytest.mark.parametrize("call, fragment", [
    (lambda e: e.logits([]), "empty ids"),
    (lambda e: e.logits([1.5, 2.0]), "integer token ids"),
    (lambda e: e.logits([[1, 2]]), "flat sequence"),
    (lambda e: e.logits([3, e.cfg.vocab_size]), r"ids\[1\] = 152064 is not a token id"),
    (lambda e: e.detokenize([-1]), "not a token id"),
    (lambda e: e.generate([], 3), "empty prompt"),
    (lambda e: e.generate([1, 2], chat=True), "chat=True needs text"),
    (lambda e: e.generate("hi", system="x"), "system message needs chat=True"),
    (lambda e: e.generate([{"role": "user", "content": "x"}], system="y"), "first message"),
    (lambda e: e.generate([5] * (N_CTX + 1)), f"longer than the context of {N_CTX}"),
    (lambda e: e.generate("hi", max_tokens=-1), ">= 0"),
    (lambda e: e.tokenize(b"bytes"), "takes text"),
])
def test_bad_calls_are_one_line_errors(engine, call, fragment):
    with pytest.raises(MinferError, match=fragment) as e:
        call(engine)
    assert "\n" not in str(e.value)


def test_close_and_with(model_path):
    with Engine.load(model_path, backend="cpu", n_ctx=16, progress=False) as eng:
        assert eng.generate("hi", max_tokens=1).stats.n_prompt > 0
        assert "backend='cpu'" in repr(eng)
    assert eng.model is None and "closed" in repr(eng)
    for call in (lambda: eng.generate("hi"), lambda: eng.logits([1]), eng.new_cache):
        with pytest.raises(MinferError, match="closed"):
            call()
    eng.close()                                          # a second close does nothing


def test_auto_chooses_a_backend_and_says_which(model_path, gpu_skip_reason, capsys):
    from minfer.backend import cuda_unavailable

    capsys.readouterr()
    eng = Engine.load(model_path, n_ctx=16)              # backend "auto", progress on
    err = capsys.readouterr().err
    if gpu_skip_reason is None:
        want = f"minfer: backend cuda ({eng.backend.device_info()['device']})"
    else:
        assert eng.backend.name == "cpu"
        want = f"minfer: backend cpu ({cuda_unavailable()})"
    assert [line for line in err.splitlines() if line.startswith("minfer: backend")] == [want]
    eng.close()
    Engine.load(model_path, n_ctx=16, progress=False).close()
    assert "minfer: backend" not in capsys.readouterr().err  # progress=False: quiet


class _FakeCuda:
    """Stands for CUDABackend where cupy and a device are taken to exist."""
    name = "cuda"
    fail: str | None = None

    def __init__(self, cfg, settings=None):     # as CUDABackend(cfg, settings)
        if self.fail:
            raise MinferError(self.fail)

    def device_info(self):
        return {"device": "Fake GPU 80GB", "driver": "1.0", "cuda_driver": "12.8", "cuda_runtime": "12.9"}


@pytest.mark.parametrize("fail, want", [
    (None, "minfer: backend cuda (Fake GPU 80GB)"),
    ("head dimension 96 is not supported by the CUDA attention kernels",
     "minfer: backend cpu (head dimension 96 is not supported by the CUDA attention kernels)"),
])
def test_auto_rule(engine, monkeypatch, capsys, fail, want):
    """With CUDA usable, auto takes the CUDA backend; if that backend refuses the model,
    the CPU one, saying why. Explicit names are never replaced."""
    import minfer.backend as backend
    import minfer.backend.cuda as cuda
    monkeypatch.setattr(backend, "cuda_unavailable", lambda: None)
    monkeypatch.setattr(cuda, "CUDABackend", type("Fake", (_FakeCuda,), {"fail": fail}))
    capsys.readouterr()
    be = backend.get_backend("auto", engine.cfg, announce=True)
    assert capsys.readouterr().err == want + "\n"
    assert be.name == want.split()[2]
    assert backend.get_backend("cpu", engine.cfg, announce=True).name == "cpu"
    assert capsys.readouterr().err == ""
    if fail:
        with pytest.raises(MinferError, match="head dimension 96"):
            backend.get_backend("cuda", engine.cfg)


def test_sampling_with_a_seed_is_reproducible_and_temperature_zero_is_greedy(engine):
    """A seed gives the same ids run after run; another seed other ids; temperature 0
    (and SamplingParams() alone) the greedy stream; each draw from the step's own
    logits (the first token's checked against a draw from engine.logits here)."""
    from minfer import SamplingParams
    from minfer.sampling import sample
    prompt = engine.tokenize("def add(a, b):")
    greedy = engine.generate(prompt, 12, ignore_eos=True)
    assert engine.generate(prompt, 12, ignore_eos=True, sampling=SamplingParams()).ids == greedy.ids
    p = SamplingParams(temperature=1.5, top_k=50, seed=9)
    a = engine.generate(prompt, 12, ignore_eos=True, sampling=p)
    assert a.ids == engine.generate(prompt, 12, ignore_eos=True, sampling=p).ids
    b = engine.generate(prompt, 12, ignore_eos=True, sampling=SamplingParams(temperature=1.5, top_k=50, seed=10))
    assert a.ids != b.ids and a.ids != greedy.ids
    first = sample(engine.logits(prompt)[-1], p, len(prompt), prompt, [])
    assert a.ids[0] == first
    with pytest.raises(MinferError, match="SamplingParams"):
        engine.generate(prompt, 2, sampling={"temperature": 1.0})
