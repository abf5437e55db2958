#!/usr/bin/env python3
"""Interleaved A/B prefill timing of two settings in one process.

    python scripts/ab.py -m MODEL -p 3325 -r 7 --a MINFER_MMQ_Q6K_EXP=1 --b MINFER_MMQ_Q6K_EXP=0

Repetitions alternate A B A B ... so drift (clocks, temperature, other load)
hits both sides alike: quote medians and ratios measured side by side in one
run. Two modes, printed with the result:

- toggle: the settings differ only in MINFER_MMQ_Q6K_EXP and the backend can
  switch the W_exp path at run time — one engine, loaded with the planes
  registered, each rep under `backend.using(exp_enabled=True/False)`.
  The memory the B side would buy back is the measured plane allocation.
- two engines: anything else (settings read at load time). Each engine is
  loaded with its setting in the environment, which is restored afterwards;
  a setting read later than load time (at a kernel launch) would see neither,
  so only load-time settings can be compared this way.

Per rep: prefill of P seeded random token ids from position 0, timed as
`minfer bench` times it (CUDA events / perf_counter). "separated" means the
distributions do not overlap: max of the slower side < min of the faster.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from minfer.bench import prompt_ids, time_prefill
from minfer.errors import MinferError

EXP_KEY = "MINFER_MMQ_Q6K_EXP"


def parse_setting(items: list[str]) -> dict[str, str]:
    """["K=V", "K2=V2,K3=V3"] -> {K: V, ...}"""
    out = {}
    for item in items:
        for kv in item.split(","):
            k, sep, v = kv.partition("=")
            if not sep or not k:
                raise MinferError(f"a setting is KEY=VALUE, got {kv!r}")
            out[k.strip()] = v.strip()
    return out


def load_with_env(model, backend: str, n_ctx: int, env: dict[str, str]):
    """Engine.load with `env` set in os.environ for the duration of the load."""
    from minfer.engine import Engine
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return Engine.load(model, backend=backend, n_ctx=n_ctx, progress=False)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(model, P: int, reps: int, a: dict, b: dict, backend: str, seed: int,
        logits_from: int | None = None) -> dict:
    if reps < 1 or P < 1:
        raise MinferError(f"-r and -p must be positive, got {reps} and {P}")
    toggle = set(a) | set(b) == {EXP_KEY} and a.get(EXP_KEY) != b.get(EXP_KEY) and backend == "cuda"
    if toggle:
        eng = load_with_env(model, backend, P, {EXP_KEY: "1"})    # planes registered
        engines = {"A": eng, "B": eng}
        exp_on = {"A": a[EXP_KEY] != "0", "B": b[EXP_KEY] != "0"}
    else:
        engines = {"A": load_with_env(model, backend, P, a), "B": load_with_env(model, backend, P, b)}
    caches = {s: e.new_cache(P) for s, e in engines.items()} if not toggle else \
        dict.fromkeys("AB", engines["A"].new_cache(P))
    timers = {s: e.backend.timer() for s, e in engines.items()}
    tokens = prompt_ids(engines["A"].cfg.vocab_size, P, seed)

    def one(side: str) -> float:
        if not toggle:
            return time_prefill(engines[side], caches[side], tokens, timers[side], logits_from)
        with engines[side].backend.using(exp_enabled=exp_on[side]):
            return time_prefill(engines[side], caches[side], tokens, timers[side], logits_from)

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
           "logits_from": logits_from,
           "mode": "toggle" if toggle else "two engines", "order": order}
    for side, setting in (("A", a), ("B", b)):
        tps = [P / s for s in secs[side]]
        res[side] = {"setting": setting, "seconds": secs[side], "tok_s": tps,
                     "median": statistics.median(tps), "min": min(tps), "max": max(tps),
                     "counters": counts[side] or None}
    fast, slow = (res["A"], res["B"]) if res["A"]["median"] >= res["B"]["median"] else (res["B"], res["A"])
    res["ratio_b_over_a"] = res["B"]["median"] / res["A"]["median"]
    res["separated"] = slow["max"] < fast["min"]
    res["w_exp_plane_bytes"] = engines["A"].backend.memory_report().get("W_exp planes")
    if toggle:
        res["memory_bought_back_bytes"] = res["w_exp_plane_bytes"]    # what EXP=0 does not register
    return res


def report(r: dict) -> str:
    fmt = lambda s: ", ".join(f"{k}={v}" for k, v in s.items())
    head = ("LM head on the last position" if r.get("logits_from") is None
            else f"LM head on positions {r['logits_from']}.. (perplexity-shaped)")
    lines = [f"A/B prefill of {r['n_tokens']} tokens ({head}), {r['reps']} reps interleaved, "
             f"{r['backend']}, mode: {r['mode']}"]
    for side in "AB":
        s = r[side]
        lines.append(f"{side} ({fmt(s['setting'])}): median {s['median']:.2f} t/s, "
                     f"min {s['min']:.2f}, max {s['max']:.2f}")
        lines.append("   reps: " + " ".join(f"{v:.2f}" for v in s["tok_s"]))
        if s["counters"]:
            lines.append("   launch paths: " + ", ".join(f"{k}={v}" for k, v in s["counters"].items()))
    lines.append(f"B/A median ratio: {r['ratio_b_over_a']:.4f} "
                 f"({(r['ratio_b_over_a'] - 1) * 100:+.2f}%); separated: {'yes' if r['separated'] else 'no'}")
    if r["w_exp_plane_bytes"] is not None:
        lines.append(f"W_exp planes allocated: {r['w_exp_plane_bytes']:,} bytes"
                     + (f" (bought back with {EXP_KEY}=0)" if r["mode"] == "toggle" else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-p", "--n-tokens", type=int, default=3325, help="prefill length (default 3325)")
    ap.add_argument("-r", "--reps", type=int, default=7, help="reps per side (default 7)")
    ap.add_argument("--a", action="append", required=True, metavar="KEY=VALUE", help="setting A")
    ap.add_argument("--b", action="append", required=True, metavar="KEY=VALUE", help="setting B")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logits-from", type=int, default=None,
                    help="LM head on positions N.. (0: all, as perplexity does); default: the last")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of text")
    args = ap.parse_args(argv)
    try:
        r = run(args.model, args.n_tokens, args.reps, parse_setting(args.a), parse_setting(args.b),
                args.backend, args.seed, args.logits_from)
    except MinferError as e:
        print(f"ab: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r) if args.json else report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
