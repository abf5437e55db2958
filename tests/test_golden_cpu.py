"""The golden streams (made on the GPU) checked by the CPU reference, teacher-forced:
fed prompt_ids + token_ids, the CPU must pick the golden token at every position
where its top-1/top-2 margin is decisive (tests/bounds.py, the parity bound).
Also: the stored text is the tokenizer's decoding of the stored ids, and each
stream is at least 178 characters (seed §4)."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bounds import decisive  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = sorted((ROOT / "tests" / "golden").glob("*.json"))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if not GOLDEN:
        pytest.skip("no golden files in tests/golden yet (made on the GPU: scripts/golden.py --update)")
    spec = importlib.util.spec_from_file_location("golden_script", ROOT / "scripts" / "golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from minfer.engine import Engine
    params = json.loads(GOLDEN[0].read_text())["model"]
    d = Path(os.environ.get("MINFER_CACHE") or tmp_path_factory.mktemp("synth"))
    return Engine.load(mod.synth_model(d, params), backend="cpu", n_ctx=mod.N_CTX, progress=False)


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_teacher_forced(engine, path):
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
