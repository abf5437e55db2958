"""The scripts (scripts/check/, scripts/bench/, tests/tools/) on the CPU machine: each
one's --help runs without cupy, nothing edits sys.path, the CudaSettings fields
they take on the command line, and the A/B, greedy-stream, first-use and
product-ceiling scripts on a tiny synthetic model."""
from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minfer.errors import MinferError
from minfer.tools.synth import write_synthetic
from scripts import fields

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                 for p in (ROOT / "scripts").glob("*/*.py") if p.name != "__init__.py")
TINY = dict(n_layer=1, d_model=256, n_head=2, n_head_kv=1, d_ff=512)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("scripts") / "tiny.gguf", seed=11, **TINY)


def script(*args, timeout=300) -> subprocess.CompletedProcess:
    """python3 -m scripts.X.Y ARGS from the repository root, as the scripts are run."""
    return subprocess.run([sys.executable, "-m", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def assert_one_line_error(p: subprocess.CompletedProcess, prefix: str, *fragments: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(f"{prefix}: error: "), p.stderr
    for f in fragments:
        assert f in p.stderr, p.stderr


# --- layout --------------------------------------------------------------------------

def test_every_script_is_a_check_or_a_benchmark():
    top = sorted(p.name for p in (ROOT / "scripts").iterdir() if p.name != "__pycache__")
    assert top == ["__init__.py", "bench", "check", "fields.py"]
    assert "scripts.check.golden" in MODULES and "scripts.bench.ab" in MODULES


@pytest.mark.parametrize("module", MODULES)
def test_help_runs_without_a_gpu(module):
    """`python3 -m scripts.X.Y --help` here, where cupy is missing: GPU imports stay lazy."""
    if module == "scripts.check.cuda_libs":       # run by its path, from outside the checkout
        p = subprocess.run([sys.executable, str(ROOT / "scripts" / "check" / "cuda_libs.py"), "--help"],
                           capture_output=True, text=True, timeout=60, cwd="/")
    else:
        p = script(module, "--help", timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stderr == "" and len(p.stdout.splitlines()) > 3


def test_fixture_maker_help():
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "tools" / "cut_real_slices.py"), "--help"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0 and "real_slices.npz" in p.stdout, p.stderr


def test_usage_lines_name_the_module():
    """Each docstring's usage line runs the script the way it is run: as a module."""
    for module in MODULES:
        path = ROOT / (module.replace(".", "/") + ".py")
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"python3? scripts/\w+\.py", text), path
        if module != "scripts.check.cuda_libs":
            assert f"python3 -m {module}" in text, path
    for sh in (ROOT / "scripts" / "check").glob("*.sh"):
        text = sh.read_text(encoding="utf-8")
        calls = re.findall(r"python3 (?:-m )?\"?(?:\$REPO/)?(scripts[/.][\w/.]+)", text)
        assert calls, sh
        for c in calls:
            if c.endswith(".py"):                            # by path: only cuda_libs.py
                assert c.endswith("scripts/check/cuda_libs.py"), (sh, c)
            else:
                assert c in MODULES, (sh, c)


def test_nothing_edits_sys_path():
    edit = re.compile(r"sys\.path\s*(\.\s*(insert|append|extend|remove|pop)\b|\[[^]]*\]\s*=|\s*[+]?=)")
    files = [p for d in ("scripts", "tests") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 20
    bad = [str(p.relative_to(ROOT)) for p in files if edit.search(p.read_text(encoding="utf-8"))]
    assert bad == []


# --- CudaSettings fields on the command line ---------------------------------------------

def test_fields_parse():
    assert fields.parse(["gateup_fused=0", "ffn_f16=true,f16_min_t=64"]) == \
        {"gateup_fused": False, "ffn_f16": True, "f16_min_t": 64}
    assert fields.split({"exp_planes": False, "graphs": True, "force_exp_miss": True}) == \
        ({"exp_planes": False, "force_exp_miss": True}, {"graphs": True})
    assert fields.text({"gateup_fused": False, "f16_min_t": 64}) == "gateup_fused=0, f16_min_t=64"
    for bad, word in (("nope=1", "unknown setting 'nope'"), ("ffn_f16=maybe", "switch"),
                      ("f16_min_t=x", "integer"), ("ffn_f16", "FIELD=VALUE")):
        with pytest.raises(MinferError, match=word):
            fields.parse([bad])


@pytest.mark.parametrize("module, prefix, argv", [
    ("scripts.bench.ab", "ab", ["-m", "x.gguf", "--a", "nope=1", "--b", "nope=0"]),
    ("scripts.check.golden", "golden", ["--backend", "cpu", "--set", "nope=1"]),
    ("scripts.check.greedy_stream", "greedy_stream", ["-m", "x.gguf", "-p", "hi", "-o", "/dev/null",
                                                      "--set", "nope=1"]),
])
def test_unknown_field_is_one_line(module, prefix, argv):
    """Before any model is opened (x.gguf does not exist): exit 2, one line."""
    assert_one_line_error(script(module, *argv, timeout=60), prefix, "unknown setting 'nope'")


# --- A/B -------------------------------------------------------------------------------

@pytest.fixture
def recorded(monkeypatch):
    """ab's and greedy_stream's engines: the tiny model on the CPU backend (which has no
    settings), every load's fields and every backend.using(...) recorded."""
    from minfer.engine import Engine
    loads, uses = [], []

    def load_engine(model, backend, n_ctx, load_fields):
        eng = Engine.load(model, backend="cpu", n_ctx=n_ctx, progress=False)
        index = len(loads)
        loads.append(dict(load_fields))

        @contextlib.contextmanager
        def using(**changes):
            uses.append((index, changes))
            yield

        eng.backend.using = using
        return eng

    monkeypatch.setattr(fields, "load_engine", load_engine)
    return loads, uses


def _ab(capsys, model, *argv) -> dict:
    from scripts.bench import ab
    capsys.readouterr()
    assert ab.main(["-m", str(model), "-p", "9", "-r", "3", "--json", *argv]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["order"] == ["A", "B"] * 3
    for side in "AB":
        assert len(r[side]["tok_s"]) == 3 and min(r[side]["tok_s"]) > 0
    assert r["ratio_b_over_a"] > 0 and isinstance(r["separated"], bool)
    return r


def test_ab_run_time_fields_one_engine(tiny_model, capsys, recorded):
    loads, uses = recorded
    r = _ab(capsys, tiny_model, "--a", "gateup_fused=1", "--b", "gateup_fused=0,ffn_f16=0")
    assert r["mode"] == "one engine" and loads == [{}]
    a, b = {"gateup_fused": True}, {"gateup_fused": False, "ffn_f16": False}
    assert r["A"]["setting"] == a and r["B"]["setting"] == b
    # two warm-ups a side (eager, capture), then A B A B ..., all on the one engine
    assert uses == [(0, a), (0, a), (0, b), (0, b)] + [(0, a), (0, b)] * 3


def test_ab_exp_planes_toggles_one_engine(tiny_model, capsys, recorded):
    loads, uses = recorded
    r = _ab(capsys, tiny_model, "--backend", "cuda", "--a", "exp_planes=1", "--b", "exp_planes=0")
    assert r["mode"] == "toggle" and loads == [{"exp_planes": True}]       # planes registered
    on, off = {"exp_enabled": True}, {"exp_enabled": False}
    assert uses == [(0, on), (0, on), (0, off), (0, off)] + [(0, on), (0, off)] * 3


def test_ab_load_time_fields_two_engines(tiny_model, capsys, recorded):
    loads, uses = recorded
    r = _ab(capsys, tiny_model, "--a", "f16_weights=1", "--a", "ffn_f16=0", "--b", "f16_weights=0")
    assert r["mode"] == "two engines"
    assert loads == [{"f16_weights": True}, {"f16_weights": False}]
    assert uses == [(0, {"ffn_f16": False})] * 5           # A's run-time field on A's engine only


def test_ab_needs_settings_the_backend_has(tiny_model):
    """The CPU backend has no settings to switch: one line, exit 2."""
    p = script("scripts.bench.ab", "-m", tiny_model, "--backend", "cpu", "-p", "5", "-r", "1",
               "--a", "gateup_fused=1", "--b", "gateup_fused=0")
    assert_one_line_error(p, "ab", "the cpu backend has none")


# --- greedy streams ----------------------------------------------------------------------

def test_greedy_stream_cpu(tiny_model, tmp_path):
    out = tmp_path / "s.txt"
    p = script("scripts.check.greedy_stream", "-m", tiny_model, "--backend", "cpu", "-p", "The capital of",
               "-n", "6", "-o", out)
    assert p.returncode == 0, p.stderr
    data = out.read_bytes()
    assert data and p.stdout.splitlines() == [f"text: {len(data)} bytes -> {out}"]   # no counters on the CPU
    from minfer.engine import Engine
    with Engine.load(tiny_model, backend="cpu", progress=False) as eng:
        assert eng.generate("The capital of", 6, ignore_eos=True).text.encode() == data


def test_greedy_stream_settings(tiny_model, tmp_path, recorded, capsys):
    from scripts.check import greedy_stream
    loads, uses = recorded
    out = tmp_path / "s.txt"
    assert greedy_stream.main(["-m", str(tiny_model), "-p", "hi", "-n", "3", "-o", str(out),
                               "--set", "gateup_fused=0", "--set", "force_exp_miss=1"]) == 0
    assert loads == [{"force_exp_miss": True}] and uses == [(0, {"gateup_fused": False})]
    assert out.read_bytes() and capsys.readouterr().out.startswith("text: ")


# --- first use, product ceiling ------------------------------------------------------------

def test_first_use_script_cpu(tiny_model):
    """scripts/bench/first_use.py: prompts cut to the asked token counts, a fresh generate
    per length beside the bench of the same lengths, one table row each."""
    p = script("scripts.bench.first_use", "-m", tiny_model, "-p", "9,13", "-r", "1", "-c", "64")
    assert p.returncode == 0, p.stderr
    rows = [line.split("|")[1:-1] for line in p.stdout.splitlines() if line.startswith("| ") and "%" in line]
    assert [int(r[0]) for r in rows] == [9, 13]
    assert all(float(r[2].replace(",", "")) > 0 and r[3].strip().endswith("%") for r in rows)


def test_product_ceiling_flop_and_bad_input():
    """scripts/bench/product_ceiling.py: its products' FLOP on the 7B header are 2·T times
    the element count of the header's layer linears (counted here from the tensor
    table); bad -p / -r exit 2 with one line, before any GPU work."""
    from minfer.format.gguf import open_gguf
    from minfer.tools.synth import header_7b_path
    from scripts.bench import product_ceiling
    gf = open_gguf(str(header_7b_path()), header_only=True)
    try:
        linears = sum(t.n_elements for n, t in gf.tensors.items()
                      if n.startswith("blk.") and n.endswith(".weight") and len(t.shape) == 2)
    finally:
        gf.close()
    assert product_ceiling.product_flop(product_ceiling.shapes(header_7b_path()), 3325) == 2 * 3325 * linears
    for argv, word in ((["-p", "0"], "-p expects"), (["-p", "512,x"], "-p expects"), (["-r", "0"], "-r must")):
        assert_one_line_error(script("scripts.bench.product_ceiling", *argv, timeout=60), "product_ceiling", word)
