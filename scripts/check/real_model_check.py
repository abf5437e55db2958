#!/usr/bin/env python3
"""The real Qwen2.5-Coder-1.5B on the GPU against llama.cpp's fixtures.

    python3 -m scripts.check.real_model_check -m MODEL [--backend cuda]

Greedy 64-token streams from the greedy fixture's prompts (EOS ignored, raw
prompts, as llama.cpp made them), each compared with llama.cpp's text: the
number of leading characters that agree and whether the first 16 tokens match.
llama.cpp quantizes activations to 8 bits in its matmuls, so a stream may part
from it after a near-tie; the count says where.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "greedy_qwen2.5-coder-1.5b.json"


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(prog="python3 -m scripts.check.real_model_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    a = ap.parse_args()

    from minfer.engine import Engine
    from minfer.generate import GenerationStats, generate
    cases = json.loads(FIXTURE.read_text(encoding="utf-8"))
    eng = Engine.load(a.model, backend=a.backend, n_ctx=2048, progress=False)
    tok = eng.tokenizer
    print("| prompt | chars agreeing / llama.cpp's | first 16 tokens | decode tok/s |")
    print("| --- | ---: | --- | ---: |")
    for c in cases:
        ids = [int(i) for i in c["prompt_ids"]]
        st = GenerationStats()
        out = list(generate(eng, ids, c["n_predict"], ignore_eos=True, stats=st))
        text = tok.decode(out)
        want = c["greedy_text"]
        want16 = tok.encode(want, parse_special=False, add_bos=False)[:16]
        head = repr(c["prompt"][:28])
        print(f"| {head} | {common_prefix(text, want)} / {len(want)} | "
              f"{'equal' if out[:16] == want16 else 'differ'} | "
              f"{'n/a' if st.decode_tps is None else f'{st.decode_tps:.1f}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
