"""What a run record names (minfer/tools/runinfo.py): version, git commit, host CPU, time."""
from __future__ import annotations

import re
import subprocess
from importlib.metadata import version as dist_version

import minfer
from minfer.tools import runinfo


def test_version_is_the_installed_one_and_the_packages():
    assert runinfo.version() == dist_version("minfer") == minfer.__version__


def test_git_commit_of_the_checkout(repo_root):
    runinfo.git_commit.cache_clear()
    try:
        head = subprocess.run(["git", "-C", str(repo_root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
    except OSError:                                      # no git here: nothing to name
        head = None
    got = runinfo.git_commit()
    if head is None or head.returncode != 0:
        assert got is None
    else:
        assert re.fullmatch(re.escape(head.stdout.strip()) + r"(-dirty)?", got), got
        assert runinfo.version_line() == f"minfer {runinfo.version()} (git {got})"


def test_no_commit_outside_a_checkout_of_minfer(tmp_path, monkeypatch):
    """An installed minfer (here: a folder that is not the top of a git checkout) names no commit."""
    runinfo.git_commit.cache_clear()
    monkeypatch.setattr(runinfo, "_CHECKOUT", tmp_path)
    try:
        assert runinfo.git_commit() is None
        assert runinfo.version_line() == f"minfer {runinfo.version()}"
    finally:
        runinfo.git_commit.cache_clear()


def test_host_cpu_and_timestamp():
    assert runinfo.host_cpu().strip()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", runinfo.utc_timestamp())
