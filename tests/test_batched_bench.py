"""`minfer bench -npp -ntg -npl` (llama-batched-bench's mode) on the CPU backend with a
tiny synthetic model: the rows in llama-batched-bench's order, its column identities
between the printed figures, one forward_batch for a prefill and one per decode step
over disjoint blocks, the paged caches' sizes, and bad input as one line (no timing
assertions)."""
from __future__ import annotations

import csv
import io
import json
import math
import re
import statistics

import pytest

from minfer.tools.synth import write_synthetic

TINY = dict(n_layer=1, d_model=256, n_head=2, n_head_kv=1, d_ff=512)
KV_ROW_BYTES = 2 * TINY["n_layer"] * 1 * 128 * 4          # k and v, n_kv 1 x head_dim 128, float32


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("batched") / "tiny.gguf", seed=11, **TINY)


def _bench(capsys, *argv) -> tuple[int, str, str]:
    from minfer.cli import main
    capsys.readouterr()
    rc = main(["bench", "--backend", "cpu", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_batched_json_rows_and_identities(tiny_model, capsys):
    from minfer.tools.batched_bench import COLUMNS
    rc, out, err = _bench(capsys, "-m", tiny_model, "-npp", "8,70", "-ntg", "3", "-npl", "1,3", "-r", "3", "--json")
    assert rc == 0, err
    r = json.loads(out)
    # the run info of the pp/tg bench's -o json, the tests replaced by rows
    for k in ("minfer_version", "git_commit", "timestamp", "device", "driver", "cuda_driver", "cuda_runtime",
              "cpu", "model", "model_name", "size_bytes", "params", "backend", "seed", "n_ctx", "load_s",
              "memory", "memory_check", "counters"):
        assert k in r, k
    assert r["backend"] == "cpu" and r["reps"] == 3 and r["n_ctx"] == 73 and r["counters"] is None
    # PP outermost, then TG, then B, as llama-batched-bench loops
    assert [(x["pp"], x["tg"], x["b"]) for x in r["rows"]] == [(8, 3, 1), (8, 3, 3), (70, 3, 1), (70, 3, 3)]
    for x, secs, kv in zip(r["rows"], r["seconds"], r["kv"]):
        assert tuple(x) == COLUMNS
        pp, tg, b = x["pp"], x["tg"], x["b"]
        assert len(secs["t_pp"]) == len(secs["t_tg"]) == 3 and min(secs["t_pp"] + secs["t_tg"]) > 0
        assert x["t_pp"] == statistics.median(secs["t_pp"]) and x["t_tg"] == statistics.median(secs["t_tg"])
        assert x["n_kv"] == b * (pp + tg)
        assert math.isclose(x["s_pp"], b * pp / x["t_pp"]) and math.isclose(x["s_tg"], b * tg / x["t_tg"])
        assert math.isclose(x["t"], x["t_pp"] + x["t_tg"]) and math.isclose(x["s"], x["n_kv"] / x["t"])
        # each sequence its own blocks for PP + TG positions, and the pad block
        blocks = b * -(-(pp + tg) // 64) + 1
        assert (kv["pp"], kv["tg"], kv["b"]) == (pp, tg, b)
        assert kv["blocks"] == blocks and kv["positions"] == 64 * blocks
        assert kv["bytes"] == KV_ROW_BYTES * 64 * blocks
    assert r["memory"]["KV cache"] == max(kv["bytes"] for kv in r["kv"])      # taken at the largest test


def test_batched_table_is_llama_batched_benchs(tiny_model, capsys):
    rc, out, err = _bench(capsys, "-m", tiny_model, "-npp", "16", "-ntg", "2", "-npl", "2", "-r", "1")
    assert rc == 0, err
    lines = out.splitlines()
    head = "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |"
    i = lines.index(head)
    assert lines[i + 1] == "|-------|--------|------|--------|" + "----------|" * 6
    assert re.fullmatch(r"\|    16 \|      2 \|    2 \|     36 \|" + r" +\d+\.\d{3} \| +\d+\.\d{2} \|" * 3,
                        lines[i + 2]), lines[i + 2]
    assert lines[0].startswith("minfer ") and "| cpu on " in lines[0]
    blocks = 2 * 1 + 1
    assert f"| 16 | 2 | 2 | {blocks} | {64 * blocks} | {KV_ROW_BYTES * 64 * blocks:,} |" in out
    assert "| memory (largest test) | bytes | |" in out and "W_exp" not in out and "launch path" not in out


def test_batched_jsonl_and_csv(tiny_model, capsys):
    from minfer.tools.batched_bench import COLUMNS, RUN_KEYS
    argv = ("-m", tiny_model, "-npp", "8", "-ntg", "2", "-npl", "1,2", "-r", "1")
    rc, out, _ = _bench(capsys, *argv, "-o", "jsonl")
    recs = [json.loads(line) for line in out.splitlines()]
    assert rc == 0 and [rec["b"] for rec in recs] == [1, 2]
    assert all(tuple(rec) == (*RUN_KEYS, *COLUMNS) and rec["backend"] == "cpu" for rec in recs)
    rc, out, _ = _bench(capsys, *argv, "-o", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert rc == 0 and out.splitlines()[0].split(",") == [*RUN_KEYS, *COLUMNS]
    assert [(int(x["pp"]), int(x["b"]), int(x["n_kv"])) for x in rows] == [(8, 1, 10), (8, 2, 20)]


def test_one_forward_batch_per_prefill_and_per_step(tiny_model, capsys, monkeypatch):
    """The prefill is one forward_batch of B sequences from position 0; each decode
    step one of B single rows at PP + i; the sequences' blocks never overlap;
    nothing goes through the single-sequence forward."""
    from minfer.graph.transformer import Transformer
    from minfer.tools.batched_bench import WARMUP_STEPS
    calls = []
    real = Transformer.forward_batch

    def spy(self, tokens, batch, cache):
        calls.append([(s.pos0, s.n, s.table) for s in batch.spans])
        return real(self, tokens, batch, cache)

    def no_forward(*a, **k):
        raise AssertionError("the batched bench ran a single-sequence forward")

    monkeypatch.setattr(Transformer, "forward_batch", spy)
    monkeypatch.setattr(Transformer, "forward", no_forward)
    PP, TG, B, R = 70, 6, 3, 2
    rc, _, err = _bench(capsys, "-m", tiny_model, "-npp", PP, "-ntg", TG, "-npl", B, "-r", R, "--json")
    assert rc == 0, err
    per_run = 1 + TG
    assert len(calls) == (1 + min(TG, WARMUP_STEPS)) + R * per_run      # warm-up, then the timed runs
    for run in (calls[:1 + min(TG, WARMUP_STEPS)], calls[-per_run:]):
        prefill, steps = run[0], run[1:]
        assert [(p, n) for p, n, _ in prefill] == [(0, PP)] * B
        tables = [t for _, _, t in prefill]
        assert all(len(t) == 2 for t in tables)                          # 76 positions: 2 blocks each
        assert len({b for t in tables for b in t}) == 2 * B               # no block shared
        for i, step in enumerate(steps):
            assert step == [(PP + i, 1, t) for t in tables]


@pytest.mark.parametrize("argv, fragment", [
    (["-npp", "0", "-ntg", "4"], "-npp expects positive"),
    (["-npp", "8", "-ntg", "-3"], "-ntg expects positive"),
    (["-npp", "8", "-ntg", "1.5"], "-ntg expects comma-separated"),
    (["-npp", "8", "-ntg", "4", "-npl", "0"], "-npl expects positive sequence counts"),
    (["-npp", "8", "-ntg", "4", "-npl", "two"], "-npl expects comma-separated"),
    (["-npp", "8"], "needs both -npp"),
    (["-ntg", "8"], "needs both -npp"),
    (["-npl", "4"], "needs both -npp"),
    (["-npp", "8", "-ntg", "4", "-p", "16"], "cannot be mixed with -p"),
    (["-npp", "8", "-ntg", "4", "-n", "3"], "cannot be mixed with -n"),
    (["-npp", "8", "-ntg", "4", "-d", "3"], "cannot be mixed with -d"),
    (["-npp", "8", "-ntg", "4", "--plot", "x.png"], "cannot be mixed with --plot"),
    (["-npp", "8", "-ntg", "4", "-r", "0"], "-r must be at least 1"),
    (["-p", "16", "--deterministic"], "--deterministic is a batched-mode flag"),
])
def test_bad_input_before_the_model_opens(tmp_path, capsys, argv, fragment):
    rc, out, err = _bench(capsys, "-m", tmp_path / "missing.gguf", *argv)
    assert rc == 2 and out == ""
    assert err.startswith("minfer: error:") and err.count("\n") == 1 and fragment in err, err
    assert "missing.gguf" not in err


def test_beyond_the_context_before_the_weights_load(tiny_model, capsys, monkeypatch):
    from minfer.engine import Engine
    monkeypatch.setattr(Engine, "from_file", classmethod(lambda *a, **k: pytest.fail("weights loaded")))
    rc, out, err = _bench(capsys, "-m", tiny_model, "-npp", "8,4000", "-ntg", "97")   # 4097 > 4096
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "-npp 4000 with -ntg 97 is 4097 positions per sequence, beyond the model's context of 4096" in err


def test_a_cache_beyond_memory_fails_before_measuring(tiny_model, capsys, monkeypatch):
    """The largest test's paged cache is allocated before the first test is timed."""
    from minfer.graph.transformer import Transformer
    monkeypatch.setattr(Transformer, "forward_batch", lambda *a: pytest.fail("measured"))
    rc, out, err = _bench(capsys, "-m", tiny_model, "-npp", "8", "-ntg", "4", "-npl", "1,100000000")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("minfer: error: -npp 8 -ntg 4 -npl 100000000 does not fit:"), err


def test_the_deterministic_mode_is_measured_and_recorded(tiny_model, capsys):
    rc, out, err = _bench(capsys, "-m", tiny_model, "-npp", "8", "-ntg", "2", "-npl", "2", "-r", "1",
                          "--deterministic", "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert r["deterministic"] is True and len(r["rows"]) == 1


def test_the_pp_tg_bench_keeps_its_defaults(tiny_model, capsys):
    """-p, -n and -d default to None for the mixing check; the pp/tg bench fills in
    512,3325 / 128 / 16 as before (here given -p, to stay small)."""
    rc, out, err = _bench(capsys, "-m", tiny_model, "-p", "5", "-r", "1", "--json")
    assert rc == 0, err
    assert list(json.loads(out)["tests"]) == ["pp5", "tg128"]
