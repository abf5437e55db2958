"""The golden greedy streams on the GPU: equal to tests/golden/*.json byte for
byte, and byte-identical in the three q6_K modes (all three accumulate in the
same order) and with either prompt attention kernel, each mode with its liveness
counters:

    exp       (default)                  exp > 0, fallback! == 0; the wgmma flash kernel on Hopper
    exp=off   MINFER_MMQ_Q6K_EXP=0       only exp=off, no planes (plane_bytes == 0)
    fallback! --set force_exp_miss=1     fallback! > 0
    flash=mma --set flash_wgmma=0        the mma.sync flash kernel only

Each mode runs `python3 -m scripts.check.golden --report` in its own process: the
planes are registered (or not) when the weights load.
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
MODES = {                                 # mode -> (environment, --set fields)
    "exp": ({}, []),
    "exp=off": ({"MINFER_MMQ_Q6K_EXP": "0"}, []),
    "fallback!": ({}, ["force_exp_miss=1"]),
    "flash=mma": ({}, ["flash_wgmma=0"]),
}
EXP, OFF, MISS = "q6k exp", "q6k exp=off", "q6k fallback!"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synth_dir):
    if not GOLDEN:
        pytest.skip("no golden files in tests/golden (make them: python3 -m scripts.check.golden --update)")
    tmp = tmp_path_factory.mktemp("golden")
    model_dir = str(synth_dir)
    out = {}
    for mode, (extra, fields) in MODES.items():
        env = {k: v for k, v in os.environ.items() if k != "MINFER_MMQ_Q6K_EXP"}
        env.update(extra)
        rep = tmp / f"{mode.replace('!', '').replace('=', '_')}.json"
        sets = [a for f in fields for a in ("--set", f)]
        p = subprocess.run([sys.executable, "-m", "scripts.check.golden", "--report", str(rep),
                            "--model-dir", model_dir, *sets], env=env, cwd=ROOT, capture_output=True,
                           text=True, timeout=600)
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
    from minfer.backend.cuda.kernels.flash_attn import KERNEL, flash_kind
    kind = flash_kind(True)
    other = "mma" if kind == "wgmma" else "wgmma"
    assert c["exp"].get(KERNEL[kind], 0) > 0, c["exp"]
    assert c["exp"].get(KERNEL[other], 0) == 0, c["exp"]
    assert c["flash=mma"].get(KERNEL["mma"], 0) > 0 and c["flash=mma"].get(KERNEL["wgmma"], 0) == 0, c["flash=mma"]
