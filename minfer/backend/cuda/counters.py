"""What ran: the counters the tests' liveness checks and `minfer bench` read.

Two kinds in one table:
- launches by kernel name ("rmsnorm_f16", "matvec<12, 14, 2>", "cublasLt matmul"),
  counted by the launcher itself (launch.LAUNCHES);
- path labels: each weight product's path (paths.GemmPath.labels: its engine and,
  for q6_K, where B came from: the W_exp bundle's liveness labels), counted by the
  one function of linears.py that runs a product's operand, and "gate/up prefetch"
  (a gate/up launch that also dequantized the next layer's pair); a graph's capture
  adds "dependent launches" and "early dequants" (dependent.py) to its replays.
A CUDA graph replay adds what its capture counted (graphs.py).
"""
from __future__ import annotations

import atexit
import sys
from collections import Counter

from .launch import LAUNCHES
from .paths import PATH_LABELS

LABELS = PATH_LABELS + ("gate/up prefetch", "dependent launches", "early dequants")


class Counters:
    """One backend's counts since its last reset: its labels, and the launches of the
    process since then (the kernels are process-wide; one backend runs at a time)."""

    def __init__(self, report_at_exit: bool = False):
        self.reset()
        if report_at_exit:
            atexit.register(self._report)

    def reset(self) -> None:
        self._labels: Counter = Counter()
        self._base = Counter(LAUNCHES)

    def label(self, name: str, n: int = 1) -> None:
        self._labels[name] += n

    @property
    def counts(self) -> dict[str, int]:
        """Every label (zeros included) and every kernel launched since the reset."""
        out = dict.fromkeys(LABELS, 0)
        out.update(self._labels)
        for name, n in LAUNCHES.items():
            if n > self._base[name]:
                out[name] = n - self._base[name]
        return out

    def since(self, before: dict[str, int]) -> dict[str, int]:
        """The counts added since `before` (an earlier .counts), nonzero ones only."""
        now = self.counts
        return {k: n - before.get(k, 0) for k, n in now.items() if n != before.get(k, 0)}

    def add(self, delta: dict[str, int], sign: int = 1) -> None:
        """Count delta (a since() result) again: a graph replay's launches; sign -1
        takes it back (a capture, which launched nothing)."""
        for k, n in delta.items():
            if k in LAUNCHES:
                LAUNCHES[k] += sign * n
            else:
                self._labels[k] += sign * n

    def _report(self) -> None:
        for name, n in self.counts.items():
            print(f"[minfer launches] {name}: {n}", file=sys.stderr)
