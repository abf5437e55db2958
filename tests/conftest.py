"""Shared test fixtures: where the fixtures live, the real model, GPU skipping."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
HEADER_7B = ROOT / "models" / "deepseek-r1-distill-qwen-7b-q4_k_m.header.gguf"


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


GPU_SKIP_REASON = _gpu_reason()


def pytest_collection_modifyitems(config, items):
    if GPU_SKIP_REASON is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {GPU_SKIP_REASON}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
