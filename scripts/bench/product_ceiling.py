#!/usr/bin/env python3
"""The prefill's ceiling under sustained load: a model's products alone, and the
products with the flash attention, run forward after forward as `minfer bench` runs
its repetitions, so the GPU is timed at the clock its power limit leaves it.

    python3 -m scripts.bench.product_ceiling [-m MODEL_OR_HEADER] [-p 512,3325] [-r 10]

Shapes from a GGUF header (default: the bundled DeepSeek-R1-Distill-Qwen-7B one).
Per layer, the products through cuBLASLt with the shapes and output types of the
backend's f16 engine (minfer/backend/cuda/linears.py): q/k/v as one GEMM with an f32
output, o added to an f32 residual (beta = 1), gate/up as one GEMM with an f16
output, down added to the residual; f16 weights (seeded Gaussian, std 1/sqrt(n_in),
one set per layer, so no layer finds the last one's weights in L2), f32
accumulation. `+ attention` adds `flash_attention` over a causal prompt of the same
length (head dim 128 only). Nothing else of a forward runs: no dequantization,
norms, RoPE, SwiGLU or LM head. So tokens/s here is what a forward whose products
run at cuBLAS's sustained rate cannot exceed, and the gap to `minfer bench` is what
the rest of the forward costs.

Each mode: two untimed forwards, then -r forwards timed one by one with CUDA
events, back to back; modes alternate twice. With `nvidia-smi` on the PATH the
SM clock is sampled every 50 ms and its median over each mode's run is printed.
"""
from __future__ import annotations

import argparse
import datetime as dt
import shutil
import statistics
import subprocess
import sys
import time

from minfer.tools.bench import parse_lengths
from minfer.errors import MinferError

MODES = ("products", "products + attention")


def shapes(path) -> dict:
    from minfer.config import ModelConfig
    from minfer.format.gguf import open_gguf
    gf = open_gguf(str(path), header_only=True)
    try:
        cfg = ModelConfig.from_gguf(gf)
    finally:
        gf.close()
    hd = cfg.d_model // cfg.n_head
    return {"n_layer": cfg.n_layer, "d": cfg.d_model, "d_ff": cfg.d_ff, "n_head": cfg.n_head,
            "n_kv": cfg.n_head_kv, "hd": hd, "kv": cfg.n_head_kv * hd}


def product_flop(s: dict, T: int) -> float:
    d, kv, f = s["d"], s["kv"], s["d_ff"]
    return 2.0 * T * s["n_layer"] * ((d + 2 * kv) * d + d * d + 2 * f * d + f * d)


class Clock:
    """nvidia-smi sampling the SM clock every 50 ms in the background (if present)."""

    def __init__(self):
        self.proc = None
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=timestamp,clocks.sm", "--format=csv,noheader,nounits",
                 "-lms", "50"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            time.sleep(0.5)

    def samples(self) -> list[tuple[dt.datetime, float]]:
        if self.proc is None:
            return []
        self.proc.terminate()
        out = []
        for line in self.proc.stdout.read().splitlines():
            try:
                ts, mhz = (v.strip() for v in line.split(","))
                out.append((dt.datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f"), float(mhz)))
            except ValueError:
                pass
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m scripts.bench.product_ceiling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="GGUF file or header (default: the bundled 7B header)")
    ap.add_argument("-p", "--n-prompt", default="512,3325", help="prompt lengths (default 512,3325)")
    ap.add_argument("-r", "--reps", type=int, default=10, help="timed forwards per mode and round (default 10)")
    args = ap.parse_args(argv)
    try:
        lengths = parse_lengths(args.n_prompt)          # minfer bench's -p
        if args.reps < 1:
            raise MinferError(f"-r must be at least 1, got {args.reps}")
    except MinferError as e:
        print(f"product_ceiling: error: {e}", file=sys.stderr)
        return 2

    import cupy as cp

    from minfer.backend.cuda.kernels.decode_attn import FA_HD
    from minfer.backend.cuda.kernels.flash_attn import flash_attention
    from minfer.backend.cuda.cublas import best_kernels, gemm_f16
    from minfer.tools.synth import header_7b_path

    s = shapes(args.model or header_7b_path())
    L, d, kv, f, T_max = s["n_layer"], s["d"], s["kv"], s["d_ff"], max(lengths)
    attention = s["hd"] == FA_HD
    rs = cp.random.RandomState(0)

    def gaussian(rows: int, cols: int, std: float):
        return (rs.standard_normal((rows, cols), dtype=cp.float32) * std).astype(cp.float16)

    try:
        layers = [{"qkv": gaussian(d + 2 * kv, d, d ** -0.5), "o": gaussian(d, d, d ** -0.5),
                   "gateup": gaussian(2 * f, d, d ** -0.5), "down": gaussian(d, f, f ** -0.5)}
                  for _ in range(L)]
        x_full = gaussian(T_max, d, 1.0)                    # the normed rows (f16 GEMM operand)
        h_full = gaussian(T_max, f, 0.3)                    # SwiGLU's output, down's operand
        q_full = gaussian(T_max * s["n_head"], FA_HD, 1.0).reshape(T_max, s["n_head"], FA_HD)
        k_cache = gaussian(T_max * s["n_kv"], FA_HD, 1.0).reshape(T_max, s["n_kv"], FA_HD)
        v_cache = gaussian(T_max * s["n_kv"], FA_HD, 1.0).reshape(T_max, s["n_kv"], FA_HD)
    except cp.cuda.memory.OutOfMemoryError:
        gib = sum(2 * n for n in ((d + 2 * kv) * d, d * d, 2 * f * d, f * d)) * L / 2**30
        print(f"product_ceiling: out of GPU memory for {L} layers of f16 weights ({gib:.1f} GiB)",
              file=sys.stderr)
        return 2

    def forward(T: int, with_attention: bool) -> None:
        x, h = x_full[:T], h_full[:T]
        qkv = cp.empty((T, d + 2 * kv), cp.float32)
        gateup = cp.empty((T, 2 * f), cp.float16)
        res = cp.zeros((T, d), cp.float32)
        att = cp.empty((T, s["n_head"] * FA_HD), cp.float16) if with_attention else x
        for w in layers:
            gemm_f16(x, w["qkv"], qkv)
            if with_attention:
                flash_attention(q_full[:T], k_cache[:T], v_cache[:T], 0, att)
            gemm_f16(att, w["o"], res, accumulate=True)
            gemm_f16(x, w["gateup"], gateup)
            gemm_f16(h, w["down"], res, accumulate=True)

    modes = MODES if attention else MODES[:1]
    clock = Clock()
    runs = []                                             # (T, mode, t0, t1, [ms])
    start, end = cp.cuda.Event(), cp.cuda.Event()
    with best_kernels():
        for T in lengths:
            for _ in range(2):
                for mode in modes:
                    wa = mode != MODES[0]
                    for _ in range(2):
                        forward(T, wa)
                    cp.cuda.Device().synchronize()
                    t0, ms = dt.datetime.now(), []
                    for _ in range(args.reps):
                        start.record()
                        forward(T, wa)
                        end.record()
                        end.synchronize()
                        ms.append(cp.cuda.get_elapsed_time(start, end))
                    runs.append((T, mode, t0, dt.datetime.now(), ms))
                    time.sleep(1.0)                       # the next mode starts from a rested GPU
    samples = clock.samples()

    print(f"{L} layers, d {d}, d_ff {f}, {s['n_head']}/{s['n_kv']} heads of {s['hd']}; "
          f"{args.reps} forwards a run, two runs a mode alternated")
    print("| tokens | mode | ms / forward | min | max | tok/s | products TFLOP/s | SM MHz |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for T, mode, t0, t1, ms in runs:
        med = statistics.median(ms)
        mhz = [c for t, c in samples if t0 <= t <= t1]
        tflops = f"{product_flop(s, T) / med / 1e9:.0f}" if mode == MODES[0] else ""
        print(f"| {T:,} | {mode} | {med:.2f} | {min(ms):.2f} | {max(ms):.2f} | {T / med * 1e3:,.0f} | "
              f"{tflops} | {statistics.median(mhz) if mhz else float('nan'):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
