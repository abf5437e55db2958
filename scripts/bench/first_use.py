#!/usr/bin/env python3
"""First use of a prompt length: a one-shot `minfer generate` beside `minfer bench`.

    python3 -m scripts.bench.first_use -m MODEL [-p 512,1000,3325] [-r 2] [--text FILE]

For each length P, a prompt of exactly P tokens (the longest prefix of --text,
repeated as needed, that the model's tokenizer makes into at most P tokens; the
table gives the count it reached) is written to a temporary file and run through
`minfer generate -f FILE -n 2 --ignore-eos --json` in a fresh process, -r times
(each process is a first use: warm-up as generate does by default, then this
length for the first time); its prompt tok/s is set beside `minfer bench -p P
-n 0` of the same lengths (graph-replayed, the steady state). Issue 10 asks the
first use for >= 85% of the bench. Run it on the GPU machine; the order of the
processes is generate, bench, generate, ... so drift hits both.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "tests" / "fixtures" / "perplexity_gpl3.txt"


def prompt_of(tokenizer, text: str, n: int) -> tuple[str, int]:
    """The longest prefix of text (repeated until long enough) of at most n tokens,
    and its token count (as `minfer generate` counts them: the model's BOS rule)."""
    from minfer.text.prompt import prompt_ids
    count = lambda t: len(prompt_ids(tokenizer, t))                     # noqa: E731
    while count(text) < n:
        text = text + "\n" + text
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(text[:mid]) <= n:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo], count(text[:lo])


def run_json(args: list[str]) -> list[dict]:
    """python -m minfer ARGS -> the JSON objects it printed (one per line)."""
    out = subprocess.run([sys.executable, "-m", "minfer", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"minfer {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()[-400:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> int:
    ap = argparse.ArgumentParser(prog="python3 -m scripts.bench.first_use", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True, help="GGUF (the 7B twin: minfer twin -o PATH)")
    ap.add_argument("-p", "--prompts", default="512,1000,3325", help="prompt lengths in tokens")
    ap.add_argument("-r", "--reps", type=int, default=2, help="fresh generate processes per length")
    ap.add_argument("--text", default=str(TEXT), help="text the prompts are cut from")
    ap.add_argument("-c", "--ctx-size", type=int, default=4096, help="generate's context")
    a = ap.parse_args()
    from minfer.engine import ModelFile
    lengths = [int(p) for p in a.prompts.split(",") if p]
    mf = ModelFile.open(a.model, a.ctx_size)
    text = Path(a.text).read_text(encoding="utf-8")
    tmp = Path(tempfile.mkdtemp(prefix="minfer-first-use-"))
    files, counts = {}, {}
    for n in lengths:
        body, counts[n] = prompt_of(mf.tokenizer, text, n)
        files[n] = tmp / f"prompt{n}.txt"
        files[n].write_text(body, encoding="utf-8")
    first: dict[int, list[float]] = {n: [] for n in lengths}
    bench: dict[int, list[float]] = {n: [] for n in lengths}
    for rep in range(a.reps):
        for n in lengths:
            g, = run_json(["generate", "-m", a.model, "-f", str(files[n]), "-n", "2", "--ignore-eos",
                           "-c", str(a.ctx_size), "-q", "--json"])
            first[n].append(g["prompt_tps"])
        for rec in run_json(["bench", "-m", a.model, "-p", ",".join(str(counts[n]) for n in lengths),
                             "-n", "0", "-r", "5", "-o", "jsonl"]):
            n = next((m for m in lengths if rec["test"] == f"pp{counts[m]}"), None)
            if n is not None:
                bench[n].append(rec["median_tok_s"])
    print(f"{Path(a.model).name}: one-shot `minfer generate` prompt tok/s (fresh process each) "
          f"vs `minfer bench` (median of 5), {a.reps} rounds alternated")
    print("| prompt tokens | first use | bench | first use / bench |")
    print("| ---: | ---: | ---: | ---: |")
    for n in lengths:
        f, b = statistics.median(first[n]), statistics.median(bench[n])
        runs = " / ".join(f"{v:,.0f}" for v in first[n])
        print(f"| {counts[n]} | {runs} | {b:,.0f} | {f / b:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
