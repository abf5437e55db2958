"""The golden streams (made on the GPU) checked by the CPU reference, teacher-forced:
fed prompt_ids + token_ids, the CPU must pick the golden token at every position
where its top-1/top-2 margin is decisive (the `decisive` fixture, the parity bound).
Also: the stored text is the tokenizer's decoding of the stored ids, and each
stream is at least 178 characters (the length scripts/check/golden.py grows it to)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

# the parametrization needs the list at collection time, before any fixture
GOLDEN = sorted((Path(__file__).resolve().parent / "golden").glob("*.json"))


@pytest.fixture(scope="module")
def engine(synth_dir):
    if not GOLDEN:
        pytest.skip("no golden files in tests/golden yet (made on the GPU: python3 -m scripts.check.golden --update)")
    from minfer.engine import Engine
    from minfer.tools.synth import synth_model

    recs = [json.loads(p.read_text(encoding="utf-8")) for p in GOLDEN]
    # the engine's default context only sizes new_cache(); the longest stream fits
    n_ctx = max(len(r["prompt_ids"]) + r["n_predict"] for r in recs)
    return Engine.load(synth_model(synth_dir, recs[0]["model"]), backend="cpu", n_ctx=n_ctx,
                       progress=False)


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_teacher_forced(engine, decisive, path):
    rec = json.loads(path.read_text(encoding="utf-8"))
    prompt, gen = rec["prompt_ids"], rec["token_ids"]
    assert len(gen) == rec["n_predict"]
    assert len(rec["text"]) >= 178
    assert engine.tokenizer.decode(gen) == rec["text"]
    assert engine.tokenizer.encode(rec["prompt"]) == prompt
    tokens = np.array(prompt + gen[:-1], dtype=np.int32)
    # logits at positions len(prompt)-1 .. end predict gen[0] .. gen[-1]
    logits = engine.model.forward(tokens, 0, engine.new_cache(len(tokens)), logits_from=len(prompt) - 1)
    dec = decisive(logits)
    pick = logits.argmax(-1)
    bad = np.flatnonzero(dec & (pick != np.array(gen)))
    assert dec.sum() >= len(gen) // 10, f"only {dec.sum()} decisive positions: the check is too weak"
    assert bad.size == 0, f"CPU top-1 differs from the golden token at decisive positions {bad}"
