"""The golden greedy streams on the GPU: equal to tests/golden/*.json byte for
byte, and byte-identical in the three q6_K modes (all three accumulate in the
same order) and with either prompt attention kernel, each mode with its liveness
counters:

    exp       (default)                  exp > 0, fallback! == 0; flash wgmma on Hopper
    exp=off   MINFER_MMQ_Q6K_EXP=0       only exp=off, no planes (plane_bytes == 0)
    fallback! MINFER_TEST_FORCE_EXP_MISS=1  fallback! > 0
    flash=mma MINFER_FLASH_WGMMA=0       flash mma only (the mma.sync kernel)

Each mode runs `scripts/golden.py --report` in its own process, since the
variables are read when the backend is created (CudaSettings.from_env).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
GOLDEN = sorted((ROOT / "tests" / "golden").glob("*.json"))
MODES = {
    "exp": {},
    "exp=off": {"MINFER_MMQ_Q6K_EXP": "0"},
    "fallback!": {"MINFER_TEST_FORCE_EXP_MISS": "1"},
    "flash=mma": {"MINFER_FLASH_WGMMA": "0"},
}
EXP, OFF, MISS = "q6k exp", "q6k exp=off", "q6k fallback!"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synth_dir):
    if not GOLDEN:
        pytest.skip("no golden files in tests/golden (make them: python scripts/golden.py --update)")
    tmp = tmp_path_factory.mktemp("golden")
    model_dir = str(synth_dir)
    out = {}
    for mode, extra in MODES.items():
        env = {k: v for k, v in os.environ.items()
               if k not in ("MINFER_MMQ_Q6K_EXP", "MINFER_TEST_FORCE_EXP_MISS", "MINFER_FLASH_WGMMA")}
        env.update(extra, MINFER_MMQ_RAW_NB_DEBUG="1")
        rep = tmp / f"{mode.replace('!', '').replace('=', '_')}.json"
        p = subprocess.run([sys.executable, str(ROOT / "scripts" / "golden.py"), "--report", str(rep),
                            "--model-dir", model_dir], env=env, capture_output=True, text=True,
                           timeout=600)
        out[mode] = (p, json.loads(rep.read_text()) if rep.is_file() else None)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_stream_equals_golden(runs, mode):
    p, rep = runs[mode]
    assert rep is not None, f"{mode}: no report\n{p.stdout}\n{p.stderr}"
    assert p.returncode == 0, f"{mode}: streams differ from tests/golden\n{p.stdout}\n{p.stderr[-3000:]}"


def test_modes_byte_identical(runs):
    streams = {m: runs[m][1]["streams"] for m in MODES if runs[m][1] is not None}
    assert len(streams) == len(MODES)
    ref = streams["exp"]
    for mode, s in streams.items():
        for name in ref:
            assert s[name]["token_ids"] == ref[name]["token_ids"], f"{mode}/{name}: token ids"
            assert s[name]["text"].encode() == ref[name]["text"].encode(), f"{mode}/{name}: text"


def test_liveness_counters(runs):
    c = {m: runs[m][1]["counters"] for m in MODES}
    planes = {m: runs[m][1]["plane_bytes"] for m in MODES}
    assert c["exp"].get(EXP, 0) > 0 and c["exp"].get(MISS, 0) == 0, c["exp"]
    assert planes["exp"] > 0
    assert c["exp=off"].get(OFF, 0) > 0, c["exp=off"]
    assert c["exp=off"].get(EXP, 0) == 0 and c["exp=off"].get(MISS, 0) == 0, c["exp=off"]
    assert planes["exp=off"] == 0
    assert c["fallback!"].get(MISS, 0) > 0, c["fallback!"]
    # the prompt attention: the default's kernel is the one this GPU has (flash_kind)
    from minfer.backend.cuda.attention import flash_kind
    kind = flash_kind(True)
    assert c["exp"].get(f"flash {kind}", 0) > 0, c["exp"]
    assert c["exp"].get("flash wgmma" if kind == "mma" else "flash mma", 0) == 0, c["exp"]
    assert c["flash=mma"].get("flash mma", 0) > 0 and c["flash=mma"].get("flash wgmma", 0) == 0, c["flash=mma"]
