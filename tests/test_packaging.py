"""What a plain (non-editable) install carries: every package folder of minfer/ is
named in pyproject's package list, or `pip install .` would leave it out."""
from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")          # Python 3.11 on
ROOT = Path(__file__).resolve().parents[1]


def test_every_minfer_package_is_installed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "minfer").rglob("__init__.py")}
    assert found <= listed, f"not in pyproject's packages: {sorted(found - listed)}"
    assert {"minfer.kernels", "minfer.models"} <= listed       # the top-level kernels/ and models/
