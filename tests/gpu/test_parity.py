"""Prefill logits of a synthetic qwen2 model: CUDA backend vs the CPU reference.

The CUDA backend rounds to f16 (the f16 GEMM engine, the f16 KV cache and flash
attention) or to int8 (the MMQ engine), the CPU computes in f32, so the logits
differ by a relative error bounded per engine: the bound of each forward is
derived from the GEMMs its launch counters say ran (the `parity_bound` fixture;
tests/conftest.py says why). The top-1 token must agree wherever the CPU's
top-1/top-2 margin is decisive under that bound. Measured figures are appended
to $MINFER_REPORT_DIR/parity.txt when that is set (gpu_check.sh does).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def engines(synth_dir):
    from minfer.engine import Engine
    from minfer.tools.synth import synth_model
    path = synth_model(synth_dir)                   # 3 layers, d 512, GQA 2:1, hd 128
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


def path_bound(parity_bound, counters: dict, n_layer: int) -> float:
    """The bound for a forward whose launch counters are `counters`."""
    f16 = counters["q4k_f16"] + counters["q6k_f16"]
    int8 = sum(counters[k] for k in ("q4k_mmq", "q6k_mmq", "q4k_mv", "q6k_mv"))   # q8_1 activations
    return parity_bound(f16, int8, 6 * n_layer)


@pytest.fixture(scope="module")
def check(decisive):
    """-> check(tag, gpu logits, cpu logits, bound): report the figures, assert the bound."""
    def check(tag: str, gpu: np.ndarray, cpu: np.ndarray, bound: float) -> None:
        assert gpu.shape == cpu.shape and np.isfinite(gpu).all()
        rel = rel_rows(gpu, cpu)
        dec = decisive(cpu, bound)
        agree = (gpu.argmax(-1) == cpu.argmax(-1))
        report(f"parity {tag}: rel max {rel.max():.3e} median {np.median(rel):.3e} (bound {bound:.2e}); "
               f"top-1 agree {agree.mean():.3f} overall, "
               f"{agree[dec].mean() if dec.any() else float('nan'):.3f} at {dec.sum()}/{len(dec)} decisive")
        assert rel.max() <= bound, f"{tag}: relative error {rel.max():.3e} > {bound:.3e}"
        bad = np.flatnonzero(dec & ~agree)
        assert bad.size == 0, f"{tag}: top-1 differs at decisive positions {bad[:10]}"
    return check


@pytest.mark.parametrize("engine", ["f16", "mmq"])
@pytest.mark.parametrize("T", (7, 512, 1000))
def test_prefill_parity(engines, check, parity_bound, T, engine):
    """Every layer GEMM on the engine under test (the default f16 engine, or the int8
    MMQ pinned); the LM head takes MMQ over many positions and the int8 matvec on one."""
    cpu, gpu = engines
    rng = np.random.default_rng(T)
    tokens = rng.integers(0, cpu.cfg.vocab_size, T).astype(np.int32)
    # every position for the shorter prompts, the last one at 1000 (0.6 GB of CPU logits otherwise)
    frm = 0 if T <= 512 else None
    lc = cpu.model.forward(tokens, 0, cpu.new_cache(T), logits_from=frm)
    pin = {"f16_min_t": 1 << 30} if engine == "mmq" else {}
    with gpu.backend.using(**pin):
        gpu.backend.reset_counters()
        lg = gpu.model.forward(tokens, 0, gpu.new_cache(T), logits_from=frm)
        c = gpu.backend.counters()
    n_gemm = 7 * gpu.cfg.n_layer
    assert c[f"q4k_{engine}"] + c[f"q6k_{engine}"] >= n_gemm, c      # the engine under test ran
    check(f"prefill T={T} {engine}", lg, lc, path_bound(parity_bound, c, gpu.cfg.n_layer))


def test_decode_parity(engines, check, parity_bound):
    """Chunked prefill (two calls) then single-token decode steps (the M = 1 path).
    Decode rows run every GEMM as an int8 matvec (q8_1 activations) and read keys
    and values that the f16 engine wrote in the prefill: the bound holds both."""
    cpu, gpu = engines
    rng = np.random.default_rng(77)
    tokens = rng.integers(0, cpu.cfg.vocab_size, 40).astype(np.int32)
    out = {}
    for e in engines:
        cache = e.new_cache(64)
        rows = [e.model.forward(tokens[:29], 0, cache)[-1], e.model.forward(tokens[29:33], 29, cache)[-1]]
        rows += [e.model.decode(int(t), 33 + i, cache) for i, t in enumerate(tokens[33:])]
        out[e.backend.name] = np.stack(rows)
    n_layer = gpu.cfg.n_layer
    check("chunked prefill + decode", out["cuda"], out["cpu"],
          parity_bound(7 * n_layer, 7 * n_layer + 1, 6 * n_layer))
