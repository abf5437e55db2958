#!/usr/bin/env python3
"""Golden greedy streams: byte-identity regression of the CUDA engine.

    python3 -m scripts.check.golden --update [--out DIR]   # write tests/golden/<name>.json (GPU)
    python3 -m scripts.check.golden                        # re-run, compare byte for byte (exit 1 + diff)
    python3 -m scripts.check.golden --report FILE          # re-run, write streams + launch counters (tests)
    python3 -m scripts.check.golden --set force_exp_miss=1 # the same under CUDA settings (scripts/fields.py)

A synthetic qwen2 model (minfer.tools.synth.SMALL_MODEL, fixed seed; the same arguments
give the same bytes) is generated once into --model-dir, then each fixed prompt is
greedily decoded on the CUDA backend with EOS ignored. n_predict starts at
N_PREDICT and grows by 16 until the text is at least MIN_CHARS characters (the
byte-identity check compares streams of at least 178 characters).
Each file: {"model": synth params + seed, "prompt", "prompt_ids", "n_predict",
"token_ids", "text"}.

--set FIELD=VALUE (repeated or comma-separated) runs under CudaSettings fields: the
load-time ones given to Engine.load, the run-time ones set with backend.using for
the whole run (tests/gpu/test_golden_gpu.py runs the modes exp_planes=0,
force_exp_miss=1 and flash_wgmma=0 this way, each in its own process).
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from pathlib import Path

from minfer.tools.synth import SMALL_MODEL, synth_model
from scripts import fields as settings_fields

ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = ROOT / "tests" / "golden"
PROMPTS = {
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "prose": "The quick brown fox jumps over the lazy dog. In the beginning",
    "chat": "<|im_start|>user\nWrite a haiku about GPUs.<|im_end|>\n<|im_start|>assistant\n",
    "digits": "1, 1, 2, 3, 5, 8, 13, 21,",
}
N_PREDICT = 48
MIN_CHARS = 178
N_CTX = 512


def greedy(engine, prompt_ids: list[int], n_predict: int) -> list[int]:
    from minfer.generate import generate

    cache = engine.new_cache(N_CTX)
    return [int(t) for t in generate(engine, prompt_ids, n_predict, ignore_eos=True, cache=cache)]


def make_stream(engine, prompt: str, n_predict: int | None = None) -> dict:
    """Greedy stream for one prompt; n_predict None = grow until MIN_CHARS."""
    tok = engine.tokenizer
    ids = [int(i) for i in tok.encode(prompt)]
    n = n_predict or N_PREDICT
    while True:
        out = greedy(engine, ids, n)
        text = tok.decode(out)
        if n_predict is not None or len(text) >= MIN_CHARS:
            break
        n += 16
    return {"model": dict(SMALL_MODEL), "prompt": prompt, "prompt_ids": ids, "n_predict": n,
            "token_ids": out, "text": text}


def load_golden(golden_dir: Path = GOLDEN_DIR) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text(encoding="utf-8"))
            for p in sorted(Path(golden_dir).glob("*.json"))}


def dump(rec: dict) -> str:
    return json.dumps(rec, indent=1, ensure_ascii=False) + "\n"


def compare(name: str, want: dict, got: dict) -> list[str]:
    """Byte-for-byte: token ids and the UTF-8 text; -> lines of diff (empty if equal)."""
    lines = []
    if got["prompt_ids"] != want["prompt_ids"]:
        lines.append(f"{name}: prompt ids differ (tokenizer changed): "
                     f"{want['prompt_ids']} -> {got['prompt_ids']}")
    if got["token_ids"] != want["token_ids"]:
        k = next((i for i, (a, b) in enumerate(zip(want["token_ids"], got["token_ids"])) if a != b),
                 min(len(want["token_ids"]), len(got["token_ids"])))
        lines.append(f"{name}: token ids differ from index {k}: golden {want['token_ids'][k:k + 8]} "
                     f"vs now {got['token_ids'][k:k + 8]}")
    if got["text"].encode() != want["text"].encode():
        lines += difflib.unified_diff(want["text"].splitlines(), got["text"].splitlines(),
                                      f"golden/{name}", f"now/{name}", lineterm="")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m scripts.check.golden", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--update", action="store_true", help="regenerate the golden files")
    ap.add_argument("--out", type=Path, default=GOLDEN_DIR, help="where --update writes")
    ap.add_argument("--golden", type=Path, default=GOLDEN_DIR, help="golden files to check against")
    ap.add_argument("--report", type=Path, help="write the streams and launch counters as JSON")
    ap.add_argument("--model-dir", type=Path, default=Path(os.environ.get("MINFER_CACHE", "/tmp/minfer-golden")))
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--set", action="append", metavar="FIELD=VALUE", dest="settings",
                    help="a CudaSettings field for the whole run, e.g. force_exp_miss=1 (repeatable)")
    args = ap.parse_args(argv)

    from minfer.errors import MinferError

    try:
        load_fields, run_fields = settings_fields.split(settings_fields.parse(args.settings))
        engine = settings_fields.load_engine(synth_model(args.model_dir), args.backend, N_CTX, load_fields)
        with settings_fields.using(engine, run_fields):
            return _run(args, engine)
    except MinferError as e:
        print(f"golden: error: {e}", file=sys.stderr)
        return 2


def _run(args, engine) -> int:
    engine.backend.reset_counters()
    if args.update:
        args.out.mkdir(parents=True, exist_ok=True)
        for name, prompt in PROMPTS.items():
            rec = make_stream(engine, prompt)
            (args.out / f"{name}.json").write_text(dump(rec), encoding="utf-8")
            print(f"{name}: {len(rec['token_ids'])} tokens, {len(rec['text'])} chars -> "
                  f"{args.out / (name + '.json')}")
        return 0
    golden = load_golden(args.golden)
    if not golden:
        print(f"no golden files in {args.golden}; run with --update first", file=sys.stderr)
        return 1
    got = {name: make_stream(engine, rec["prompt"], rec["n_predict"]) for name, rec in golden.items()}
    if args.report:
        rep = {"streams": got,
               "counters": engine.backend.counters(),
               "plane_bytes": engine.backend.memory_report().get("W_exp planes")}
        args.report.write_text(json.dumps(rep, ensure_ascii=False), encoding="utf-8")
    bad = []
    for name, rec in golden.items():
        if rec["model"] != SMALL_MODEL:
            bad.append(f"{name}: made with model {rec['model']}, this script builds {SMALL_MODEL}")
        bad += compare(name, rec, got[name])
    for name in golden:
        print(f"{name}: {'OK' if not compare(name, golden[name], got[name]) else 'MISMATCH'} "
              f"({len(got[name]['token_ids'])} tokens, {len(got[name]['text'])} chars)")
    if bad:
        print("\n".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
