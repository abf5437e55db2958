"""The CPU reference forward on the real Qwen2.5-Coder-1.5B-Instruct Q4_K_M against
llama.cpp's greedy output (tests/fixtures/greedy_qwen2.5-coder-1.5b.json).

llama.cpp quantizes activations to 8 bits in its CPU matmuls and we compute in
float32, so near-ties may flip: hence agreement rates, not identity. The model is
loaded once per session (the `real_engine` fixture, shared with test_perplexity.py).
"""
from __future__ import annotations

import json

import numpy as np
import pytest


@pytest.fixture(scope="module")
def greedy_cases(fixtures_dir) -> list[dict]:
    return json.loads((fixtures_dir / "greedy_qwen2.5-coder-1.5b.json").read_text())


@pytest.mark.model
def test_prompt_ids_match_llama_cpp(real_engine, greedy_cases):
    for case in greedy_cases:
        assert real_engine.tokenizer.encode(case["prompt"], parse_special=True) == case["prompt_ids"]


@pytest.mark.model
def test_teacher_forced_argmax_agrees_with_llama_cpp(real_engine, greedy_cases):
    """prompt_ids + tokens of greedy_text in one forward: the argmax at each position
    must be llama.cpp's next token at >= 90% of positions."""
    tok = real_engine.tokenizer
    agree = total = 0
    per_prompt = []
    for case in greedy_cases:
        gen = tok.encode(case["greedy_text"], parse_special=False, add_bos=False)
        assert tok.decode(gen) == case["greedy_text"]
        ids = np.array(case["prompt_ids"] + gen, np.int32)
        P = len(case["prompt_ids"])
        cache = real_engine.new_cache(len(ids))
        logits = real_engine.model.forward(ids, 0, cache, logits_from=P - 1)
        pred = logits[:-1].argmax(axis=-1)                 # predictions for positions P..end
        hits = int((pred == np.array(gen)).sum())
        agree, total = agree + hits, total + len(gen)
        per_prompt.append(f"{hits}/{len(gen)}")
    rate = agree / total
    print(f"\n[model] teacher-forced argmax agreement: {agree}/{total} = {rate:.1%} "
          f"(per prompt: {', '.join(per_prompt)})")
    assert rate >= 0.90


@pytest.mark.model
def test_free_running_greedy_agrees_with_llama_cpp(real_engine, greedy_cases):
    """16 greedy tokens from each prompt (prefill + 15 decode steps): the text must be
    a prefix of llama.cpp's greedy text for at least 5 of the 6 prompts."""
    from minfer.generate import GenerationStats, generate

    matches = []
    stats = GenerationStats()
    for case in greedy_cases:
        pieces: list[str] = []
        stats = GenerationStats()
        ids = list(generate(real_engine, case["prompt_ids"], 16, ignore_eos=True,
                            on_text=pieces.append, stats=stats))
        assert len(ids) == 16
        text = "".join(pieces)
        assert text == real_engine.tokenizer.decode(ids)   # streaming == one-shot decoding
        ok = case["greedy_text"].startswith(text)
        matches.append(ok)
        if not ok:
            print(f"\n[model] diverged on {case['prompt'][:40]!r}: {text!r}")
    print(f"\n[model] free-running greedy, first 16 tokens identical to llama.cpp: "
          f"{sum(matches)}/{len(matches)} prompts; last run: prefill {stats.prompt_tps:.1f} tok/s, "
          f"decode {stats.decode_tps:.2f} tok/s")
    assert sum(matches) >= 5


@pytest.mark.model
def test_chat_template_renders_the_fixture_chat_prompt(real_model_path, greedy_cases):
    """The GGUF's own template (jinja2 sandbox) around a system + user message gives
    exactly the chat-form prompt the llama.cpp fixture was generated from."""
    from minfer.text.chat import apply_chat_template
    from minfer.engine import ModelFile

    case = next(c for c in greedy_cases if c["prompt"].startswith("<|im_start|>"))
    tok = ModelFile.open(real_model_path).tokenizer
    text = apply_chat_template(tok.chat_template, [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Explain what a hash map is in two sentences."}])
    assert text == case["prompt"]
    assert tok.encode(text) == case["prompt_ids"]
