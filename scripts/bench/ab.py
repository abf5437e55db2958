#!/usr/bin/env python3
"""Interleaved A/B prefill timing of two CUDA settings in one process.

    python3 -m scripts.bench.ab -m MODEL -p 3325 -r 7 --a exp_planes=1 --b exp_planes=0
    python3 -m scripts.bench.ab -m MODEL -p 512 --a gateup_fused=1 --b gateup_fused=0

--a and --b are CudaSettings fields (minfer/backend/cuda/settings.py; scripts/fields.py):
FIELD=VALUE, repeated or comma-separated, a value 0/1/true/false or an integer
(f16_min_t). An unknown field is a one-line error (exit 2).

Repetitions alternate A B A B ... so drift (clocks, temperature, other load)
hits both sides alike: quote medians and ratios measured side by side in one
run. Three modes, printed with the result:

- toggle: the sides differ only in exp_planes — one engine, loaded with the
  W_exp planes registered, each rep under `backend.using(exp_enabled=...)`.
  The memory the planes-off side would buy back is the measured plane allocation.
- one engine: only run-time fields (the kernel a launch takes: gateup_fused,
  ffn_f16, flash_wgmma, dependent_launches, graphs, f16_min_t, exp_enabled) —
  one engine, each rep under `backend.using(**side)`; captured CUDA graphs are
  keyed by the settings, so each side replays its own.
- two engines: a load-time field (exp_planes with others, f16_weights,
  force_exp_miss) — each side's engine loaded with `Engine.load(...,
  settings=its load-time fields)`, its run-time fields applied per rep.

Per rep: prefill of P seeded random token ids from position 0, timed as
`minfer bench` times it (CUDA events / perf_counter). With --batch B: B sequences
of P tokens prefilled together, then --steps decode steps of all B, timed as
`minfer bench -npp P -ntg STEPS -npl B` times its TG (tokens/s = B * steps / s). "separated" means the
distributions do not overlap: max of the slower side < min of the faster.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from minfer.tools.bench import prompt_ids, time_prefill
from minfer.errors import MinferError
from scripts import fields as settings_fields

EXP_FIELD = "exp_planes"


def mode_of(a: dict, b: dict, backend: str) -> str:
    """toggle, one engine or two engines (the module's docstring)."""
    if (set(a) | set(b) == {EXP_FIELD} and a.get(EXP_FIELD, True) != b.get(EXP_FIELD, True)
            and backend == "cuda"):
        return "toggle"
    if not (set(a) | set(b)).intersection(settings_fields.LOAD_TIME):
        return "one engine"
    return "two engines"


def run(model, P: int, reps: int, a: dict, b: dict, backend: str, seed: int,
        logits_from: int | None = None, batch: int = 0, steps: int = 32) -> dict:
    if reps < 1 or P < 1 or batch < 0 or steps < 1:
        raise MinferError(f"-r, -p and --steps must be positive and --batch >= 0, got {reps}, {P}, "
                          f"{steps} and {batch}")
    mode = mode_of(a, b, backend)
    load = settings_fields.load_engine
    if mode == "toggle":
        eng = load(model, backend, P, {EXP_FIELD: True})               # planes registered
        engines = {"A": eng, "B": eng}
        run_fields = {s: {"exp_enabled": bool(f.get(EXP_FIELD, True))} for s, f in (("A", a), ("B", b))}
    elif mode == "one engine":
        eng = load(model, backend, P, {})
        engines = {"A": eng, "B": eng}
        run_fields = {"A": a, "B": b}
    else:
        split = {"A": settings_fields.split(a), "B": settings_fields.split(b)}
        engines = {s: load(model, backend, P, split[s][0]) for s in "AB"}
        run_fields = {s: split[s][1] for s in "AB"}
    if engines["A"] is engines["B"]:
        caches = dict.fromkeys("AB", engines["A"].new_cache(P))
    else:
        caches = {s: e.new_cache(P) for s, e in engines.items()}
    timers = {s: e.backend.timer() for s, e in engines.items()}
    tokens = prompt_ids(engines["A"].cfg.vocab_size, P, seed)

    def one_prefill(side: str) -> float:
        with settings_fields.using(engines[side], run_fields[side]):
            return time_prefill(engines[side], caches[side], tokens, timers[side], logits_from)

    one = one_prefill
    if batch:                           # decode steps of `batch` sequences (minfer bench -npl's TG)
        from minfer.kv.paged import PagedCache
        from minfer.tools.batched_bench import kv_blocks, time_test
        ids = prompt_ids(engines["A"].cfg.vocab_size, batch * (P + steps), seed)
        prompts, step_ids = ids[:batch * P].reshape(batch, P), ids[batch * P:].reshape(steps, batch)
        paged = {s: PagedCache(e.backend, kv_blocks(P, steps, batch)) for s, e in engines.items()}
        tables = {s: [tuple(c.pool.allocate(PagedCache.blocks_for(P + steps))) for _ in range(batch)]
                  for s, c in paged.items()}

        def one_decode(side: str) -> float:
            with settings_fields.using(engines[side], run_fields[side]):
                return time_test(engines[side], paged[side].storage, tables[side], prompts, step_ids,
                                 timers[side])[1]

        one = one_decode

    for side in "AB":                   # warm-up, untimed: first use eager, second
        one(side)                       # captures a CUDA graph (replayed by the reps)
        one(side)
    counts = {"A": {}, "B": {}}
    secs = {"A": [], "B": []}
    order = []
    for _ in range(reps):
        for side in "AB":
            be = engines[side].backend
            be.reset_counters()
            secs[side].append(one(side))
            order.append(side)
            for k, v in (be.counters() or {}).items():     # launch paths of this side's reps
                counts[side][k] = counts[side].get(k, 0) + v
    res = {"model": str(model), "backend": backend, "n_tokens": P, "reps": reps,
           "logits_from": logits_from, "batch": batch, "steps": steps,
           "mode": mode, "order": order}
    for side, setting in (("A", a), ("B", b)):
        tps = [(batch * steps if batch else P) / s for s in secs[side]]
        res[side] = {"setting": setting, "seconds": secs[side], "tok_s": tps,
                     "median": statistics.median(tps), "min": min(tps), "max": max(tps),
                     "counters": counts[side] or None}
    fast, slow = (res["A"], res["B"]) if res["A"]["median"] >= res["B"]["median"] else (res["B"], res["A"])
    res["ratio_b_over_a"] = res["B"]["median"] / res["A"]["median"]
    res["separated"] = slow["max"] < fast["min"]
    res["w_exp_plane_bytes"] = engines["A"].backend.memory_report().get("W_exp planes")
    if mode == "toggle":
        res["memory_bought_back_bytes"] = res["w_exp_plane_bytes"]    # what exp_planes=0 does not register
    return res


def report(r: dict) -> str:
    head = ("LM head on the last position" if r.get("logits_from") is None
            else f"LM head on positions {r['logits_from']}.. (perplexity-shaped)")
    what = (f"A/B decode of {r['batch']} sequences, {r['steps']} steps after {r['n_tokens']} tokens each"
            if r.get("batch") else f"A/B prefill of {r['n_tokens']} tokens ({head})")
    lines = [f"{what}, {r['reps']} reps interleaved, {r['backend']}, mode: {r['mode']}"]
    for side in "AB":
        s = r[side]
        lines.append(f"{side} ({settings_fields.text(s['setting'])}): median {s['median']:.2f} t/s, "
                     f"min {s['min']:.2f}, max {s['max']:.2f}")
        lines.append("   reps: " + " ".join(f"{v:.2f}" for v in s["tok_s"]))
        if s["counters"]:
            lines.append("   launch paths: " + ", ".join(f"{k}={v}" for k, v in s["counters"].items()))
    lines.append(f"B/A median ratio: {r['ratio_b_over_a']:.4f} "
                 f"({(r['ratio_b_over_a'] - 1) * 100:+.2f}%); separated: {'yes' if r['separated'] else 'no'}")
    if r["w_exp_plane_bytes"] is not None:
        lines.append(f"W_exp planes allocated: {r['w_exp_plane_bytes']:,} bytes"
                     + (f" (bought back with {EXP_FIELD}=0)" if r["mode"] == "toggle" else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m scripts.bench.ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-p", "--n-tokens", type=int, default=3325, help="prefill length (default 3325)")
    ap.add_argument("-r", "--reps", type=int, default=7, help="reps per side (default 7)")
    ap.add_argument("--a", action="append", required=True, metavar="FIELD=VALUE",
                    help="side A: CudaSettings fields, e.g. gateup_fused=1 (repeat or comma-separate)")
    ap.add_argument("--b", action="append", required=True, metavar="FIELD=VALUE", help="side B: the same")
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logits-from", type=int, default=None,
                    help="LM head on positions N.. (0: all, as perplexity does); default: the last")
    ap.add_argument("--batch", type=int, default=0,
                    help="B > 0: time decode steps of B sequences of -p tokens each instead of a prefill")
    ap.add_argument("--steps", type=int, default=32, help="decode steps a rep with --batch (default 32)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of text")
    args = ap.parse_args(argv)
    try:
        a, b = settings_fields.parse(args.a), settings_fields.parse(args.b)
        r = run(args.model, args.n_tokens, args.reps, a, b, args.backend, args.seed, args.logits_from,
                args.batch, args.steps)
    except MinferError as e:
        print(f"ab: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r) if args.json else report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
