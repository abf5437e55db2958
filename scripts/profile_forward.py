#!/usr/bin/env python3
"""Host vs device time of one forward pass, and where the host time goes.

    python scripts/profile_forward.py -m MODEL [-t 1,512,3325] [--cprofile 512]

For each token count: cupyx.profiler.benchmark's CPU time (the host's time to
issue the whole forward) beside its GPU time (CUDA events): when the two are
close, the forward is host-bound and the GPU waits for Python. --cprofile T
prints the top functions by own time for one forward of T tokens.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

import numpy as np

from minfer.engine import Engine


def main() -> int:
    from cupyx.profiler import benchmark

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--tokens", default="1,512,3325")
    ap.add_argument("--cprofile", type=int, default=512)
    a = ap.parse_args()
    ts = [int(t) for t in a.tokens.split(",")]
    eng = Engine.load(a.model, backend="cuda", n_ctx=max(ts + [a.cprofile]) + 1, progress=False)
    cache = eng.new_cache()
    rng = np.random.default_rng(0)
    for T in ts:
        toks = rng.integers(0, eng.cfg.vocab_size, T).astype(np.int32)
        r = benchmark(eng.model.forward, (toks, 0, cache), n_repeat=5, n_warmup=2)
        cpu, gpu = np.median(r.cpu_times) * 1e3, np.median(r.gpu_times[0]) * 1e3
        print(f"T={T:>5}: host {cpu:8.2f} ms, device {gpu:8.2f} ms, {T / gpu * 1e3:10.1f} tok/s by device time")
    # device-only time: the decoder layers captured once in a CUDA graph (relaxed
    # mode, a private memory pool warmed by an eager run), replays timed with events
    import cupy as cp
    for T in ts:
        toks = rng.integers(0, eng.cfg.vocab_size, T).astype(np.int32)
        x0 = eng.backend.embed(eng.weights.token_embd, toks)
        pool = cp.cuda.MemoryPool()
        s = cp.cuda.Stream(non_blocking=True)
        try:
            with cp.cuda.using_allocator(pool.malloc), s:
                eng.model.blocks(x0, 0, cache)                       # warm the private pool
                s.synchronize()
                mode = getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", None)
                s.begin_capture(mode) if mode is not None else s.begin_capture()
                y = eng.model.blocks(x0, 0, cache)
                g = s.end_capture()
                g.launch(s)
                s.synchronize()
                ms = []
                for _ in range(5):
                    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                    e0.record(s); g.launch(s); e1.record(s); e1.synchronize()
                    ms.append(cp.cuda.get_elapsed_time(e0, e1))
            ref = eng.model.blocks(x0, 0, cache)
            same = bool(cp.array_equal(ref, y))
            print(f"T={T:>5}: decoder layers as a CUDA graph replay: {np.median(ms):8.2f} ms "
                  f"({T / np.median(ms) * 1e3:10.1f} tok/s), replay == eager: {same}")
        except Exception as e:  # noqa: BLE001 - a probe: report and go on
            print(f"T={T:>5}: graph capture failed: {type(e).__name__}: {e}")
    toks = rng.integers(0, eng.cfg.vocab_size, a.cprofile).astype(np.int32)
    eng.model.forward(toks, 0, cache)
    pr = cProfile.Profile()
    pr.enable()
    eng.model.forward(toks, 0, cache)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(28)
    return 0


if __name__ == "__main__":
    sys.exit(main())
