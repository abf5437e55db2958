"""The `minfer` command as a user runs it (subprocess `python -m minfer`): bad input is
one line on stderr and exit code 2, never a traceback; tokenize and generate output."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest


def minfer(*args, env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minfer", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def assert_one_line_error(r: subprocess.CompletedProcess, *fragments: str):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minfer: error: "), r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    assert r.stdout == ""


def test_missing_model_file(tmp_path):
    assert_one_line_error(minfer("generate", "-m", tmp_path / "nope.gguf", "-p", "hi"), "nope.gguf")


def test_missing_prompt_file(tmp_path):
    assert_one_line_error(minfer("generate", "-m", tmp_path / "x.gguf", "-f", tmp_path / "p.txt"), "p.txt")


def test_malformed_gguf(tmp_path, header_7b):
    rng = np.random.default_rng(4)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + rng.integers(0, 256, 999, dtype=np.uint8).tobytes())
    assert_one_line_error(minfer("generate", "-m", garbage, "-p", "hi"), "garbage.gguf")
    truncated = tmp_path / "truncated.gguf"                # a real header cut inside the metadata
    truncated.write_bytes(header_7b.read_bytes()[:200_003])
    assert_one_line_error(minfer("tokenize", "-m", truncated, "-p", "hi"), "truncated.gguf")
    text = tmp_path / "notes.gguf"
    text.write_text("this is not a model\n")
    assert_one_line_error(minfer("generate", "-m", text, "-p", "hi"), "notes.gguf")


def test_unsupported_architecture(tmp_path):
    import gguf
    path = tmp_path / "gptj.gguf"
    w = gguf.GGUFWriter(str(path), "gptj")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((3, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_one_line_error(minfer("generate", "-m", path, "-p", "hi"), "unsupported architecture", "gptj")


def test_empty_prompt(tmp_path):
    assert_one_line_error(minfer("generate", "-m", tmp_path / "x.gguf", "-p", ""), "empty prompt")


def test_argument_errors_are_one_line():
    assert_one_line_error(minfer("generate", "-n", "5"), "-p/--prompt")
    assert_one_line_error(minfer("generate", "-p", "x", "-n", "many"), "invalid int")
    assert_one_line_error(minfer("frobnicate"), "frobnicate")


@pytest.mark.model
def test_prompt_longer_than_the_context(real_model_path):
    r = minfer("generate", "-m", real_model_path, "-c", "16", "-p", "word " * 40)
    assert_one_line_error(r, "longer than the context of 16")


@pytest.mark.parametrize("argv", [["generate", "-p", "hi"], ["perplexity", "-f", "text.txt"],
                                  ["bench", "-p", "8"]])
def test_unknown_backend_is_refused_when_parsing(tmp_path, argv):
    """Before the model is opened: the missing file is not what the error names."""
    r = minfer(*argv, "-m", tmp_path / "missing.gguf", "--backend", "tpu")
    assert_one_line_error(r, "--backend", "invalid choice", "'tpu'", f"minfer {argv[0]} --help")
    assert "missing.gguf" not in r.stderr


@pytest.mark.parametrize("flags, match", [(["--temp", "-1"], "temperature=-1.0"), (["--top-p", "0"], "top_p=0.0"),
                                          (["--top-k", "-3"], "top_k=-3"), (["--min-p", "2"], "min_p=2.0"),
                                          (["--repeat-penalty", "0"], "repeat_penalty=0.0"),
                                          (["--seed", "-5"], "seed=-5")])
def test_bad_sampling_flags_are_refused_before_the_model_opens(tmp_path, flags, match):
    r = minfer("generate", "-m", tmp_path / "missing.gguf", "-p", "hi", *flags)
    assert_one_line_error(r, "sampling:", match)
    assert "missing.gguf" not in r.stderr


def test_seeded_sampling_from_the_command_line(synth_dir):
    """--temp with a --seed: the same text each run (a fresh process each), another
    seed other text; --temp 0 the greedy stream."""
    from minfer.tools.synth import synth_model
    path = synth_model(synth_dir)
    run = lambda *f: minfer("generate", "-m", path, "--backend", "cpu", "-q", "-n", "12", "--ignore-eos",
                            "--no-warmup", "-p", "def add(a, b):", *f)
    a, a2, b = run("--temp", "1.5", "--seed", "3"), run("--temp", "1.5", "--seed", "3"), run("--temp", "1.5", "--seed", "4")
    greedy, zero = run(), run("--temp", "0", "--seed", "3")
    for r in (a, a2, b, greedy, zero):
        assert r.returncode == 0, r.stderr
    assert a.stdout == a2.stdout and a.stdout != b.stdout and a.stdout != greedy.stdout
    assert zero.stdout == greedy.stdout


def test_backend_choices_are_the_backends():
    from minfer.backend import BACKENDS
    from minfer.cli import BACKENDS as CHOICES
    assert CHOICES == BACKENDS


def test_tokenize_takes_one_of_p_or_f(tmp_path):
    r = minfer("tokenize", "--help")
    assert r.returncode == 0 and "(-p PROMPT | -f FILE)" in r.stdout, r.stdout
    assert_one_line_error(minfer("tokenize", "-m", tmp_path / "x.gguf"), "one of the arguments -p/--prompt -f/--file")
    assert_one_line_error(minfer("tokenize", "-m", tmp_path / "x.gguf", "-p", "a", "-f", tmp_path / "a.txt"),
                          "not allowed with")


@pytest.fixture(scope="session")
def no_gpu(gpu_skip_reason):
    # session scope and listed before real_model_path: skips before the model is pulled
    if gpu_skip_reason is None:
        pytest.skip("a GPU is present: CUDA is available here")


@pytest.mark.model
def test_cuda_unavailable(no_gpu, real_model_path):
    assert_one_line_error(minfer("generate", "-m", real_model_path, "-p", "hi", "--backend", "cuda"),
                          "CUDA backend unavailable")


@pytest.mark.model
def test_tokenize_matches_llama_tokenize(real_model_path, fixtures_dir, tmp_path):
    cases = json.loads((fixtures_dir / "tokenizer_qwen2.5-coder-1.5b.json").read_text())
    case = next(c for c in cases if "<|im_start|>" in c["text"])     # the two modes differ here
    assert case["ids_parse_special"] != case["ids_no_parse_special"]
    f = tmp_path / "text.txt"
    f.write_bytes(case["text"].encode("utf-8"))           # byte-exact, as the fixture was made
    r = minfer("tokenize", "-m", real_model_path, "-f", f)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") == 1 and json.loads(r.stdout) == case["ids_parse_special"]
    r = minfer("tokenize", "-m", real_model_path, "-f", f, "--no-parse-special")
    assert json.loads(r.stdout) == case["ids_no_parse_special"]


@pytest.mark.model
def test_generate_streams_only_the_text(real_model_path, fixtures_dir):
    """The default model (no -m: ensure_model), 6 tokens: stdout is exactly the text,
    a prefix of llama.cpp's greedy output; the tokens/s report goes to stderr."""
    case = next(c for c in json.loads((fixtures_dir / "greedy_qwen2.5-coder-1.5b.json").read_text())
                if c["prompt"] == "The capital of France is")
    r = minfer("generate", "-p", case["prompt"], "-n", "6", "--ignore-eos", "-q")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout) > 6 and case["greedy_text"].startswith(r.stdout), r.stdout
    assert "prompt: 5 tokens" in r.stderr and "generation: 6 tokens" in r.stderr
