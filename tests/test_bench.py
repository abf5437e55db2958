"""`minfer bench` and scripts/ab.py on the CPU backend with a tiny synthetic model:
the report has every key and the numbers are positive (no timing assertions)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from minfer.synth import write_synthetic

TINY = dict(n_layer=1, d_model=256, n_head=2, n_head_kv=1, d_ff=512)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("bench") / "tiny.gguf", seed=11, **TINY)


def test_bench_json_cpu(tiny_model, capsys):
    from minfer.cli import main
    assert main(["bench", "-m", str(tiny_model), "--backend", "cpu",
                 "-p", "8,13", "-r", "2", "-n", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["backend"] == "cpu"
    assert r["size_bytes"] == tiny_model.stat().st_size
    assert r["params"] > 152064 * 256 * 2 and r["load_s"] > 0
    assert set(r["tests"]) == {"pp8", "pp13", "tg2"}
    for name, n in (("pp8", 8), ("pp13", 13), ("tg2", 2)):
        t = r["tests"][name]
        assert t["n_tokens"] == n and t["reps"] == 2
        assert len(t["seconds"]) == len(t["tok_s"]) == 2 and min(t["seconds"]) > 0
        assert t["min"] <= t["median"] <= t["max"] and t["stdev"] >= 0 and t["min"] > 0
    m = r["memory"]
    # the CPU cache holds k and v, (n_layer, n_ctx, n_kv, hd) float32 each
    assert m["KV cache"] == 2 * TINY["n_layer"] * r["n_ctx"] * 1 * 128 * 4
    assert m["host peak RSS"] > 0
    assert r["counters"] is None                # the CPU backend has no launch paths
    assert r["memory_check"] == {}              # nor W_exp planes to check


def test_bench_table_cpu(tiny_model, capsys):
    from minfer.cli import main
    assert main(["bench", "-m", str(tiny_model), "--backend", "cpu", "-p", "5", "-r", "1", "-n", "0"]) == 0
    out = capsys.readouterr().out
    assert "| model | size | params | backend | test | t/s |" in out
    assert "| pp5 |" in out and "tg" not in out.split("| test | reps")[0].split("t/s |")[1]


@pytest.mark.parametrize("argv, word", [(["-p", "0"], "positive"), (["-p", "x"], "comma"),
                                        (["-r", "0"], "-r")])
def test_bench_bad_input(tiny_model, capsys, argv, word):
    from minfer.cli import main
    assert main(["bench", "-m", str(tiny_model), "--backend", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minfer: error:") and word in err and err.count("\n") == 1


def test_ab_cpu(tiny_model, repo_root):
    """Two engines (settings not switchable at run time), interleaved A B A B."""
    p = subprocess.run([sys.executable, str(repo_root / "scripts" / "ab.py"), "-m", str(tiny_model),
                        "--backend", "cpu", "-p", "9", "-r", "3", "--a", "MINFER_X=1",
                        "--b", "MINFER_X=0", "--json"],
                       capture_output=True, text=True, timeout=300, cwd=repo_root)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["mode"] == "two engines" and r["order"] == ["A", "B"] * 3
    for side in ("A", "B"):
        assert len(r[side]["tok_s"]) == 3 and min(r[side]["tok_s"]) > 0
    assert r["ratio_b_over_a"] > 0 and isinstance(r["separated"], bool)


def test_format_report_device_rows():
    """The CUDA-only rows (memory by kind, planes beside their expected od x id sum,
    launch paths) render; a mismatch is shown as such."""
    from minfer.bench import format_report
    t = {"n_tokens": 4, "reps": 2, "seconds": [0.5, 0.25], "tok_s": [8.0, 16.0],
         "median": 12.0, "min": 8.0, "max": 16.0, "stdev": 5.66}
    r = {"model_name": "m.gguf", "size_bytes": 3 << 30, "params": 7_615_616_512, "backend": "cuda",
         "load_s": 1.5, "tests": {"pp4": t},
         "memory": {"q4_K weights": 10, "q6_K padded": 20, "W_exp planes": 30, "KV cache": 1024,
                    "device used": 7},
         "memory_check": {"W_exp planes expected": 30, "problem": None},
         "counters": {"q6k exp": 27, "q6k fallback!": 0}}
    out = format_report(r)
    assert "| m.gguf | 3.00 GiB | 7.62 B | cuda | pp4 | 12.00 ± 5.66 |" in out
    assert "| q4_K weights | 10 |" in out and "| q6_K padded | 20 |" in out
    assert "| W_exp planes | 30 | expected od×id over the tensor table = 30: OK |" in out
    assert "| device used | 7 |" in out and "| q6k exp | 27 |" in out
    r["memory_check"] = {"W_exp planes expected": 40, "problem": "planes hold 30, needs 40"}
    assert "= 40: MISMATCH: planes hold 30, needs 40 |" in format_report(r)
