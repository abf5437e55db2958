"""`minfer bench -npp ... -ntg ... -npl ...`: llama-batched-bench's mode, B sequences at once.

For each (PP, TG, B), nested in that order as llama-batched-bench loops: B
sequences of PP seeded random prompt ids, a different prompt each, prefilled in
ONE forward_batch; then TG decode steps, each ONE forward_batch of B rows (every
sequence's next token at its position). Its columns, as it defines them:

    N_KV = B * (PP + TG)     the KV positions the test fills (no prompt shared)
    S_PP = B * PP / T_PP     S_TG = B * TG / T_TG     T = T_PP + T_TG     S = N_KV / T

T_PP and T_TG are the medians of -r timed repetitions (llama-batched-bench runs
each test once), so the identities above hold between the printed columns.

What is fed: the decode steps take pre-drawn seeded ids, not the argmax of the
logits, as llama-batched-bench feeds token 0 without reading them: the work of a
step does not depend on which ids it gets, while a host argmax over (B, vocab)
logits would be timed and is no part of the model's step (a decode step of the
1.5B at B = 32 has 32 x 151,936 logits to scan). The step's Batch (its rows'
positions and cache slots) is built inside the timed loop, as a serving loop
builds one per step and llama-batched-bench fills its llama_batch there.

Memory: each test gets a fresh PagedCache of B * blocks_for(PP + TG) blocks plus
the pad block, and each sequence its own blocks from pool.allocate (no prefix
cache: nothing is matched or registered), so N_KV positions are written and none
is shared. The largest test's cache is allocated once before anything is timed,
so a request that does not fit fails before minutes of measuring. Every
repetition rewrites the same positions before reading them, as the pp/tg bench
reuses one cache.

Timing: the backend's timer (device events on CUDA, wall time around a
synchronize on the CPU) around the prefill's forward_batch, which ends with its
logits' device-to-host copy, and around all TG steps. Each test runs one untimed
warm-up (the prefill and min(TG, 4) steps) right before its repetitions, as the
pp/tg bench warms each test up (forward_batch captures no CUDA graph, so one
warm-up reaches the timed state).
"""
from __future__ import annotations

import csv
import io
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from ..errors import MinferError
from ..kv.batch import Batch, Span
from ..kv.paged import PagedCache
from .bench import (DEVICE_KEYS, RECORD_KEYS, _size, check_counts, memory_and_counter_lines, parse_lengths,
                    prompt_ids, provenance)
from .runinfo import git_commit, host_cpu, utc_timestamp, version

COLUMNS = ("pp", "tg", "b", "n_kv", "t_pp", "s_pp", "t_tg", "s_tg", "t", "s")   # a row's keys
WARMUP_STEPS = 4


# --- the arguments -----------------------------------------------------------------

def add_arguments(p) -> None:
    g = p.add_argument_group("batched mode (llama-batched-bench's; not with -p, -n, -d, --plot)")
    g.add_argument("-npp", dest="n_pp", metavar="PP", default=None,
                   help="comma-separated prompt tokens per sequence, e.g. 128,512")
    g.add_argument("-ntg", dest="n_tg", metavar="TG", default=None,
                   help="comma-separated decode steps per sequence, e.g. 128")
    g.add_argument("-npl", dest="n_pl", metavar="B", default=None,
                   help="comma-separated sequences decoded at once, e.g. 1,8,32 (default 1)")
    g.add_argument("--deterministic", action="store_true",
                   help="in the deterministic mode (a row's arithmetic fixed by what the row is): its cost")


def requested(args) -> bool:
    return any(v is not None for v in (args.n_pp, args.n_tg, args.n_pl))


def parse_tests(args) -> list[tuple[int, int, int]]:
    """-npp, -ntg, -npl -> the (PP, TG, B) tests in llama-batched-bench's order.
    Needs no model: bad input is refused before a first-use download."""
    mixed = [f for f, v in (("-p", args.prompt_lengths), ("-n", args.n_decode), ("-d", args.n_depth),
                            ("--plot", args.plot)) if v is not None]
    if mixed:
        raise MinferError(f"-npp/-ntg/-npl (batched mode) cannot be mixed with {', '.join(mixed)} "
                          f"(the pp/tg tests): run them separately")
    if args.n_pp is None or args.n_tg is None:
        raise MinferError("batched mode needs both -npp (prompt tokens) and -ntg (decode steps), "
                          "e.g. -npp 128,512 -ntg 128 -npl 1,8,32")
    pps = parse_lengths(args.n_pp, "-npp", example="128,512")
    tgs = parse_lengths(args.n_tg, "-ntg", example="128")
    pls = parse_lengths(args.n_pl, "-npl", what="sequence counts", example="1,8,32") \
        if args.n_pl is not None else [1]
    return [(pp, tg, b) for pp in pps for tg in tgs for b in pls]


def check_context(tests, n_ctx_train: int) -> None:
    """Each sequence holds PP + TG positions: within the model's training context."""
    pp, tg, _ = max(tests, key=lambda t: t[0] + t[1])
    if pp + tg > n_ctx_train:
        raise MinferError(f"-npp {pp} with -ntg {tg} is {pp + tg} positions per sequence, beyond the "
                          f"model's context of {n_ctx_train}")


def kv_blocks(pp: int, tg: int, b: int) -> int:
    """Blocks of a test's paged cache: each sequence its own, and the pad."""
    return b * PagedCache.blocks_for(pp + tg) + 1


# --- timing --------------------------------------------------------------------------

def time_test(engine, storage, tables, prompts: np.ndarray, steps: np.ndarray, timer) -> tuple[float, float]:
    """prompts (B, PP), steps (n, B): seconds of the prefill (B sequences from position
    0, one forward_batch) and of n decode steps (one forward_batch of B rows each). The
    prefill's Batch is built before its timer starts and each step's inside, as
    llama-batched-bench fills its llama_batch; a new Batch each call, so no repetition
    finds the device copies of the one before."""
    B, PP = prompts.shape
    model = engine.model
    prefill = Batch([Span(0, PP, t) for t in tables])
    timer.start()
    model.forward_batch(prompts.reshape(-1), prefill, storage)            # (B, vocab)
    t_pp = timer.stop()
    timer.start()
    for i, ids in enumerate(steps):                                       # ids (B,)
        model.forward_batch(ids, Batch([Span(PP + i, 1, t) for t in tables]), storage)   # (B, vocab)
    return t_pp, timer.stop()


def row(pp: int, tg: int, b: int, t_pp: float, t_tg: float) -> dict:
    """One line of the table, llama-batched-bench's definitions."""
    n_kv, t = b * (pp + tg), t_pp + t_tg
    return {"pp": pp, "tg": tg, "b": b, "n_kv": n_kv, "t_pp": t_pp, "s_pp": b * pp / t_pp,
            "t_tg": t_tg, "s_tg": b * tg / t_tg, "t": t, "s": n_kv / t}


def run(model, tests, reps: int, backend: str, seed: int = 0, deterministic: bool = False) -> dict:
    from ..engine import Engine, ModelFile

    check_counts(reps, 0)
    n_ctx = max(pp + tg for pp, tg, _ in tests)
    stamp = utc_timestamp()
    t0 = time.perf_counter()
    mf = ModelFile.open(model, n_ctx)
    check_context(tests, mf.cfg.n_ctx_train)                     # before the weights load
    engine = Engine.from_file(mf, backend, progress=True)        # no front-door cache, no warm-up: ours below
    be = engine.backend
    be.set_deterministic(deterministic)
    be.synchronize()
    load_s = time.perf_counter() - t0
    largest = max(tests, key=lambda t: kv_blocks(*t))
    try:
        PagedCache(be, kv_blocks(*largest))                      # fits, or one line now
    except MinferError as e:
        pp, tg, b = largest
        raise MinferError(f"-npp {pp} -ntg {tg} -npl {b} does not fit: {e}") from None
    timer, vocab = be.timer(), engine.cfg.vocab_size
    counts: dict[str, int] = {}
    rows, seconds, kv, memory = [], [], [], None
    for i, (pp, tg, b) in enumerate(tests):
        ids = prompt_ids(vocab, b * (pp + tg), seed + i)
        prompts, steps = ids[:b * pp].reshape(b, pp), ids[b * pp:].reshape(tg, b)
        paged = PagedCache(be, kv_blocks(pp, tg, b))
        tables = [tuple(paged.pool.allocate(PagedCache.blocks_for(pp + tg))) for _ in range(b)]
        time_test(engine, paged.storage, tables, prompts, steps[:WARMUP_STEPS], timer)    # warm-up, untimed
        be.reset_counters()
        secs = [time_test(engine, paged.storage, tables, prompts, steps, timer) for _ in range(reps)]
        for k, v in (be.counters() or {}).items():
            counts[k] = counts.get(k, 0) + v
        t_pp, t_tg = (statistics.median(s) for s in zip(*secs))
        rows.append(row(pp, tg, b, t_pp, t_tg))
        seconds.append({"t_pp": [s[0] for s in secs], "t_tg": [s[1] for s in secs]})
        report = be.memory_report(paged.storage)
        kv.append({"pp": pp, "tg": tg, "b": b, "blocks": paged.pool.n_blocks,
                   "positions": paged.storage.n_ctx, "bytes": report["KV cache"]})
        if (pp, tg, b) == largest and memory is None:
            memory = report                                      # while the largest cache is held
        del paged, tables                                        # before the next test's cache

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
        "backend": be.name,
        "seed": seed,
        "deterministic": deterministic,
        "n_ctx": n_ctx,
        "load_s": load_s,
        "reps": reps,
        "rows": rows,
        "seconds": seconds,            # each row's repetitions: t_pp and t_tg lists
        "kv": kv,                      # each row's paged cache
        "memory": memory,
        "memory_check": be.memory_check(gf.tensors),
        "counters": counts if be.counters() is not None else None,
    }


# --- output ----------------------------------------------------------------------------

# one record per row (jsonl, csv): what made it (the pp/tg bench's keys), then the row
RUN_KEYS = (*RECORD_KEYS[:RECORD_KEYS.index("test")], "reps")


def records(r: dict) -> list[dict]:
    return [{**{k: r.get(k) for k in RUN_KEYS}, **row} for row in r["rows"]]


def format_jsonl(r: dict) -> str:
    return "\n".join(json.dumps(rec) for rec in records(r))


def format_csv(r: dict) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=(*RUN_KEYS, *COLUMNS), lineterminator="\n")
    w.writeheader()
    w.writerows(records(r))
    return buf.getvalue().rstrip("\n")


# llama-batched-bench's header and row formats, character for character
_HEAD = "|%6s | %6s | %4s | %6s | %8s | %8s | %8s | %8s | %8s | %8s |"
_RULE = "|%6s-|-%6s-|-%4s-|-%6s-|-%8s-|-%8s-|-%8s-|-%8s-|-%8s-|-%8s-|"
_ROW = "|%6d | %6d | %4d | %6d | %8.3f | %8.2f | %8.3f | %8.2f | %8.3f | %8.2f |"


def format_table(rows: list[dict]) -> list[str]:
    return ([_HEAD % ("PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s"),
             _RULE % ("------", "------", "----", "------", *["--------"] * 6)]
            + [_ROW % tuple(r[k] for k in COLUMNS) for r in rows])


def format_report(r: dict) -> str:
    head = provenance(r)
    lines = ([head, ""] if head else []) + [
        f"load: {r['load_s']:.2f} s (file to {r['backend']} memory)",
        f"{r['model_name']}: B sequences, each its own prompt and blocks; medians of {r['reps']} runs "
        f"after one warm-up; decode steps feed seeded ids",
        "", *format_table(r["rows"]),
        "", "| PP | TG | B | paged KV blocks (1 pad) | positions | bytes | |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {c['pp']} | {c['tg']} | {c['b']} | {c['blocks']} | {c['positions']:,} | "
              f"{c['bytes']:,} | {_size(c['bytes'])} |" for c in r["kv"]]
    lines += memory_and_counter_lines(r, "memory (largest test)")
    return "\n".join(lines)


FORMATS = {"md": format_report, "json": json.dumps, "jsonl": format_jsonl, "csv": format_csv}


def main(args) -> int:
    from ..cli import model_path
    tests = parse_tests(args)
    check_counts(args.reps, 0)                   # bad input: before a first-use download
    r = run(model_path(args.model), tests, args.reps, args.backend, args.seed, args.deterministic)
    print(FORMATS[args.output](r))
    problem = (r.get("memory_check") or {}).get("problem")
    if problem:
        raise MinferError(f"memory check failed: {problem}")
    return 0
