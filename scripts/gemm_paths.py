#!/usr/bin/env python3
"""Which GEMM engine wins at which prompt length: int8 MMQ vs f16 cuBLAS.

    python scripts/gemm_paths.py [-t 8,16,32,64,128,256,512] [-r 9]

Times `QuantState.linear` on the 7B's layer shapes (q4_K attn_q/attn_k/
ffn_gate, q6_K attn_v/ffn_down with their W_exp planes) at each token count,
once with every GEMM forced onto MMQ and once onto the f16 path, interleaved
rep by rep (CUDA events, medians). Prints a table and the smallest T at which
the f16 path wins for the layer as a whole: the basis of F16_GEMM_MIN_T.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType as QT  # noqa: E402

from minfer import quants  # noqa: E402
from minfer.gguf import TensorInfo  # noqa: E402
from minfer.backend.cuda_quant import QuantState  # noqa: E402

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
    import cupy as cp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--tokens", default="2,8,16,32,48,64,96,128,256,512")
    ap.add_argument("-r", "--reps", type=int, default=9)
    a = ap.parse_args()
    ts = [int(t) for t in a.tokens.split(",")]
    rng = np.random.default_rng(0)
    st = QuantState()
    ws = []
    for name, qt, n_out, n_in, n in SHAPES:
        x = (rng.standard_normal((n_out, n_in), dtype=np.float32) * 0.02)
        ws.append((name, st.register(name, info(name, qt, n_out, n_in), quants.quantize(x, qt, search=False)), n))
    xs = cp.asarray(rng.standard_normal((max(ts), 18944), dtype=np.float32))

    def run(w, T) -> float:
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        x = xs[:T, :w.n_in].copy()
        e0.record()
        st.linear(x, w)
        e1.record()
        e1.synchronize()
        return cp.cuda.get_elapsed_time(e0, e1)

    print(f"{'T':>5} {'weight':<22}{'mmq ms':>9}{'f16 ms':>9}{'f16/mmq':>9}")
    wins = []
    for T in ts:
        layer = {"mmq": 0.0, "f16": 0.0}
        for name, w, n in ws:
            t = {"mmq": [], "f16": []}
            for rep in range(a.reps + 2):                     # 2 warm-ups, then A B A B ...
                for eng, min_t in (("mmq", 1 << 30), ("f16", 2)):
                    st.f16_min_t = min_t
                    ms = run(w, T)
                    if rep >= 2:
                        t[eng].append(ms)
            m = {k: statistics.median(v) for k, v in t.items()}
            layer["mmq"] += n * m["mmq"]
            layer["f16"] += n * m["f16"]
            print(f"{T:>5} {name.split('.')[2]:<22}{m['mmq']:9.3f}{m['f16']:9.3f}{m['f16'] / m['mmq']:9.2f}")
        print(f"{T:>5} {'= layer':<22}{layer['mmq']:9.3f}{layer['f16']:9.3f}{layer['f16'] / layer['mmq']:9.2f}")
        wins.append((T, layer["f16"] < layer["mmq"]))
    first = next((T for T, w in wins if w and all(w2 for T2, w2 in wins if T2 >= T)), None)
    print(f"f16 path wins for the whole layer from T = {first}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
