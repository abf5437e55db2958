"""Shared test fixtures: repository paths, the real model, GPU skipping, the
synthetic-model cache, and the tolerances of the GPU-vs-CPU comparisons.

Test modules take these as fixture arguments; none imports this file.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


# --- paths ------------------------------------------------------------------------

@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """tests/fixtures: llama.cpp's outputs and real weight slices."""
    return ROOT / "tests" / "fixtures"


@pytest.fixture(scope="session")
def header_7b() -> Path:
    """The DeepSeek-R1-Distill-Qwen-7B Q4_K_M header in models/: metadata (vocabulary,
    chat template) and tensor table, no tensor data (open it with header_only=True)."""
    return ROOT / "models" / "deepseek-r1-distill-qwen-7b-q4_k_m.header.gguf"


# --- GPU ----------------------------------------------------------------------------

def _gpu_reason() -> str | None:
    """None if a CUDA device is usable through cupy, else why not."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - any import failure means no GPU path
        return f"cupy not importable ({type(e).__name__})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as e:  # noqa: BLE001
        return f"no CUDA device ({type(e).__name__})"
    return None


_GPU_SKIP_REASON = _gpu_reason()


def pytest_collection_modifyitems(config, items):
    if _GPU_SKIP_REASON is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {_GPU_SKIP_REASON}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_skip_reason() -> str | None:
    """None where a CUDA device is usable, else why not (`gpu` tests skip with it)."""
    return _GPU_SKIP_REASON


# --- the real model -------------------------------------------------------------------

@pytest.fixture(scope="session")
def real_model_path() -> Path:
    """The real Qwen2.5-Coder-1.5B-Instruct Q4_K_M, fetched once by `minfer pull`.

    MINFER_SKIP_MODEL_TESTS=1 skips these tests (the GPU machine, where the model
    cannot travel); CI always runs them.
    """
    if os.environ.get("MINFER_SKIP_MODEL_TESTS") == "1":
        pytest.skip("real model tests disabled (MINFER_SKIP_MODEL_TESTS=1)")
    from minfer.pull import ensure_model
    return Path(ensure_model())


@pytest.fixture(scope="session")
def real_engine(real_model_path):
    """One CPU engine on the real model per test session (loading dequantizes
    ~1.3 G weights)."""
    from minfer.engine import Engine
    t0 = time.perf_counter()
    eng = Engine.load(str(real_model_path), backend="cpu", n_ctx=2048, progress=False)
    print(f"\n[model] CPU engine load: {time.perf_counter() - t0:.1f} s")
    return eng


SMOLLM2 = "smollm2-135m-instruct-q4_1"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 (llama architecture, 98 MB), fetched once by
    `minfer pull smollm2-135m-instruct-q4_1`.

    MINFER_SMOLLM2_PATH names a copy carried to a machine that cannot pull it (the
    GPU machine, where the file arrives in pieces); it must match the manifest's size
    and sha256, and it is used even where MINFER_SKIP_MODEL_TESTS=1 skips the
    pulled models."""
    from minfer.pull import load_manifest, sha256_file
    carried = os.environ.get("MINFER_SMOLLM2_PATH")
    if carried:
        path, m = Path(carried), load_manifest(SMOLLM2)
        assert path.is_file() and path.stat().st_size == m.size, \
            f"MINFER_SMOLLM2_PATH={carried}: not a file of {m.size} bytes"
        assert sha256_file(path) == m.sha256, f"MINFER_SMOLLM2_PATH={carried}: sha256 differs from the manifest"
        return path
    if os.environ.get("MINFER_SKIP_MODEL_TESTS") == "1":
        pytest.skip("real model tests disabled (MINFER_SKIP_MODEL_TESTS=1, no MINFER_SMOLLM2_PATH)")
    from minfer.pull import ensure_model
    return Path(ensure_model(SMOLLM2))


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_path):
    """One CPU engine on SmolLM2-135M per test session (0.1 G weights, ~1 s to load)."""
    from minfer.engine import Engine
    return Engine.load(str(smollm2_path), backend="cpu", n_ctx=2048, progress=False)


@pytest.fixture(scope="session")
def check_perplexity(fixtures_dir):
    """-> check(engine, tag, llama_ppl, llama_running, rtol_running): llama.cpp's
    perplexity method on tests/fixtures/perplexity_gpl3.txt at n_ctx 512, printed
    beside llama.cpp's figures and held to them: the same chunks and scored tokens,
    the final value within 1%, the running values within rtol_running."""
    def check(engine, tag: str, llama_ppl: float, llama_running: list, rtol_running: float) -> None:
        from minfer.perplexity import perplexity
        text = (fixtures_dir / "perplexity_gpl3.txt").read_text(encoding="utf-8")
        t0 = time.perf_counter()
        res = perplexity(engine, text, n_ctx=512, progress=False)
        dt = time.perf_counter() - t0
        print(f"\n[{tag}] perplexity n_ctx 512: {res.n_chunks} chunks, PPL {res.ppl:.4f} +/- {res.err:.4f} "
              f"(llama.cpp {llama_ppl}: {res.ppl / llama_ppl - 1:+.2%}), {dt:.0f} s "
              f"({dt / res.n_chunks:.1f} s per 512-token chunk)")
        print(f"[{tag}] running: " + ",".join(f"[{i + 1}]{p:.4f}" for i, p in enumerate(res.running)))
        assert res.n_chunks == len(llama_running)
        assert res.count == res.n_chunks * 255
        assert abs(res.ppl / llama_ppl - 1) < 0.01
        np.testing.assert_allclose(res.running, llama_running, rtol=rtol_running)
    return check


# --- synthetic models -------------------------------------------------------------------

@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory) -> Path:
    """Where minfer.tools.synth.synth_model caches its models: $MINFER_CACHE when set
    (kept across runs and shared with scripts/check/golden.py), else one temporary
    directory for the session, so each model is written once per session."""
    d = os.environ.get("MINFER_CACHE")
    return Path(d) if d else tmp_path_factory.mktemp("synth")


# --- tolerances of the GPU-vs-CPU comparisons ---------------------------------------------
#
# Shared by the GPU-vs-CPU parity test (tests/gpu/test_parity.py) and the CPU check
# of the golden streams (tests/test_golden_cpu.py).
#
# The bound is on ||logits_gpu - logits_cpu|| / ||logits_cpu|| per position, and it
# depends on the arithmetic of the GEMM engines on the path. Model: every rounding
# step adds an independent relative error to the values it touches; independent
# errors add in quadrature, and with weights of std 1/sqrt(n_in) nothing damps or
# amplifies them on the way to the logits. The bound is twice the estimate.
#
# int8 MMQ GEMM: each activation block of 32 is rounded to int8 with scale
# max|x|/127, so each element moves by at most 1/254 of its block max, uniformly:
# RMS max/(254*sqrt(3)) ~ max/440. For Gaussian-like blocks max/rms ~ 2.4, so each
# such GEMM adds ~0.55% relative noise to its output (the f16 block scales add < 0.05%).
INT8_GEMM_REL = 5.5e-3
# f16 rounding (round to nearest even, unit roundoff u = 2^-11): a relative error
# uniform in [-u, u], RMS u/sqrt(3) = 2.8e-4 per rounded value.
F16_ROUND_REL = 2.0 ** -11 / np.sqrt(3.0)
# f16 engine GEMM: both operands rounded to f16 once (the dequantized weight and the
# activation), exact products, f32 sums: sqrt(2) roundings' worth.
F16_GEMM_REL = np.sqrt(2.0) * F16_ROUND_REL
# other f16 roundings per layer on the GPU path: q, k and v (the f16 KV cache and
# the flash attention's q) and the probabilities P; the gate and up outputs of the
# fused f16 FFN (its swiglu output is the down GEMM's operand, counted there)
F16_ROUNDINGS_PER_LAYER = 6
SAFETY = 2.0


def _parity_bound(f16_gemms: int, int8_gemms: int, f16_roundings: int) -> float:
    """The per-position relative logits error allowed for a forward whose path holds
    these GEMMs (int8: MMQ or matvec, both on q8_1 activations) and extra f16 roundings."""
    var = (f16_gemms * F16_GEMM_REL ** 2 + int8_gemms * INT8_GEMM_REL ** 2
           + f16_roundings * F16_ROUND_REL ** 2)
    return float(SAFETY * np.sqrt(var))


# The int8 engine's bound for the 3-layer synthetic model: 7 * 3 + 1 (LM head) = 22
# MMQ GEMMs on the path, sqrt(22) * 0.55% ~ 2.6%, twice that ~ 5e-2. It judges which
# positions are decisive wherever the engine is not pinned (the golden streams).
PARITY_REL = 5e-2

# A position's top-1 is "decisive" when the CPU's top-1 - top-2 logit margin
# exceeds TOP1_SIGMAS times the largest per-element error the bound allows on
# average, bound * rms(logits row): with per-element errors of RMS
# sigma <= bound * rms, the difference of two has RMS sqrt(2)*sigma, and
# 6 sigma-units (4.2 of the difference) leave a flip probability < 1e-5 per position.
TOP1_SIGMAS = 6.0


def _decisive(logits: np.ndarray, bound: float = PARITY_REL) -> np.ndarray:
    """logits (n, vocab) float -> bool (n,): where the top-1 must agree across backends
    whose logits differ by at most `bound` (relative, per position)."""
    top2 = np.partition(logits, -2, axis=-1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    rms = np.sqrt(np.mean(np.square(logits, dtype=np.float64), axis=-1))
    return margin > TOP1_SIGMAS * bound * rms


@pytest.fixture(scope="session")
def parity_rel() -> float:
    """PARITY_REL: the int8 engine's per-position relative logits error (3-layer model)."""
    return PARITY_REL


@pytest.fixture(scope="session")
def parity_bound():
    """The function (f16_gemms, int8_gemms, f16_roundings) -> allowed relative error."""
    return _parity_bound


@pytest.fixture(scope="session")
def decisive():
    """The function (logits (n, vocab), bound=PARITY_REL) -> bool (n,): positions
    whose top-1 must agree."""
    return _decisive


# --- the CUDA backend's weights and linears without a model ---------------------------------

def _cuda_parts(settings):
    """minfer.backend.cuda.parts.Parts (a test's RMSNorm eps), with layer(): a layer's
    FFN weights as FFN reads them (graph/weights.py's LayerWeights)."""
    from types import SimpleNamespace

    from minfer.backend.cuda.parts import Parts
    parts = Parts(settings, eps=1e-6)
    parts.layer = lambda gate, up, down, norm=None: SimpleNamespace(ffn_gate=gate, ffn_up=up, ffn_down=down,
                                                                    ffn_norm=norm)
    return parts


@pytest.fixture()
def cuda_linears(monkeypatch):
    """Factory: (**settings) -> (WeightStore, Parts) of the CUDA backend with the
    default CudaSettings changed by **settings, and the once-per-process plane-miss
    warning re-armed."""
    from minfer.backend.cuda import weights
    from minfer.backend.cuda.settings import CudaSettings
    monkeypatch.setattr(weights, "_warned_miss", False)

    def make(**changes):
        parts = _cuda_parts(CudaSettings(**changes))
        return parts.store, parts
    return make
