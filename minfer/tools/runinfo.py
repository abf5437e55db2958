"""What a measurement was made with: minfer's version, the checkout's git commit,
the host processor, the time. `minfer --version` and every `minfer bench` record
read them from here, so a figure tracked over time names its code and machine.

Nothing here fails: what cannot be found is None (the commit of an installed,
non-checkout minfer; a processor name the platform does not report).
"""
from __future__ import annotations

import functools
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from .. import __version__

_CHECKOUT = Path(__file__).resolve().parents[2]      # the folder holding minfer/


def version() -> str:
    """The installed distribution's version; the package's own when minfer runs
    from a folder that was never installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version
    try:
        return dist_version("minfer")
    except PackageNotFoundError:
        return __version__


def _git(*args: str) -> str | None:
    try:
        # --no-optional-locks: `status` must not rewrite the index of the checkout
        p = subprocess.run(["git", "--no-optional-locks", "-C", str(_CHECKOUT), *args],
                           capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def git_commit() -> str | None:
    """The short commit of the checkout minfer runs from, with "-dirty" when tracked
    files differ from it; None outside a git checkout of minfer itself (an installed
    package that happens to sit inside another repository is not that repository)."""
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != _CHECKOUT:
        return None
    commit = _git("rev-parse", "--short", "HEAD")
    if not commit:
        return None
    changes = _git("status", "--porcelain", "--untracked-files=no")
    return commit + ("-dirty" if changes else "")


def version_line() -> str:
    """`minfer 0.1.0 (git e7d32d3)`: what `minfer --version` prints."""
    commit = git_commit()
    return f"minfer {version()}" + (f" (git {commit})" if commit else "")


@functools.lru_cache(maxsize=1)
def host_cpu() -> str:
    """The host processor's model name ("AMD EPYC 7B13"), else the platform's
    processor or machine name ("x86_64")."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def utc_timestamp() -> str:
    """Now, ISO 8601 in UTC to the second: 2026-01-31T12:00:00Z"""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
