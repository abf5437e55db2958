#!/usr/bin/env python3
"""Where a prefill's time goes: every kernel of one forward pass, timed by CUPTI
and summed per kernel family (the default), or host vs device time (--host).

    python3 -m scripts.bench.profile_forward -m MODEL [-p 512,3325] [-r 3] [--decode --depth 16,3325]
    python3 -m scripts.bench.profile_forward -m MODEL --host [-t 1,512,3325] [--cprofile 512]

Kernel table, for each prompt length: two untimed forwards (compile, warm the pools), then -r
profiled forwards with CUDA graphs off, so that every launch is its own
kernel record; the table gives each family's ms per forward (the median over
the -r forwards), its share and its launches, and the sum beside the forward's
wall time (the difference is the host's launch overhead that a CUDA graph
removes). --decode adds the same table for one greedy decode step after a
prompt of each --depth (eager: the sum is the step's kernel time in place,
cold L2 and all, to set beside the graph-replayed tg figure). Kernel records come from PyTorch's profiler, used only as a CUPTI
client: it records the kernels of every library in the process (our NVRTC
kernels, cuBLAS, CuPy's element-wise kernels); nothing of torch computes
anything. The GPU machine has torch; this script is its only user.

--host: for each token count, cupyx.profiler.benchmark's CPU time (the host's
time to issue the whole forward) beside its GPU time (CUDA events): when the two
are close, the forward is host-bound and the GPU waits for Python; then the
decoder layers as one CUDA-graph replay, and cProfile's top functions by own
time for one forward of --cprofile tokens.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np

from minfer.engine import Engine

# kernel-name fragment -> family, first match wins (cuBLAS names its GEMM kernels
# after the architecture and tile: nvjet_..., sm90_xmma_gemm_..., cutlass_...,
# and its split-K reductions splitKreduce_...)
FAMILIES = (
    ("gateup_swiglu", "gate/up + SwiGLU (q4_K fused)"),
    ("flash_attn", "attention (flash)"),
    ("attn_decode", "attention (decode)"),
    ("attention_f32", "attention (f32)"),
    ("dequant32_f16", "dequantize -> f16"),
    ("dequant_f16", "dequantize -> f16"),
    ("dequant_q", "dequantize -> f16"),
    ("dequant_rows", "embedding rows"),
    ("gemm", "GEMM (cuBLAS)"),
    ("nvjet", "GEMM (cuBLAS)"),
    ("splitk", "GEMM (cuBLAS)"),
    ("xmma", "GEMM (cuBLAS)"),
    ("cutlass", "GEMM (cuBLAS)"),
    ("mmq", "GEMM (int8 MMQ)"),
    ("matvec", "matvec"),
    ("rmsnorm", "RMSNorm"),
    ("rope", "RoPE + KV store"),
    ("store_kv", "RoPE + KV store"),
    ("cast_f32_f16", "casts f32 -> f16"),
    ("swiglu", "SwiGLU"),
    ("quantize_q8_1", "q8_1 quantization"),
    ("add", "adds (residual, bias)"),
    ("argmax", "argmax"),
    ("advance_feed", "argmax"),
)


def family(kernel_name: str) -> str:
    low = kernel_name.lower()
    for frag, fam in FAMILIES:
        if frag in low:
            return fam
    return f"other: {kernel_name[:40]}"


def _profiled(fn, reps: int, be):
    """reps runs of fn, each under the profiler -> ([(ms per family, launches per family)], walls s)."""
    from torch.profiler import ProfilerActivity, profile
    per_rep, walls = [], []
    for _ in range(reps):
        be.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            fn()
            be.synchronize()
            walls.append(time.perf_counter() - t0)
        ms, n = collections.defaultdict(float), collections.Counter()
        for ev in prof.events():
            if not str(ev.device_type).endswith("CUDA"):    # kernel records only
                continue
            fam = family(ev.name)
            ms[fam] += ev.time_range.elapsed_us() / 1e3     # us -> ms
            n[fam] += 1
        per_rep.append((ms, n))
    return per_rep, walls


def _table(title: str, per_rep, walls, tokens: int) -> None:
    fams = sorted({f for ms, _ in per_rep for f in ms},
                  key=lambda f: -np.median([ms.get(f, 0.0) for ms, _ in per_rep]))
    med = {f: float(np.median([ms.get(f, 0.0) for ms, _ in per_rep])) for f in fams}
    total = sum(med.values())
    print(f"\n{title}, graphs off, median of {len(per_rep)}")
    print("| kernel family | ms | share | launches |")
    print("| --- | ---: | ---: | ---: |")
    for f in fams:
        print(f"| {f} | {med[f]:.3f} | {med[f] / total:.1%} | {per_rep[0][1][f]} |")
    wall = float(np.median(walls)) * 1e3
    print(f"| **kernels** | **{total:.3f}** | | {sum(per_rep[0][1].values())} |")
    print(f"wall {wall:.2f} ms (eager): {tokens / wall * 1e3:,.0f} tok/s; "
          f"kernels alone {tokens / total * 1e3:,.0f} tok/s")


def kernel_report(a) -> int:
    """The kernel-time table per kernel family (the default): prefills, then with
    --decode one greedy decode step after a prompt of each --depth."""
    try:
        from torch import profiler
    except ImportError:
        sys.exit("profile_forward: needs torch (its profiler is the CUPTI client)")
    del profiler                         # (imported here only to fail early and clearly)
    lengths = [int(t) for t in a.prompts.split(",") if t]
    depths = [int(t) for t in a.depth.split(",")] if a.decode else []
    eng = Engine.load(a.model, backend="cuda", n_ctx=max(lengths + [d + 2 for d in depths]),
                      progress=False)
    be, model = eng.backend, eng.model
    rng = np.random.default_rng(0)
    name = Path(a.model).name
    with be.using(graphs=False):
        for T in lengths:
            tokens = rng.integers(0, eng.cfg.vocab_size, T).astype(np.int32)
            cache = eng.new_cache(T)
            for _ in range(2):
                model.forward(tokens, 0, cache)
            per_rep, walls = _profiled(lambda: model.forward(tokens, 0, cache), a.reps, be)
            _table(f"{name}: prefill of {T} tokens", per_rep, walls, T)
        for D in depths:
            tokens = rng.integers(0, eng.cfg.vocab_size, D).astype(np.int32)
            cache = eng.new_cache(D + 2)
            model.forward(tokens, 0, cache)
            for _ in range(2):
                model.decode_greedy(int(tokens[-1]), D, cache)
            per_rep, walls = _profiled(lambda: model.decode_greedy(int(tokens[-1]), D, cache), a.reps, be)
            _table(f"{name}: one greedy decode step after {D} tokens", per_rep, walls, 1)
    eng.close()
    return 0


def host_report(a) -> int:
    """--host: host vs device time per token count, the layers as one graph replay,
    and cProfile's top functions for one forward."""
    from cupyx.profiler import benchmark

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
            # (blocks consumes its input, the residual stream: each run gets a fresh copy,
            # the graph's input buffer is refilled before the replay that is compared)
            with cp.cuda.using_allocator(pool.malloc), s:
                xin = x0.copy()
                eng.model.blocks(x0.copy(), 0, cache)                # warm the private pool
                s.synchronize()
                mode = getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", None)
                s.begin_capture(mode) if mode is not None else s.begin_capture()
                y = eng.model.blocks(xin, 0, cache)
                g = s.end_capture()
                g.launch(s)
                s.synchronize()
                ms = []
                for _ in range(5):
                    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                    e0.record(s); g.launch(s); e1.record(s); e1.synchronize()
                    ms.append(cp.cuda.get_elapsed_time(e0, e1))
                xin[...] = x0
                g.launch(s)
                s.synchronize()
            ref = eng.model.blocks(x0.copy(), 0, cache)
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



def main() -> int:
    ap = argparse.ArgumentParser(prog="python3 -m scripts.bench.profile_forward", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True, help="GGUF (the 7B twin: minfer twin -o PATH)")
    ap.add_argument("-p", "--prompts", default="512,3325", help="kernel table: prompt lengths")
    ap.add_argument("-r", "--reps", type=int, default=3, help="kernel table: profiled forwards")
    ap.add_argument("--decode", action="store_true", help="also one greedy decode step per --depth")
    ap.add_argument("--depth", default="16,3325", help="--decode: prompt lengths before the step")
    ap.add_argument("--host", action="store_true", help="host vs device time instead")
    ap.add_argument("-t", "--tokens", default="1,512,3325", help="--host: token counts")
    ap.add_argument("--cprofile", type=int, default=512, help="--host: tokens of the cProfile'd forward")
    a = ap.parse_args()
    return host_report(a) if a.host else kernel_report(a)


if __name__ == "__main__":
    sys.exit(main())
