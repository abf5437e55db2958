#!/usr/bin/env python3
"""Event-timed micro-benchmarks of the f16 prefill ops at the 7B's shapes.

    python3 -m scripts.bench.bench_ops [-t 512,3325] [--matvec-only]

Per weight of a DeepSeek-R1-Distill-Qwen-7B layer (d 3584, d_ff 18944, 28 query /
4 KV heads of 128): the f16 dequantization (GB/s; q6_K also from a W_exp plane),
the cuBLAS GEMM into f32 and f16 outputs (TFLOP/s), and the flash attention
(TFLOP/s over the causal half), then the sum over 28 layers as an upper bound
on the prefill rate before norms, RoPE, SwiGLU and the LM head. Then the decode
matvecs at the 7B's shapes: GB/s of weight bytes read, beside a device-to-device
copy measured in the same process (the bandwidth decode can hope for). Medians
of 20 CUDA-event timings after 3 warm-ups; random bytes with finite scales.
Needs the GPU (cupy and the CUDA backend's modules are imported once it runs);
scripts.bench.decode_breakdown imports its timing helpers.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
from gguf import GGMLQuantizationType as QT

N_LAYER, N_HEAD, N_KV = 28, 28, 4
LAYER = (("attn_q", QT.Q4_K, 3584, 3584), ("attn_k", QT.Q4_K, 512, 3584),
         ("attn_v", QT.Q6_K, 512, 3584), ("attn_output", QT.Q4_K, 3584, 3584),
         ("ffn_gate", QT.Q4_K, 18944, 3584), ("ffn_up", QT.Q4_K, 18944, 3584),
         ("ffn_down", QT.Q6_K, 3584, 18944))


def time_ms(cp, fn, reps: int = 20) -> float:
    """Median milliseconds of fn() on the current stream (CUDA events, 3 warm-ups)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(times))


def graph_ms(cp, fn, n: int = 20) -> float:
    """Device milliseconds of one fn(): n calls captured in a CUDA graph, the replay
    timed (time_ms of a small kernel would time Python's launch overhead instead)."""
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        fn()                                          # compile, warm
        s.synchronize()
        s.begin_capture()
        for _ in range(n):
            fn()
        g = s.end_capture()
        return time_ms(cp, lambda: g.launch(s)) / n


def dequant_bytes(qtype, n_out: int, n_in: int, w_exp: bool) -> int:
    """Device bytes one dequant_f16 call reads + writes."""
    from minfer.backend.cuda.nvrtc import K
    n_sb = n_out * (n_in // K["QK_K"])
    if qtype == QT.Q4_K:
        read = n_sb * K["Q4K_BYTES"]
    elif w_exp:
        read = n_sb * (K["QK_K"] + 32)       # plane + the scale/d sector of each padded block
    else:
        read = n_sb * K["Q6K_PADDED"]
    return read + 2 * n_out * n_in


def random_weight(cp, qtype, n_out: int, n_in: int):
    """Random device bytes of a (n_out, n_in) weight with finite scales (d = 0.01)."""
    from minfer.backend.cuda.nvrtc import K
    n_sb = n_out * (n_in // K["QK_K"])
    stride, d_at = ((K["Q4K_BYTES"], (0, 2)) if qtype == QT.Q4_K else (K["Q6K_PADDED"], (208,)))
    raw = cp.random.randint(0, 256, (n_sb, stride), dtype=cp.int32).astype(cp.uint8)
    d = cp.asarray(np.frombuffer(np.float16(0.01).tobytes(), np.uint8))
    for off in d_at:
        raw[:, off:off + 2] = d
    return raw.reshape(-1)


# decode matvecs of one 7B token: (name, type, n_out, n_in)
MATVEC = (("attn_k", QT.Q4_K, 512, 3584), ("attn_v", QT.Q6_K, 512, 3584),
          ("attn_q", QT.Q4_K, 3584, 3584), ("ffn_gate", QT.Q4_K, 18944, 3584),
          ("ffn_down", QT.Q6_K, 3584, 18944), ("ffn_down q4_K", QT.Q4_K, 3584, 18944),
          ("output", QT.Q6_K, 152064, 3584))


def copy_gbs(cp) -> float:
    """GB/s (read + write) of a 1 GiB device-to-device copy."""
    src = cp.empty(1 << 30, cp.uint8)
    dst = cp.empty_like(src)
    return 2 * src.nbytes / time_ms(cp, lambda: dst.__setitem__(Ellipsis, src)) / 1e6


def bench_matvec(cp) -> None:
    from minfer.backend.cuda.kernels.quantize import quantize_q8_1
    from minfer.backend.cuda.kernels.matvec import matvec, matvecs

    copy = copy_gbs(cp)
    print(f"device-to-device copy: {copy:,.0f} GB/s (read + write)")
    print(f"{'matvec':<22}{'shape':>16}{'us':>9}{'GB/s':>8}{'of copy':>9}")
    for name, qt, n_out, n_in in MATVEC:
        raw = random_weight(cp, qt, n_out, n_in).reshape(n_out, -1)
        xq8 = quantize_q8_1(cp.random.standard_normal((1, n_in), dtype=cp.float32))
        y = cp.empty((1, n_out), cp.float32)
        ms = graph_ms(cp, lambda: matvec(qt, *xq8, raw, n_out, None, y))
        _row(name, f"{n_in}->{n_out}", ms, raw.nbytes, copy)
    # the shared launches of a decode step: q and k in one, gate and up in one
    d, kv, ff = 3584, 512, 18944
    xq8 = quantize_q8_1(cp.random.standard_normal((1, d), dtype=cp.float32))
    wq, wk = (random_weight(cp, QT.Q4_K, n, d).reshape(n, -1) for n in (d, kv))
    ms = graph_ms(cp, lambda: matvecs(*xq8, [(QT.Q4_K, wq, d, None, None, None),
                                                 (QT.Q4_K, wk, kv, None, None, None)]))
    _row("attn_q+k (1 launch)", f"{d}->{d}+{kv}", ms, wq.nbytes + wk.nbytes, copy)
    wg, wu = (random_weight(cp, QT.Q4_K, ff, d).reshape(ff, -1) for _ in range(2))
    ms = graph_ms(cp, lambda: matvecs(*xq8, [(QT.Q4_K, wg, ff, None, None, None),
                                                 (QT.Q4_K, wu, ff, None, None, None)]))
    _row("ffn_gate+up (1 launch)", f"{d}->2x{ff}", ms, wg.nbytes + wu.nbytes, copy)


def _row(name: str, shape: str, ms: float, nbytes: int, copy: float) -> None:
    gbs = nbytes / ms / 1e6
    print(f"{name:<22}{shape:>16}{ms * 1e3:9.1f}{gbs:8.0f}{gbs / copy:9.0%}")


def main() -> int:
    ap = argparse.ArgumentParser(prog="python3 -m scripts.bench.bench_ops", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--tokens", default="512,3325")
    ap.add_argument("--matvec-only", action="store_true", help="only the decode matvecs")
    a = ap.parse_args()
    import cupy as cp

    from minfer.backend.cuda.kernels.decode_attn import FA_HD
    from minfer.backend.cuda.kernels.flash_attn import flash_attention
    from minfer.backend.cuda.cublas import gemm_f16
    from minfer.backend.cuda.kernels.dequant_f16 import dequant_f16

    bench_matvec(cp)
    if a.matvec_only:
        return 0
    tokens = [int(t) for t in a.tokens.split(",")]
    w16 = cp.empty(18944 * 3584, cp.float16)                          # the largest weight, f16
    print(f"{'op':<30}{'ms':>9}{'GB/s':>9}{'TFLOP/s':>9}")
    deq_ms = {}
    for name, qt, n_out, n_in in LAYER:
        raw = random_weight(cp, qt, n_out, n_in)
        planes = [None]
        if qt == QT.Q6_K:
            planes.append(cp.random.randint(-32, 32, n_out * n_in, dtype=cp.int32).astype(cp.int8))
        for plane in planes:
            ms = time_ms(cp, lambda: dequant_f16(raw, qt, n_out, n_in, w16, plane))
            gbs = dequant_bytes(qt, n_out, n_in, plane is not None) / ms / 1e6
            label = f"dequant {name}{' (W_exp)' if plane is not None else ''}"
            print(f"{label:<30}{ms:9.3f}{gbs:9.0f}{'':>9}")
            deq_ms.setdefault(name, ms)
    for T in tokens:
        x16 = cp.random.standard_normal((T, 18944)).astype(cp.float16)
        layer_ms = sum(deq_ms.values())
        for name, qt, n_out, n_in in LAYER:
            xs = x16[:, :n_in].copy()
            ws = w16[: n_out * n_in].reshape(n_out, n_in)
            for dt in (cp.float32, cp.float16):
                out = cp.empty((T, n_out), dt)
                ms = time_ms(cp, lambda: gemm_f16(xs, ws, out))
                if dt == cp.float32:
                    layer_ms += ms
                print(f"{f'gemm T={T} {name} ->{np.dtype(dt).name}':<30}{ms:9.3f}{'':>9}"
                      f"{2 * T * n_out * n_in / ms / 1e9:9.1f}")
        q16 = cp.random.standard_normal((T, N_HEAD, FA_HD)).astype(cp.float16)
        kc = cp.random.standard_normal((T, N_KV, FA_HD)).astype(cp.float16)
        vc = cp.random.standard_normal((T, N_KV, FA_HD)).astype(cp.float16)
        o = cp.empty((T, N_HEAD * FA_HD), cp.float32)
        ms = time_ms(cp, lambda: flash_attention(q16, kc, vc, 0, o))
        flops = 4 * FA_HD * N_HEAD * T * (T + 1) / 2                 # QK^T and PV over the causal half
        layer_ms += ms
        print(f"{f'flash_attn T={T} 28/4 heads':<30}{ms:9.3f}{'':>9}{flops / ms / 1e9:9.1f}")
        print(f"  -> {N_LAYER} layers x (dequant + gemm f32 + attention) = {N_LAYER * layer_ms:.1f} ms, "
              f"{T / (N_LAYER * layer_ms / 1e3):,.0f} tok/s before norms, rope, swiglu and the LM head")
    return 0


if __name__ == "__main__":
    sys.exit(main())
