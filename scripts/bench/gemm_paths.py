#!/usr/bin/env python3
"""Which GEMM engine wins at which prompt length: int8 MMQ vs f16 cuBLAS.

    python3 -m scripts.bench.gemm_paths [-t 8,16,32,64,128,256,512] [-r 9]

Times the CUDA backend's linear (minfer/backend/cuda/linears.py) on the 7B's layer shapes (q4_K attn_q/attn_k/
ffn_gate, q6_K attn_v/ffn_down with their W_exp planes) at each token count,
once with every GEMM forced onto MMQ and once onto the f16 path, interleaved
rep by rep (CUDA events, medians), two ways: one eager call on an idle device
(host time included: what a one-shot prompt pays) and one replay of the call
captured in a CUDA graph (device time alone: what repeated shapes pay). Prints
a table and, for each, the smallest T from which the f16 path wins for the
layer as a whole: the basis of F16_GEMM_MIN_T (minfer/backend/cuda/settings.py).
"""
from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np
from gguf import GGMLQuantizationType as QT

from minfer.format import quants
from minfer.format.gguf import TensorInfo

# (name, type, n_out, n_in, per layer) of DeepSeek-R1-Distill-Qwen-7B
SHAPES = (("blk.0.attn_q.weight", QT.Q4_K, 3584, 3584, 2),     # attn_q + attn_output
          ("blk.0.attn_k.weight", QT.Q4_K, 512, 3584, 1),
          ("blk.0.attn_v.weight", QT.Q6_K, 512, 3584, 1),
          ("blk.0.ffn_gate.weight", QT.Q4_K, 18944, 3584, 2),  # ffn_gate + ffn_up
          ("blk.0.ffn_down.weight", QT.Q6_K, 3584, 18944, 1))


def info(name, qt, n_out, n_in) -> TensorInfo:
    rb = quants.row_bytes(qt, n_in)
    return TensorInfo(name=name, qtype=qt, shape=(n_out, n_in), offset=0, nbytes=n_out * rb,
                      n_elements=n_out * n_in, row_bytes=rb, n_rows=n_out)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python3 -m scripts.bench.gemm_paths", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--tokens", default="2,8,16,32,48,64,96,128,256,512")
    ap.add_argument("-r", "--reps", type=int, default=9)
    a = ap.parse_args()
    import cupy as cp

    from minfer.backend.cuda.parts import Parts
    from minfer.backend.cuda.settings import CudaSettings
    from minfer.format.quantize import quantize
    ts = [int(t) for t in a.tokens.split(",")]
    rng = np.random.default_rng(0)
    settings = CudaSettings.from_env()
    parts = Parts(settings, eps=1e-6)
    store, st = parts.store, parts.lin
    ws = []
    for name, qt, n_out, n_in, n in SHAPES:
        x = (rng.standard_normal((n_out, n_in), dtype=np.float32) * 0.02)
        ws.append((name, store.register(name, info(name, qt, n_out, n_in), quantize(x, qt, search=False)), n))
    xs = cp.asarray(rng.standard_normal((max(ts), 18944), dtype=np.float32))

    def eager_ms(w, T) -> float:
        """one call on an idle device: what a one-shot prompt pays (host included)"""
        x = xs[:T, :w.n_in].copy()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        st.linear(x, w)
        e1.record()
        e1.synchronize()
        return cp.cuda.get_elapsed_time(e0, e1)

    def graph_ms(w, T) -> float:
        """device time alone: the call captured in a CUDA graph, one replay timed"""
        x = xs[:T, :w.n_in].copy()
        y = cp.empty((T, w.n_out), cp.float32)
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            st.linear(x, w, out=y)                     # scratch and pool warm
            s.synchronize()
            s.begin_capture(getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", 2))
            st.linear(x, w, out=y)
            g = s.end_capture()
            g.launch(s)
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(s)
            g.launch(s)
            e1.record(s)
            e1.synchronize()
        return cp.cuda.get_elapsed_time(e0, e1)

    print(f"{'T':>5} {'weight':<12}{'eager: mmq':>11}{'f16':>8}{'f16/mmq':>8}"
          f"{'graph: mmq':>12}{'f16':>8}{'f16/mmq':>8}   (ms, medians)")
    wins = []
    for T in ts:
        layer = dict.fromkeys(("e_mmq", "e_f16", "g_mmq", "g_f16"), 0.0)
        for name, w, n in ws:
            t = {k: [] for k in layer}
            for rep in range(a.reps + 2):                     # 2 warm-ups, then A B A B ...
                for eng, min_t in (("mmq", 1 << 30), ("f16", 2)):
                    parts.settings = settings.replace(f16_min_t=min_t)
                    e, g = eager_ms(w, T), graph_ms(w, T)
                    if rep >= 2:
                        t["e_" + eng].append(e)
                        t["g_" + eng].append(g)
            m = {k: statistics.median(v) for k, v in t.items()}
            for k in layer:
                layer[k] += n * m[k]
            print(f"{T:>5} {name.split('.')[2]:<12}{m['e_mmq']:11.3f}{m['e_f16']:8.3f}"
                  f"{m['e_f16'] / m['e_mmq']:8.2f}{m['g_mmq']:12.3f}{m['g_f16']:8.3f}{m['g_f16'] / m['g_mmq']:8.2f}")
        m = layer
        print(f"{T:>5} {'= layer':<12}{m['e_mmq']:11.3f}{m['e_f16']:8.3f}{m['e_f16'] / m['e_mmq']:8.2f}"
              f"{m['g_mmq']:12.3f}{m['g_f16']:8.3f}{m['g_f16'] / m['g_mmq']:8.2f}")
        wins.append((T, m["e_f16"] < m["e_mmq"], m["g_f16"] < m["g_mmq"]))
    for i, label in ((0, "eager"), (1, "graph (device time)")):
        first = next((T for T, *w in wins if all(w2[i] for T2, *w2 in wins if T2 >= T)), None)
        print(f"{label}: f16 path wins for the whole layer from T = {first}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
