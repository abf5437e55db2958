"""The real SmolLM2-135M-Instruct Q4_1 (llama architecture, head dim 64) on the GPU
against the CPU reference on the same file: teacher-forced logits of the greedy
fixture's prompts followed by llama.cpp's tokens, every position, within the
per-engine bound of the GEMMs the CUDA launch counters say ran (tests/conftest.py);
then a few decode steps (the one-row matvecs) against the CPU's.

The file cannot be pulled on the GPU machine: carry it there and name it with
MINFER_SMOLLM2_PATH (the `smollm2_path` fixture checks its size and sha256);
elsewhere the pulled copy is used, or the test skips with the model tests."""
from __future__ import annotations

import json

import numpy as np
import pytest

from .test_parity import rel_rows, report

pytestmark = [pytest.mark.gpu, pytest.mark.model]

N_FORCED = 24            # llama.cpp's tokens appended to each prompt
N_DECODE = 4             # teacher-forced decode steps compared one row at a time


@pytest.fixture(scope="module")
def engines(smollm2_path):
    from minfer.engine import Engine
    return (Engine.load(str(smollm2_path), backend="cpu", n_ctx=512, progress=False),
            Engine.load(str(smollm2_path), backend="cuda", n_ctx=512, progress=False))


@pytest.fixture(scope="module")
def cases(fixtures_dir) -> list[dict]:
    return json.loads((fixtures_dir / "greedy_smollm2-135m.json").read_text(encoding="utf-8"))


def _gemms(counters: dict) -> tuple[int, int]:
    """(f16-engine GEMMs, q8_1 GEMMs (matvec, MMQ)) from launch counters."""
    return (sum(n for k, n in counters.items() if k.endswith("_f16")),
            sum(n for k, n in counters.items() if k.endswith(("_mv", "_mmq"))))


def test_smollm2_logits_gpu_vs_cpu(engines, cases, parity_bound, decisive):
    """The bound of the prefill rows from its GEMMs; of a decode row from its own
    one-row GEMMs plus the prefill's (its attention reads the prompt's K/V). The f16
    FFN rounds its gate/up outputs: 2 f16 roundings a layer (head dim 64 keeps the
    f32 KV cache and attention, so q/k/v/P are not rounded)."""
    cpu, gpu = engines
    tok, n_layer = cpu.tokenizer, cpu.cfg.n_layer
    for case in cases:
        gen = tok.encode(case["greedy_text"], parse_special=False, add_bos=False)[:N_FORCED]
        ids = np.asarray(case["prompt_ids"] + gen, dtype=np.int32)
        P = len(ids) - N_DECODE                  # prefill P tokens, then N_DECODE one-row steps
        lc = cpu.model.forward(ids, 0, cpu.new_cache(len(ids)), logits_from=0)      # (T, vocab)
        gpu.backend.reset_counters()
        gcache = gpu.new_cache(len(ids))
        rows = [gpu.model.forward(ids[:P], 0, gcache, logits_from=0)]               # (P, vocab)
        f16_p, int8_p = _gemms(gpu.backend.counters())
        gpu.backend.reset_counters()
        for j in range(P, len(ids)):
            rows.append(gpu.model.decode(int(ids[j]), j, gcache)[None])            # (1, vocab)
        f16_d, int8_d = _gemms(gpu.backend.counters())
        bound = parity_bound(f16_p, int8_p, 2 * n_layer)
        step_bound = parity_bound(f16_p + f16_d // N_DECODE, int8_d // N_DECODE, 2 * n_layer)
        got = np.concatenate(rows)
        assert got.shape == lc.shape and np.isfinite(got).all()
        assert int8_d == N_DECODE * (7 * n_layer + 1)          # every decode GEMM a matvec
        rel = rel_rows(got, lc)
        tag = repr(case["prompt"][:24])
        report(f"parity smollm2 {tag}: prefill of {P} rel max {rel[:P].max():.3e} (bound {bound:.2e}); "
               f"{N_DECODE} decode steps rel max {rel[P:].max():.3e} (bound {step_bound:.2e})")
        assert rel[:P].max() <= bound, tag
        assert rel[P:].max() <= step_bound, tag
        dec = decisive(lc, step_bound)
        bad = np.flatnonzero(dec & (got.argmax(-1) != lc.argmax(-1)))
        assert bad.size == 0, f"{tag}: top-1 differs at decisive positions {bad[:10]}"
