"""`minfer bench` on the CPU backend with a tiny synthetic model: the report has every
key and the numbers are positive (no timing assertions). The scripts around it
(scripts/bench/ab.py, ...) are tested in test_scripts.py."""
from __future__ import annotations

import json
import sys

import pytest

from minfer.tools.synth import write_synthetic

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


def _bench(capsys, tiny_model, *argv) -> tuple[int, str, str]:
    from minfer.cli import main
    capsys.readouterr()
    rc = main(["bench", "-m", str(tiny_model), "--backend", "cpu", "-p", "8,13", "-r", "2", "-n", "2",
               *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def _check_provenance(rec: dict) -> None:
    from datetime import datetime

    from minfer.tools.runinfo import git_commit, host_cpu, version
    assert rec["minfer_version"] == version() and rec["git_commit"] == git_commit()
    datetime.strptime(rec["timestamp"], "%Y-%m-%dT%H:%M:%SZ")           # ISO 8601, UTC
    assert rec["backend"] == "cpu" and rec["device"] == rec["cpu"] == host_cpu()
    assert rec["driver"] is None and rec["cuda_driver"] is None and rec["cuda_runtime"] is None


@pytest.mark.parametrize("flags", [["-o", "json"], ["--json"]])
def test_bench_json_carries_provenance(tiny_model, capsys, flags):
    rc, out, _ = _bench(capsys, tiny_model, *flags)
    r = json.loads(out)
    _check_provenance(r)
    assert [(t["n_prompt"], t["n_gen"], t["n_depth"]) for t in r["tests"].values()] == \
        [(8, 0, 0), (13, 0, 0), (0, 2, 16)]


def test_bench_jsonl_and_csv_records(tiny_model, capsys):
    import csv
    import io

    from minfer.tools.bench import RECORD_KEYS
    rc, out, _ = _bench(capsys, tiny_model, "-o", "jsonl")
    recs = [json.loads(line) for line in out.splitlines()]
    assert [r["test"] for r in recs] == ["pp8", "pp13", "tg2"]
    for r in recs:
        _check_provenance(r)
        assert set(r) == set(RECORD_KEYS) | {"seconds", "tok_s"}
        assert len(r["tok_s"]) == r["reps"] == 2 and r["min_tok_s"] <= r["median_tok_s"] <= r["max_tok_s"]
    rc, out, _ = _bench(capsys, tiny_model, "-o", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert out.splitlines()[0].split(",") == list(RECORD_KEYS)
    assert [r["test"] for r in rows] == ["pp8", "pp13", "tg2"]
    assert [int(r["n_prompt"]) for r in rows] == [8, 13, 0] and float(rows[2]["median_tok_s"]) > 0
    assert rows[0]["minfer_version"] == recs[0]["minfer_version"] and rows[0]["driver"] == ""


def test_bench_md_names_what_made_it(tiny_model, capsys):
    from minfer.tools.runinfo import version
    rc, out, _ = _bench(capsys, tiny_model, "-o", "md")
    first = out.splitlines()[0]
    assert first.startswith(f"minfer {version()}") and "| cpu on " in first and first.endswith("Z")
    assert "| pp13 |" in out


def test_bench_plot(tiny_model, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    rc, out, err = _bench(capsys, tiny_model, "-p", "8,16,32", "-d", "4,12", "-r", "1", "--plot", png)
    assert rc == 0, err
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert f"plot written to {png}" in err


def test_plot_a_saved_report(tiny_model, capsys, tmp_path):
    """A report saved with -o json (where matplotlib is missing: the GPU machine) drawn later."""
    pytest.importorskip("matplotlib")
    from minfer.tools.plot import main as plot_main
    rc, out, _ = _bench(capsys, tiny_model, "-o", "json")
    report = tmp_path / "r.json"
    report.write_text(out)
    assert plot_main([str(report), str(tmp_path / "r.png")]) == 0
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    report.write_text("[1, 2]")
    assert plot_main([str(report), str(tmp_path / "s.png")]) == 2
    assert "not a `minfer bench -o json` report" in capsys.readouterr().err


@pytest.mark.parametrize("target, fragment", [("sweep.png", "pip install 'minfer[plot]'"),
                                              ("sweep.nope", "cannot tell the image type"),
                                              ("no/such/dir/sweep.png", "no folder")])
def test_bench_plot_errors_before_measuring(tiny_model, capsys, tmp_path, monkeypatch, target, fragment):
    if target.endswith(".png") and "/" not in target:
        monkeypatch.setitem(sys.modules, "matplotlib.figure", None)     # as if not installed
    else:
        pytest.importorskip("matplotlib")
    rc, out, err = _bench(capsys, tiny_model, "--plot", tmp_path / target)
    assert rc == 2 and out == ""                       # refused before anything ran
    assert err.startswith("minfer: error:") and fragment in err and err.count("\n") == 1


def test_bench_table_cpu(tiny_model, capsys):
    from minfer.cli import main
    assert main(["bench", "-m", str(tiny_model), "--backend", "cpu", "-p", "5", "-r", "1", "-n", "0"]) == 0
    out = capsys.readouterr().out
    assert "| model | size | params | backend | test | t/s |" in out
    assert "| pp5 |" in out and "tg" not in out.split("| test | reps")[0].split("t/s |")[1]
    # nothing of the GPU's: no W_exp planes, no launch paths, no 0.00 GiB rows
    assert "\nload: " in out and " s (file to cpu memory)\n" in out
    assert "W_exp" not in out and "launch path" not in out and "0.00 GiB" not in out
    kv = 2 * TINY["n_layer"] * 16 * 1 * 128 * 4       # k and v, float32; n_ctx: -d 16 (default) + -n 0
    assert f"| KV cache | {kv:,} | {kv / 1024:.1f} KiB |" in out


def test_bench_without_m_uses_the_default_model(tiny_model, capsys, monkeypatch):
    """As generate and perplexity do: no -m is the default model, pulled on first use."""
    import minfer.pull
    from minfer.cli import main
    asked = []
    monkeypatch.setattr(minfer.pull, "ensure_model", lambda name=None, progress=True: asked.append(progress)
                        or tiny_model)
    assert main(["bench", "--backend", "cpu", "-p", "5", "-r", "1", "-n", "0", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["model"] == str(tiny_model) and asked == [True]
    # bad input is refused before a download
    assert main(["bench", "--backend", "cpu", "-r", "0"]) == 2 and asked == [True]


@pytest.mark.parametrize("argv, word", [(["-p", "0"], "positive"), (["-p", "x"], "comma"),
                                        (["-r", "0"], "-r")])
def test_bench_bad_input(tiny_model, capsys, argv, word):
    from minfer.cli import main
    assert main(["bench", "-m", str(tiny_model), "--backend", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minfer: error:") and word in err and err.count("\n") == 1


def test_format_report_device_rows():
    """The CUDA-only rows (memory by kind, planes beside their expected od x id sum,
    launch paths) render; a mismatch is shown as such."""
    from minfer.tools.bench import format_report
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
    assert "s (file to cuda memory, W_exp planes included where registered)" in out
    r["memory_check"] = {"W_exp planes expected": 40, "problem": "planes hold 30, needs 40"}
    assert "= 40: MISMATCH: planes hold 30, needs 40 |" in format_report(r)
