#!/usr/bin/env python3
"""Where a greedy decode step's device time goes: every launch of the step, timed
alone at the model's shapes, summed over the layers.

    python3 -m scripts.bench.decode_breakdown [--header models/...header.gguf] [-d 16,3325]

The shapes and each layer's weight types come from a GGUF header (default: the
7B's). Each launch is captured 20 times in a CUDA graph and the replay timed
(scripts/bench/bench_ops.py graph_ms), so a row is one launch's device time including
its share of the graph's per-kernel cost; the launches are the ones the CUDA
backend issues for one token (minfer/backend/cuda/linears.py: norm_linears; ffn.py;
attention_block.py). Random weights with finite scales. Printed per
kernel family: us per step, share, launches per step, and GB/s where the launch
streams weights; then the sum beside the tokens/s it implies.
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

from minfer.config import ModelConfig
from minfer.format.gguf import open_gguf
from scripts.bench.bench_ops import graph_ms, random_weight

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_HEADER = ROOT / "models" / "deepseek-r1-distill-qwen-7b-q4_k_m.header.gguf"


def layer_types(f) -> list[tuple[QT, ...]]:
    """Per layer: the types of q, k, v, o, gate, up, down."""
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    by_name = {t.name: QT(t.qtype) for t in f.tensors.values()}
    n_layer = sum(1 for n in by_name if n.endswith(".attn_q.weight"))
    return [tuple(by_name[f"blk.{i}.{n}.weight"] for n in names) for i in range(n_layer)]


def main() -> int:
    ap = argparse.ArgumentParser(prog="python3 -m scripts.bench.decode_breakdown", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--header", default=str(DEFAULT_HEADER))
    ap.add_argument("-d", "--depths", default="16,3325", help="context lengths to time attention at")
    a = ap.parse_args()
    import cupy as cp

    from minfer.backend.cuda.kernels import argmax, decode_attn, dequant, norm, quantize, rope
    from minfer.backend.cuda.launch import DevicePos
    from minfer.backend.cuda.kernels.matvec import matvec, matvecs, split_of
    f = open_gguf(a.header, header_only=True)
    cfg = ModelConfig.from_gguf(f)
    d, kv, ff, hd = cfg.d_model, cfg.kv_dim, cfg.d_ff, cfg.head_dim
    depths = [int(x) for x in a.depths.split(",")]
    n_ctx = max(depths) + 1
    x = cp.random.standard_normal((1, d), dtype=cp.float32)
    nw = cp.ones(d, cp.float32)
    q8d = quantize.quantize_q8_1(x)
    table = cp.asarray(rope.rope_table(n_ctx, hd, cfg.rope_base))
    kc = cp.asarray(np.random.default_rng(0).standard_normal((n_ctx, cfg.n_head_kv, hd)).astype(np.float16))
    vc = kc.copy()
    q = cp.random.standard_normal((1, cfg.n_head, hd), dtype=cp.float32)
    k = cp.random.standard_normal((1, cfg.n_head_kv, hd), dtype=cp.float32)
    a8 = quantize.quantize_q8_1(q.reshape(1, -1))

    weights: dict = {}

    def w(qt, n_out, n_in):
        key = (qt, n_out, n_in)
        if key not in weights:
            weights[key] = random_weight(cp, qt, n_out, n_in).reshape(n_out, -1)
        return weights[key]

    times: dict = collections.defaultdict(float)      # family -> us per step
    launches: collections.Counter = collections.Counter()
    nbytes: dict = collections.defaultdict(int)
    memo: dict = {}

    def add(family, key, fn, n=1, wbytes=0):
        if key not in memo:
            memo[key] = graph_ms(cp, fn) * 1e3
        times[family] += memo[key] * n
        launches[family] += n
        nbytes[family] += wbytes * n

    combos = collections.Counter(layer_types(f))
    for (tq, tk, tv, to, tg, tu, td), n in combos.items():
        add("rmsnorm -> q8_1", "norm", lambda: norm.rmsnorm_q8_1(x, nw, 1e-6), 2 * n)
        groups = collections.defaultdict(list)               # one launch per split (types shared)
        for t, od in ((tq, d), (tk, kv), (tv, kv)):
            groups[split_of(od)].append((t, w(t, od, d), od, None, None, None))
        for sp, segs in groups.items():
            key = ("qkv", sp, tuple(seg[0] for seg in segs))
            add("matvec q/k/v", key, lambda segs=segs: matvecs(*q8d, segs), n, sum(seg[1].nbytes for seg in segs))
        add("matvec o (+residual)", ("o", to), lambda: matvec(to, *a8, w(to, d, cfg.n_head * hd), d, res=x), n,
            w(to, d, cfg.n_head * hd).nbytes)
        segs = [(tg, w(tg, ff, d), ff, None, None, None), (tu, w(tu, ff, d), ff, None, None, None)]
        add("matvec gate+up", ("gu", tg), lambda: matvecs(*q8d, segs), n, 2 * segs[0][1].nbytes)
        g = cp.random.standard_normal((1, ff), dtype=cp.float32)
        add("swiglu -> q8_1", "swiglu", lambda: quantize.swiglu_q8_1(g, g), n)
        h8 = quantize.quantize_q8_1(g)
        add(f"matvec down {td.name} (+residual)", ("down", td), lambda td=td: matvec(td, *h8, w(td, d, ff), d, res=x),
            n, w(td, d, ff).nbytes)
    out_t = QT(f.tensors["output.weight"].qtype) if "output.weight" in f.tensors else QT(f.tensors["token_embd.weight"].qtype)
    add("rmsnorm -> q8_1", "norm", lambda: norm.rmsnorm_q8_1(x, nw, 1e-6))
    add("LM head matvec", "head", lambda: matvec(out_t, *q8d, w(out_t, cfg.vocab_size, d), cfg.vocab_size),
        wbytes=w(out_t, cfg.vocab_size, d).nbytes)
    logits = cp.random.standard_normal((1, cfg.vocab_size), dtype=cp.float32)
    add("argmax", "argmax", lambda: argmax.argmax(logits))
    tok = cp.asarray([5], cp.int32)
    add("embedding row", "embed", lambda: dequant.dequant_rows(QT.Q4_K, w(QT.Q4_K, cfg.vocab_size, d), d, tok))

    base = sum(times.values())
    print(f"{Path(a.header).name}: {cfg.n_layer} layers, d {d}, d_ff {ff}, {cfg.n_head}/{cfg.n_head_kv} heads")
    for depth in depths:
        pos = DevicePos(depth, cp.asarray([depth], cp.int32))
        att = graph_ms(cp, lambda: decode_attn.decode_attention(q, kc, vc, pos, new_kv=(k, k), cos_sin=table,
                                                              neox=cfg.rope_neox, q8=a8)) * 1e3 * cfg.n_layer
        total = base + att
        # one launch a layer below the one-launch limit, else the splits and the combine
        att_n = (1 if decode_attn.decode_short(depth) else 2) * cfg.n_layer
        att_fam = f"attention + RoPE + KV store, combine to q8_1 @ {depth}"
        rows = sorted({**times, att_fam: att}.items(), key=lambda r: -r[1])
        print(f"\n| kernel family @ context {depth} | us/step | share | launches | GB/s |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for fam, us in rows:
            n = launches.get(fam, att_n)
            gbs = f"{nbytes[fam] / us / 1e3:,.0f}" if nbytes.get(fam) else ""
            print(f"| {fam} | {us:,.1f} | {us / total:.0%} | {n} | {gbs} |")
        n_launch = sum(launches.values()) + att_n
        print(f"| **sum** | **{total:,.1f}** | | {n_launch} | |")
        print(f"-> {1e6 / total:,.0f} tok/s if the step were exactly these launches back to back")
    return 0


if __name__ == "__main__":
    sys.exit(main())
