#!/usr/bin/env python3
"""One greedy stream under CUDA settings, to compare settings byte for byte.

    python3 -m scripts.check.greedy_stream -m MODEL -p PROMPT -n 40 -o OUT.txt [--set gateup_fused=0]

Loads MODEL (the load-time fields of --set given to Engine.load), warms up as
`minfer generate` does, then generates -n tokens greedily from the raw prompt
with end-of-generation ignored (the run-time fields of --set applied with
backend.using), writes the text's UTF-8 bytes to -o, and prints the launch
counters of the generation (engine.backend.counters(), the warm-up's not
counted): a line `text: N bytes -> FILE`, then one `NAME: N` line per counter.
scripts/check/gpu_check.sh runs it once per mode (a fresh process each) and
compares the files with cmp and the counters with grep.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minfer.errors import MinferError
from scripts import fields as settings_fields


def stream(model, prompt: str, n: int, settings: dict, backend: str = "cuda") -> tuple[str, dict]:
    """-> (the generated text, the generation's launch counters or {})"""
    load_fields, run_fields = settings_fields.split(settings)
    engine = settings_fields.load_engine(model, backend, None, load_fields)
    try:
        with settings_fields.using(engine, run_fields):
            engine.warmup()                             # resets the counters afterwards
            gen = engine.generate(prompt, n, ignore_eos=True)
            return gen.text, dict(engine.backend.counters() or {})
    finally:
        engine.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m scripts.check.greedy_stream", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-p", "--prompt", required=True, help="prompt text, as written (no escapes, no chat template)")
    ap.add_argument("-n", "--n-predict", type=int, default=40, help="tokens to generate (default 40)")
    ap.add_argument("-o", "--out", type=Path, required=True, help="file for the text's UTF-8 bytes")
    ap.add_argument("--set", action="append", metavar="FIELD=VALUE", dest="settings",
                    help="a CudaSettings field, e.g. gateup_fused=0 (repeatable; scripts/fields.py)")
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args(argv)
    try:
        if args.n_predict < 1:
            raise MinferError(f"-n must be at least 1, got {args.n_predict}")
        text, counters = stream(args.model, args.prompt, args.n_predict,
                                settings_fields.parse(args.settings), args.backend)
    except MinferError as e:
        print(f"greedy_stream: error: {e}", file=sys.stderr)
        return 2
    data = text.encode("utf-8")
    args.out.write_bytes(data)
    print(f"text: {len(data)} bytes -> {args.out}")
    for name, count in counters.items():
        print(f"{name}: {count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
