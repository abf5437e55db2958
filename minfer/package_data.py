"""Where the repository's top-level data folders are found at run time.

pyproject maps `kernels/` and `models/` to the subpackages `minfer.kernels` and
`minfer.models`, so an installed (non-editable) minfer carries them as package
data; a source checkout has them beside `minfer/`. One rule for both.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path


def package_data_dir(package: str, pattern: str) -> Path | None:
    """The folder of `package` ("minfer.kernels", "minfer.models") holding files
    that match `pattern`: the installed package first, then the checkout's
    top-level folder of the same name; None when neither has such a file."""
    try:
        d = Path(str(resources.files(package)))
        if d.is_dir() and any(d.glob(pattern)):
            return d
    except (ModuleNotFoundError, TypeError):   # not installed / not a plain folder
        pass
    d = Path(__file__).resolve().parents[1] / package.rsplit(".", 1)[-1]
    return d if d.is_dir() and any(d.glob(pattern)) else None
