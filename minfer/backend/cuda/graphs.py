"""CUDA graphs of repeated device work (Backend.captured).

A key's first use runs eagerly; its second runs once more eagerly (filling a
private memory pool with every block the work allocates), is captured into a
graph served from that pool, and replays; later uses only replay: the input is
copied into the graph's input buffer and its output array returned (valid until
the next replay of the same key). A capture bakes in every launch decision, so
the caller puts its settings into the key. Launch counters add, per replay, the
counts the capture recorded. The warm run and the capture take the GEMM
heuristic's first-choice kernels (cublas.best_kernels): a replayed graph pays
their loading once. The capture launches our kernels as programmatic dependents
of the launch before them (dependent.py) unless the settings turn that off.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from . import dependent
from .cublas import best_kernels
from .launch import cp, is_oom

SEEN = "seen"                    # a key used once, eagerly
_RELAXED = getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", 2) if cp is not None else 2


@dataclass(eq=False)
class Graph:
    """One captured replay: its input buffer, output array, the memory pool its
    intermediates live in, the launch counts one replay adds, and references
    that keep every buffer it touches alive."""
    graph: object
    inp: object
    out: object
    pool: object
    counts: dict
    keep: tuple


class GraphRunner:
    """Capture and replay for one backend. `counters` is the backend's
    counters.Counters; `keep_alive()` returns the buffers a new graph must hold on to;
    `dependent()` says whether captures launch dependently now."""

    def __init__(self, counters, keep_alive, dependent=lambda: False):
        self.counters, self.keep_alive, self.dependent = counters, keep_alive, dependent
        self.failed = False          # a capture failed: eager from then on
        self.replays = 0

    def run(self, graphs: dict, key, fn, x):
        """fn(x) -> y, eager, captured or replayed by the rule above; graphs is the
        cache's dict (graphs live as long as the KV cache they write)."""
        rec = graphs.get(key)
        if rec is None:
            graphs[key] = SEEN
            return fn(x)
        if rec is SEEN:
            try:
                rec = graphs[key] = self._capture(fn, x)
            except Exception as e:  # noqa: BLE001 - loud, once: eager from here on
                if is_oom(e):
                    raise
                self.failed = True
                del graphs[key]
                print(f"minfer: WARNING: CUDA graph capture failed ({type(e).__name__}: {e}); "
                      f"running eagerly from now on (MINFER_CUDA_GRAPHS=0 silences this)",
                      file=sys.stderr, flush=True)
                return fn(x)
        rec.inp[...] = x                                                     # (T, d)
        return self.replay(rec)

    def replay(self, rec: Graph):
        """Launch a captured graph on its input buffer as it stands -> its output array."""
        rec.graph.launch(cp.cuda.get_current_stream())
        self.counters.add(rec.counts)
        self.replays += 1
        return rec.out

    def _capture(self, fn, x) -> Graph:
        pool = cp.cuda.MemoryPool()
        stream = cp.cuda.Stream(non_blocking=True)
        cp.cuda.get_current_stream().synchronize()       # capture sees a quiet device
        with cp.cuda.using_allocator(pool.malloc), best_kernels():
            inp = cp.empty_like(x)                                           # (T, d)
            with stream:
                inp[...] = x            # on the capture stream: the warm run below reads it
                # the warm run fills the private pool with every block the work
                # allocates, so the capture is served from it (a cudaMalloc can
                # invalidate a capture); it computes the same bits
                fn(inp)
                stream.synchronize()
                before = self.counters.counts
                launched, early = dependent.STATE.launched, dependent.STATE.early_dequants
                stream.begin_capture(_RELAXED)
                try:
                    with dependent.dependent_launches(self.dependent()):
                        out = fn(inp)
                finally:
                    graph = stream.end_capture()
        counts = self.counters.since(before)
        self.counters.add(counts, -1)        # the capture ran nothing (the warm run did: counted)
        counts["dependent launches"] = dependent.STATE.launched - launched
        counts["early dequants"] = dependent.STATE.early_dequants - early
        # the scratch buffers the captured kernels read and write stay alive with the
        # graph, so a later growth (new buffers) cannot free them under it
        return Graph(graph, inp, out, pool, counts, self.keep_alive())
