"""What tools and people read from the `minfer` command: `generate --json`, `--version`,
llama.cpp's input habits (escapes in -p, tokenize --show-count/--no-bos,
perplexity --chunks), the backend line of `auto`, no progress-bar noise in a
redirected stderr, no "nan tok/s"."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minfer.cli import main
from minfer.tools.synth import write_synthetic

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# the texts llama-tokenize was given with -p, and its ids, for the 7B's tokenizer
# (which the tiny model below carries)
DEEPSEEK_FIXTURE = json.loads((FIXTURES / "tokenizer_deepseek-r1-distill-qwen-7b.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("cli") / "tiny.gguf", seed=3, n_layer=1, d_model=256,
                           n_head=2, n_head_kv=1, d_ff=256)


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def minfer(*args, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """A real process with stdout and stderr redirected to pipes (not a terminal)."""
    return subprocess.run([sys.executable, "-m", "minfer", *map(str, args)], input=stdin,
                          capture_output=True, timeout=300, env={**os.environ, "COLUMNS": "80"})


def test_generate_json(tiny, capsys):
    rc, out, err = run(capsys, "generate", "-m", tiny, "-p", "hello world", "-n", "4", "--ignore-eos",
                       "--backend", "cpu", "--json")
    assert rc == 0, err
    assert out.count("\n") == 1                          # one object on one line, nothing streamed
    r = json.loads(out)
    assert set(r) == {"model", "backend", "prompt_ids", "ids", "text", "stop", "stop_string", "logprobs",
                      "n_prompt", "n_cached", "n_generated", "prompt_s", "decode_s", "prompt_tps", "decode_tps"}
    assert r["stop_string"] is None and r["logprobs"] is None          # no --stop; logprobs: Python only
    assert r["model"] == str(tiny) and r["backend"] == "cpu"
    assert all(isinstance(i, int) for i in r["prompt_ids"] + r["ids"])
    assert len(r["ids"]) == r["n_generated"] == 4 and r["stop"] == "max_tokens"
    assert r["n_prompt"] == len(r["prompt_ids"])
    assert isinstance(r["text"], str) and r["prompt_tps"] > 0 and r["decode_tps"] > 0
    rc, out2, _ = run(capsys, "tokenize", "-m", tiny, "-p", "hello world")
    assert json.loads(out2) == r["prompt_ids"]
    # the same generation streamed: exactly the JSON's text
    rc, streamed, err = run(capsys, "generate", "-m", tiny, "-p", "hello world", "-n", "4", "--ignore-eos",
                            "--backend", "cpu")
    assert rc == 0 and streamed == r["text"]
    assert "generation: 4 tokens" in err
    # without the warm-up run: the same text
    rc, cold, err = run(capsys, "generate", "-m", tiny, "-p", "hello world", "-n", "4", "--ignore-eos",
                        "--backend", "cpu", "--no-warmup")
    assert rc == 0 and cold == r["text"]


def test_one_token_prints_na_not_nan(tiny, capsys):
    rc, out, err = run(capsys, "generate", "-m", tiny, "-p", "hi", "-n", "1", "--ignore-eos", "--backend", "cpu")
    assert rc == 0 and "generation: 1 tokens, n/a tok/s" in err and "nan" not in err
    rc, out, err = run(capsys, "generate", "-m", tiny, "-p", "hi", "-n", "1", "--ignore-eos", "--backend", "cpu",
                       "--json")
    assert json.loads(out)["decode_tps"] is None


def test_version():
    from minfer.tools.runinfo import version
    r = minfer("--version")
    assert r.returncode == 0 and r.stderr == b""
    line = r.stdout.decode()
    assert line.startswith(f"minfer {version()}") and line.count("\n") == 1


ESCAPED = [c for c in DEEPSEEK_FIXTURE if "\\" in c["text"]]


@pytest.mark.parametrize("case", ESCAPED, ids=lambda c: c["text"][:16])
def test_p_escapes_match_llama_tokenize(tiny, capsys, case):
    """The fixture text as given to llama-tokenize -p: same ids here; --no-escape
    tokenizes the backslashes as written."""
    from minfer.engine import ModelFile
    rc, out, _ = run(capsys, "tokenize", "-m", tiny, "-p", case["text"])
    assert rc == 0 and json.loads(out) == case["ids_parse_special"]
    rc, out, _ = run(capsys, "tokenize", "-m", tiny, "-p", case["text"], "--no-parse-special")
    assert json.loads(out) == case["ids_no_parse_special"]
    rc, out, _ = run(capsys, "tokenize", "-m", tiny, "-p", case["text"], "--no-escape")
    literal = ModelFile.open(tiny).tokenizer.encode(case["text"])
    assert json.loads(out) == literal != case["ids_parse_special"]


def test_escapes_are_for_p_only(tiny, capsys, tmp_path, monkeypatch):
    """-f FILE and stdin are tokenized as written (a source file's "\\n" stays two characters)."""
    f = tmp_path / "p.txt"
    f.write_bytes(b"a\\nb")
    rc, from_file, _ = run(capsys, "tokenize", "-m", tiny, "-f", f)
    rc, literal, _ = run(capsys, "tokenize", "-m", tiny, "-p", "a\\nb", "--no-escape")
    rc, escaped, _ = run(capsys, "tokenize", "-m", tiny, "-p", "a\\nb")
    assert from_file == literal != escaped
    r = minfer("tokenize", "-m", tiny, "-f", "-", stdin=b"a\\nb")
    assert r.returncode == 0 and r.stdout.decode() == literal


def test_escape_to_invalid_utf8_is_named(tiny, capsys):
    rc, out, err = run(capsys, "tokenize", "-m", tiny, "-p", "ab\\xff")
    assert rc == 2 and out == ""
    assert err.strip() == ("minfer: error: -p (after escape processing; --no-escape keeps it as written) "
                           "is not valid UTF-8 (invalid start byte at byte 2)")
    rc, out, _ = run(capsys, "tokenize", "-m", tiny, "-p", "\\xc3\\xa9", "--no-bos")
    rc2, out2, _ = run(capsys, "tokenize", "-m", tiny, "-p", "\u00e9", "--no-bos")
    assert rc == rc2 == 0 and out == out2                # two byte escapes, one character


def test_tokenize_show_count_and_no_bos(tiny, capsys):
    rc, out, _ = run(capsys, "tokenize", "-m", tiny, "-p", "hello world", "--show-count")
    ids_line, count_line = out.splitlines()
    ids = json.loads(ids_line)
    assert count_line == f"Total number of tokens: {len(ids)}"
    rc, out, _ = run(capsys, "tokenize", "-m", tiny, "-p", "hello world", "--no-bos")
    assert json.loads(out) == ids[1:]                    # this model adds a BOS; --no-bos drops it


def test_perplexity_chunks(tiny, capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    # one chunk a forward (-b 32) both times: the same products, so the same digits (a
    # forward of 12 chunks against one of 2 may round differently in the BLAS,
    # whose summation order can depend on the row count: tests/test_batched_perplexity.py
    # compares batched forwards with a tolerance)
    rc, full, err = run(capsys, "perplexity", "-m", tiny, "-f", text, "-c", "32", "-b", "32", "--backend", "cpu")
    assert rc == 0, err
    n_full = full.count("[")
    assert n_full > 2
    rc, two, _ = run(capsys, "perplexity", "-m", tiny, "-f", text, "-c", "32", "-b", "32", "--chunks", "2",
                     "--backend", "cpu")
    assert rc == 0 and two.count("[") == 2
    assert full.startswith(two.split("\n")[0])             # the same first two running values
    rc, _, err = run(capsys, "perplexity", "-m", tiny, "-f", text, "-c", "32", "--chunks", "0")
    assert rc == 2 and "--chunks must be at least 1" in err


def test_redirected_stderr_has_no_progress_bars_and_names_the_backend(tiny, gpu_skip_reason):
    """Not a terminal: no carriage-return bar updates; `auto` says which backend it
    took in one line, and -q drops that line."""
    r = minfer("generate", "-m", tiny, "-p", "hello", "-n", "3", "--ignore-eos")
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.strip()]     # the text ends before a \n
    want = "cpu" if gpu_skip_reason else "cuda"
    assert len(lines) == 2 and lines[0].startswith(f"minfer: backend {want} (")
    assert lines[1].startswith("prompt: ") and lines[1].endswith(f"[{want}]")
    r = minfer("generate", "-m", tiny, "-p", "hello", "-n", "3", "--ignore-eos", "-q")
    assert r.stderr.decode().strip().startswith("prompt: ")


@pytest.mark.parametrize("cmd", ["generate", "perplexity", "bench"])
def test_backend_defaults_to_auto(cmd):
    if cmd == "bench":
        import argparse

        from minfer.tools import bench
        p = argparse.ArgumentParser()
        bench.add_arguments(p)
        args = p.parse_args(["-m", "x"])
    else:
        from minfer.cli import build_parser
        args = build_parser().parse_args([cmd, "-f", "x"])
    assert args.backend == "auto"
