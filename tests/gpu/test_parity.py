"""Prefill logits of a synthetic qwen2 model: CUDA backend vs the CPU reference.

The CUDA linears quantize activations to int8 (MMQ), the CPU computes in f32,
so the logits differ by a bounded relative error (tests/bounds.py says why it
is PARITY_REL); the top-1 token must agree wherever the CPU's top-1/top-2
margin is decisive (bounds.decisive). Measured figures are appended to
$MINFER_REPORT_DIR/parity.txt when that is set (gpu_check.sh does).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bounds import PARITY_REL, decisive  # noqa: E402

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def _golden_module():
    spec = importlib.util.spec_from_file_location("golden_script", ROOT / "scripts" / "golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from minfer.engine import Engine
    d = Path(os.environ.get("MINFER_CACHE") or tmp_path_factory.mktemp("synth"))
    path = _golden_module().synth_model(d)          # 3 layers, d 512, GQA 2:1, hd 128
    return (Engine.load(path, backend="cpu", n_ctx=1100, progress=False),
            Engine.load(path, backend="cuda", n_ctx=1100, progress=False))


def report(line: str) -> None:
    print(line)
    d = os.environ.get("MINFER_REPORT_DIR")
    if d:
        with open(Path(d) / "parity.txt", "a") as f:
            f.write(line + "\n")


def rel_rows(gpu: np.ndarray, cpu: np.ndarray) -> np.ndarray:
    """per-position ||gpu - cpu|| / ||cpu||"""
    g, c = gpu.astype(np.float64), cpu.astype(np.float64)
    return np.linalg.norm(g - c, axis=-1) / np.linalg.norm(c, axis=-1)


def check(tag: str, gpu: np.ndarray, cpu: np.ndarray) -> None:
    assert gpu.shape == cpu.shape and np.isfinite(gpu).all()
    rel = rel_rows(gpu, cpu)
    dec = decisive(cpu)
    agree = (gpu.argmax(-1) == cpu.argmax(-1))
    report(f"parity {tag}: rel max {rel.max():.3e} median {np.median(rel):.3e}; top-1 agree "
           f"{agree.mean():.3f} overall, {agree[dec].mean() if dec.any() else float('nan'):.3f} "
           f"at {dec.sum()}/{len(dec)} decisive positions")
    assert rel.max() <= PARITY_REL, f"{tag}: relative error {rel.max():.3e} > {PARITY_REL}"
    bad = np.flatnonzero(dec & ~agree)
    assert bad.size == 0, f"{tag}: top-1 differs at decisive positions {bad[:10]}"


@pytest.mark.parametrize("T", (7, 512, 1000))
def test_prefill_parity(engines, T):
    cpu, gpu = engines
    rng = np.random.default_rng(T)
    tokens = rng.integers(0, cpu.cfg.vocab_size, T).astype(np.int32)
    # every position for the shorter prompts, the last one at 1000 (0.6 GB of CPU logits otherwise)
    frm = 0 if T <= 512 else None
    lc = cpu.model.forward(tokens, 0, cpu.new_cache(T), logits_from=frm)
    lg = gpu.model.forward(tokens, 0, gpu.new_cache(T), logits_from=frm)
    check(f"prefill T={T}", lg, lc)


def test_decode_parity(engines):
    """Chunked prefill (two calls) then single-token decode steps (the M = 1 path)."""
    cpu, gpu = engines
    rng = np.random.default_rng(77)
    tokens = rng.integers(0, cpu.cfg.vocab_size, 40).astype(np.int32)
    out = {}
    for e in engines:
        cache = e.new_cache(64)
        rows = [e.model.forward(tokens[:29], 0, cache)[-1], e.model.forward(tokens[29:33], 29, cache)[-1]]
        rows += [e.model.decode(int(t), 33 + i, cache) for i, t in enumerate(tokens[33:])]
        out[e.backend.name] = np.stack(rows)
    check("chunked prefill + decode", out["cuda"], out["cpu"])
