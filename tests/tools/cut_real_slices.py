#!/usr/bin/env python3
"""A fixture maker (not a test): cut small real weight slices out of the cached
Qwen2.5-Coder-1.5B Q4_K_M for the GPU kernel tests (tests/gpu/test_mmq.py), so they
run on real weight statistics without the 1.1 GB model on the GPU machine:

    attn_q   64 rows of blk.0.attn_q.weight   (q4_K, 1536 wide)
    ffn_down 64 rows of blk.0.ffn_down.weight (q6_K, 8960 wide)
    attn_v  128 rows of blk.0.attn_v.weight   (q6_K, 1536 wide)

Each slice is stored as raw bytes `<key>_raw` (rows, row_bytes) uint8, its
`<key>_shape` (rows, n_in) and `<key>_type` (GGMLQuantizationType value) in
tests/fixtures/real_slices.npz.

    python3 tests/tools/cut_real_slices.py [model.gguf]     # from the repository root
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT, GGUFReader

ROOT = Path(__file__).resolve().parents[2]
MODEL = Path.home() / ".cache/minfer/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
SLICES = {  # key: (tensor, rows, expected type)
    "attn_q": ("blk.0.attn_q.weight", 64, QT.Q4_K),
    "ffn_down": ("blk.0.ffn_down.weight", 64, QT.Q6_K),
    "attn_v": ("blk.0.attn_v.weight", 128, QT.Q6_K),
}


def main() -> int:
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__.strip())
        return 0
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else MODEL
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    out = {}
    for key, (name, rows, qtype) in SLICES.items():
        t = tensors[name]
        if t.tensor_type != qtype:
            sys.exit(f"{name} is {t.tensor_type.name}, expected {qtype.name}")
        n_in = int(t.shape[0])                     # ggml ne[0]: the row length
        raw = np.ascontiguousarray(t.data[:rows])  # (rows, row_bytes) uint8
        out[f"{key}_raw"] = raw
        out[f"{key}_shape"] = np.array([rows, n_in], np.int64)
        out[f"{key}_type"] = np.array(int(qtype), np.int64)
        print(f"{key}: {name} {qtype.name} ({rows}, {n_in}) {raw.nbytes} bytes")
    dst = ROOT / "tests" / "fixtures" / "real_slices.npz"
    np.savez_compressed(dst, **out)
    print(f"wrote {dst} ({dst.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
