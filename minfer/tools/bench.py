"""`minfer bench`: prefill and decode throughput, load time, device memory, launch paths.

Every number printed is measured in this process; none is computed from
another, except tokens/s = tokens / measured seconds and the W_exp plane bytes
expected from the GGUF tensor table (od x id summed over the tensors the bundle
covers), which is shown beside the measured plane allocation as its check.

Timing: the backend's timer (CUDA events on the CUDA backend, perf_counter
around a synchronize on the CPU) around `engine.model.forward(...)`, which ends
with the logits' device-to-host copy. Each test runs twice untimed (warm-up:
kernel compilation, memory pool growth; on the CUDA backend the first use of a
prompt length runs eagerly and the second captures the decoder layers into a
CUDA graph, which the timed repetitions replay; MINFER_CUDA_GRAPHS=0 times the
eager path instead), then at once its r timed repetitions, as llama-bench does:
a test is not timed in the state the one before it left (a 512-token prefill timed
right after 3,325-token ones ran ~10% slower, likely the GPU's clocks following its
recent power draw; scripts/bench/product_ceiling.py samples the SM clock under
such load); prompt ids are seeded random ids
in the vocabulary; every prefill starts at position 0 of one cache allocated
once, so each repetition overwrites the same positions. The bench uses only
the Backend interface (timer, counters, memory_report, memory_check, device_info).

Output (-o): md (tables, for people), json (one object), jsonl and csv (one
record per test, for tools that track a figure over time). Every record names
what made it: minfer's version, the git commit when running from a checkout,
the device, driver and CUDA versions, the host CPU and a UTC timestamp.
`--plot FILE.png` draws prefill tokens/s against prompt length (minfer[plot]).

`-npp/-ntg/-npl` switch to llama-batched-bench's mode instead: several sequences
prefilled and decoded together (batched_bench.py, its own table and records).
"""
from __future__ import annotations

import csv
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from ..errors import MinferError
from .runinfo import git_commit, host_cpu, utc_timestamp, version

DECODE_DEPTH = 16      # default tokens in the KV cache before the timed decode steps


# --- timing -------------------------------------------------------------------

def prompt_ids(vocab: int, n: int, seed: int) -> np.ndarray:
    """n seeded random token ids in [0, vocab) -> int32 (n,)"""
    return np.random.default_rng(seed).integers(0, vocab, size=n, dtype=np.int32)


def time_prefill(engine, cache, tokens: np.ndarray, timer, logits_from: int | None = None) -> float:
    """Seconds for one prefill of `tokens` from position 0 (LM head on the last
    position, or on positions logits_from.. like perplexity)."""
    timer.start()
    engine.model.forward(tokens, 0, cache, logits_from)
    return timer.stop()


def time_decode(engine, cache, prompt: np.ndarray, n: int, timer) -> float:
    """Prefill `prompt` (untimed), then seconds for n greedy decode steps as `minfer
    generate` runs them (Transformer.decode_greedy: on the CUDA backend, replays of
    the step's CUDA graph after its first two uses on a cache)."""
    token = int(np.argmax(engine.model.forward(prompt, 0, cache)[-1]))
    pos = len(prompt)
    timer.start()
    for _ in range(n):
        token = engine.model.decode_greedy(token, pos, cache)
        pos += 1
    return timer.stop()


def summary(n_tokens: int, seconds: list[float], n_prompt: int = 0, n_gen: int = 0,
            n_depth: int = 0) -> dict:
    """Per-repetition tokens/s and their median, min, max, stdev. A test is named by
    llama-bench's three numbers: prompt tokens (pp), generated tokens (tg) and the
    tokens already in the KV cache before the timed generation (depth)."""
    tps = [n_tokens / s for s in seconds]
    return {"n_tokens": n_tokens, "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": n_depth,
            "reps": len(seconds), "seconds": seconds, "tok_s": tps,
            "median": statistics.median(tps), "min": min(tps), "max": max(tps),
            "stdev": statistics.stdev(tps) if len(tps) > 1 else 0.0}


# --- the command ----------------------------------------------------------------

def parse_lengths(s: str, flag: str = "-p", what: str = "token counts", example: str = "512,3325") -> list[int]:
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise MinferError(f"{flag} expects comma-separated {what} like {example}, got {s!r}") from None
    if not v or min(v) < 1:
        raise MinferError(f"{flag} expects positive {what}, got {s!r}")
    return v


def add_arguments(p) -> None:
    from ..cli import add_backend_arg, add_model_arg
    from . import batched_bench
    add_model_arg(p)
    # -p, -n, -d default to None so that batched mode can tell them given (main fills in the defaults)
    p.add_argument("-p", "--prompt-lengths", default=None,
                   help="comma-separated prefill lengths (default 512,3325)")
    p.add_argument("-r", "--reps", type=int, default=5, help="timed repetitions per test (default 5)")
    p.add_argument("-n", "--n-decode", type=int, default=None,
                   help="decode steps for the tg test (0: none; default 128)")
    p.add_argument("-d", "--n-depth", default=None,
                   help=f"comma-separated tokens in the KV cache before each tg test (default "
                        f"{DECODE_DEPTH}); a test at another depth is named like llama-bench's 'tg128 @ d3325'")
    add_backend_arg(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids")
    p.add_argument("-o", "--output", choices=tuple(FORMATS), default="md",
                   help="md: tables (default); json: one object; jsonl, csv: one record per test")
    p.add_argument("--json", dest="output", action="store_const", const="json", help="the same as -o json")
    p.add_argument("--plot", metavar="FILE", default=None,
                   help="also draw prefill tokens/s against prompt length into FILE (.png, .svg, .pdf; "
                        "needs minfer[plot])")
    batched_bench.add_arguments(p)


def check_counts(reps: int, n_decode: int) -> None:
    if reps < 1:
        raise MinferError(f"-r must be at least 1, got {reps}")
    if n_decode < 0:
        raise MinferError(f"-n must be 0 or more, got {n_decode}")


def run(model, lengths: list[int], reps: int, n_decode: int, backend: str, seed: int = 0,
        depths: tuple[int, ...] = (DECODE_DEPTH,)) -> dict:
    from ..engine import Engine

    check_counts(reps, n_decode)
    n_ctx = max(max(lengths), max(depths) + n_decode)
    stamp = utc_timestamp()
    t0 = time.perf_counter()
    engine = Engine.load(model, backend=backend, n_ctx=n_ctx, progress=True)
    engine.backend.synchronize()
    load_s = time.perf_counter() - t0          # file -> device, W_exp planes included
    cache = engine.new_cache(n_ctx)
    be = engine.backend
    timer = be.timer()
    vocab = engine.cfg.vocab_size

    prompts = {P: prompt_ids(vocab, P, seed + i) for i, P in enumerate(lengths)}
    dprompts = {d: prompt_ids(vocab, d, seed + len(lengths) + i) for i, d in enumerate(depths)}
    counts: dict[str, int] = {}

    def timed(run) -> list[float]:
        """reps timed runs; their launches (and only theirs) added to counts."""
        be.reset_counters()
        secs = [run() for _ in range(reps)]
        for k, v in (be.counters() or {}).items():
            counts[k] = counts.get(k, 0) + v
        return secs

    # each test's warm-up right before its repetitions (as llama-bench does), so what
    # ran before it does not set the state it is timed in (the GPU's clocks follow its
    # recent power draw)
    tests = {}
    for P, tokens in prompts.items():
        for _ in range(2):                                              # warm-up, untimed:
            time_prefill(engine, cache, tokens, timer)                  # eager, then capture
        tests[f"pp{P}"] = summary(P, timed(lambda: time_prefill(engine, cache, tokens, timer)), n_prompt=P)
    for d, dprompt in dprompts.items() if n_decode else ():
        time_decode(engine, cache, dprompt, min(n_decode, 4), timer)     # warm-up, untimed
        name = f"tg{n_decode}" + ("" if d == DECODE_DEPTH else f" @ d{d}")
        tests[name] = summary(n_decode, timed(lambda: time_decode(engine, cache, dprompt, n_decode, timer)),
                              n_gen=n_decode, n_depth=d)

    gf = engine.gf
    info = be.device_info()
    return {
        "minfer_version": version(),
        "git_commit": git_commit(),
        "timestamp": stamp,
        **{k: info.get(k) for k in DEVICE_KEYS},
        "cpu": host_cpu(),
        "model": str(model),
        "model_name": Path(model).name,
        "size_bytes": os.path.getsize(model),
        "params": int(sum(t.n_elements for t in gf.tensors.values())),
        "backend": engine.backend.name,
        "seed": seed,
        "n_ctx": n_ctx,
        "load_s": load_s,
        "tests": tests,
        "memory": be.memory_report(cache),
        "memory_check": be.memory_check(gf.tensors),
        "counters": counts if be.counters() is not None else None,
    }


# --- output ----------------------------------------------------------------------

DEVICE_KEYS = ("device", "driver", "cuda_driver", "cuda_runtime")      # Backend.device_info()
# one record per test (jsonl, csv): what made it, the model, the test, the figures
RECORD_KEYS = ("minfer_version", "git_commit", "timestamp", "backend", *DEVICE_KEYS, "cpu",
               "model_name", "size_bytes", "params", "n_ctx", "seed", "load_s",
               "test", "n_prompt", "n_gen", "n_depth", "reps",
               "median_tok_s", "stdev_tok_s", "min_tok_s", "max_tok_s")


def records(r: dict) -> list[dict]:
    """The report as flat records, one per test (the keys of RECORD_KEYS; jsonl
    adds each repetition's seconds and tokens/s)."""
    out = []
    for name, t in r["tests"].items():
        rec = {k: r.get(k) for k in RECORD_KEYS[:RECORD_KEYS.index("test")]}
        rec.update(test=name, n_prompt=t["n_prompt"], n_gen=t["n_gen"], n_depth=t["n_depth"],
                   reps=t["reps"], median_tok_s=t["median"], stdev_tok_s=t["stdev"],
                   min_tok_s=t["min"], max_tok_s=t["max"])
        out.append(rec)
    return out


def format_jsonl(r: dict) -> str:
    return "\n".join(json.dumps({**rec, "seconds": t["seconds"], "tok_s": t["tok_s"]})
                     for rec, t in zip(records(r), r["tests"].values()))


def format_csv(r: dict) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=RECORD_KEYS, lineterminator="\n")
    w.writeheader()
    w.writerows(records(r))
    return buf.getvalue().rstrip("\n")


def provenance(r: dict) -> str | None:
    """`minfer 0.1.0 (git e7d32d3) | cuda on NVIDIA H200 (driver ..., CUDA ...) | host ... | time`;
    None for a report without these keys."""
    if "minfer_version" not in r:
        return None
    head = f"minfer {r['minfer_version']}" + (f" (git {r['git_commit']})" if r.get("git_commit") else "")
    versions = [f"{label} {r[k]}" for label, k in (("driver", "driver"), ("CUDA", "cuda_driver"),
                                                   ("runtime", "cuda_runtime")) if r.get(k)]
    device = f"{r['backend']} on {r.get('device')}" + (f" ({', '.join(versions)})" if versions else "")
    # the CPU backend's device is the host: named once
    host = [] if r.get("cpu") == r.get("device") else [f"host {r.get('cpu')}"]
    return " | ".join([head, device, *host, r.get("timestamp") or "?"])


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _size(n: int) -> str:
    """bytes for people: 18.0 KiB, 190.5 MiB, 4.36 GiB (never 0.00 GiB)"""
    if n >= 2**30:
        return _gib(n)
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def format_report(r: dict) -> str:
    size = _gib(r["size_bytes"])
    params = f"{r['params'] / 1e9:.2f} B"
    head = provenance(r)
    lines = ([head, ""] if head else []) + [
             f"load: {r['load_s']:.2f} s (file to {r['backend']} memory"
             + (", W_exp planes included where registered)" if r["backend"] == "cuda" else ")"),
             "",
             "| model | size | params | backend | test | t/s |",
             "| --- | ---: | ---: | --- | ---: | ---: |"]
    for name, t in r["tests"].items():
        lines.append(f"| {r['model_name']} | {size} | {params} | {r['backend']} | {name} | "
                     f"{t['median']:.2f} ± {t['stdev']:.2f} |")
    lines += ["", "| test | reps | median t/s | min | max | stdev |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, t in r["tests"].items():
        lines.append(f"| {name} | {t['reps']} | {t['median']:.2f} | {t['min']:.2f} | "
                     f"{t['max']:.2f} | {t['stdev']:.2f} |")
    lines += memory_and_counter_lines(r, "memory")
    return "\n".join(lines)


def memory_and_counter_lines(r: dict, title: str) -> list[str]:
    """A run record's memory table (the W_exp planes checked against the tensor table)
    and, where the backend counts them, its launch paths: the tables both bench modes print."""
    check = r.get("memory_check") or {}
    lines = ["", f"| {title} | bytes | |", "| --- | ---: | ---: |"]
    for kind, v in r["memory"].items():
        note = _size(v)
        if kind == "W_exp planes" and "W_exp planes expected" in check:
            verdict = "OK" if check.get("problem") is None else f"MISMATCH: {check['problem']}"
            note = f"expected od×id over the tensor table = {check['W_exp planes expected']:,}: {verdict}"
        lines.append(f"| {kind} | {v:,} | {note} |")
    if r["counters"] is not None:
        lines += ["", "| launch path | count (timed runs) |", "| --- | ---: |"]
        lines += [f"| {k} | {v} |" for k, v in r["counters"].items()]
    return lines


FORMATS = {"md": format_report, "json": json.dumps, "jsonl": format_jsonl, "csv": format_csv}


def main(args) -> int:
    from . import batched_bench
    if batched_bench.requested(args):      # -npp/-ntg/-npl: llama-batched-bench's mode
        return batched_bench.main(args)
    if args.deterministic:
        raise MinferError("--deterministic is a batched-mode flag: give -npp, -ntg and -npl with it")
    if args.plot:
        from .plot import check_plot_target
        check_plot_target(args.plot)        # now, not after minutes of measuring
    from ..cli import model_path
    lengths = parse_lengths("512,3325" if args.prompt_lengths is None else args.prompt_lengths)
    depths = tuple(parse_lengths(str(DECODE_DEPTH) if args.n_depth is None else args.n_depth, "-d"))
    n_decode = 128 if args.n_decode is None else args.n_decode
    check_counts(args.reps, n_decode)            # bad input: before a first-use download
    r = run(model_path(args.model), lengths, args.reps, n_decode, args.backend, args.seed, depths)
    print(FORMATS[args.output](r))
    if args.plot:
        from .plot import plot_throughput
        plot_throughput(r, args.plot)
        print(f"minfer: plot written to {args.plot}", file=sys.stderr)
    problem = (r.get("memory_check") or {}).get("problem")
    if problem:
        raise MinferError(f"memory check failed: {problem}")
    return 0


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(prog="minfer bench", description=__doc__.splitlines()[0])
    add_arguments(ap)
    try:
        sys.exit(main(ap.parse_args()))
    except MinferError as e:
        print(f"minfer: error: {e}", file=sys.stderr)
        sys.exit(2)
