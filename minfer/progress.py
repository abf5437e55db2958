"""Progress bars: tqdm on stderr, and only where a person watches it.

A bar redraws itself with carriage returns; written into a redirected stderr (a
log file, a CI job, a pipe) it becomes dozens of lines of noise, so a bar is
shown only when it was asked for and stderr is a terminal. Every bar in minfer
comes from here.
"""
from __future__ import annotations

import sys

from tqdm import tqdm


def stderr_is_terminal() -> bool:
    err = sys.stderr
    try:
        return err is not None and err.isatty()
    except (AttributeError, ValueError):     # replaced by an object without isatty, or closed
        return False


def bar(iterable=None, *, enabled: bool = True, **kwargs) -> tqdm:
    """tqdm(iterable, **kwargs) on stderr, disabled unless `enabled` and stderr is
    a terminal (a disabled bar still iterates, counts nothing, prints nothing)."""
    return tqdm(iterable, disable=not (enabled and stderr_is_terminal()), file=sys.stderr, **kwargs)
