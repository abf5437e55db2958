"""CUDA settings named on a command line: `--set gateup_fused=0`, `--a exp_planes=1
--b exp_planes=0` (scripts.bench.ab, scripts.check.golden, scripts.check.greedy_stream).

The switches that exist for A/B runs and tests are fields of the CUDA backend's
CudaSettings (minfer/backend/cuda/settings.py), not environment variables. A
script sets them on one engine:

- run-time fields (which kernel a launch takes: ffn_f16, gateup_fused,
  flash_wgmma, dependent_launches, exp_enabled, graphs, f16_min_t) with
  `engine.backend.using(**fields)` around the work;
- load-time fields (what is allocated or registered at load: exp_planes,
  f16_weights, force_exp_miss) with `Engine.load(..., settings=fields)`.

A value is 0/1/true/false for a switch and an integer for a count (f16_min_t).
"""
from __future__ import annotations

import contextlib
import dataclasses

from minfer.backend.cuda.settings import LOAD_TIME, CudaSettings      # (imports without cupy)
from minfer.errors import MinferError

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def known() -> dict[str, object]:
    """CudaSettings field name -> its default."""
    return {f.name: f.default for f in dataclasses.fields(CudaSettings)}


def parse_value(name: str, text: str, default) -> bool | int:
    t = text.strip().lower()
    if isinstance(default, bool):
        if t in _TRUE:
            return True
        if t in _FALSE:
            return False
        raise MinferError(f"{name} is a switch: 0, 1, true or false, got {text!r}")
    if isinstance(default, int):
        try:
            return int(t)
        except ValueError:
            raise MinferError(f"{name} is an integer, got {text!r}") from None
    raise MinferError(f"{name} cannot be set from the command line")


def parse(items: list[str] | None) -> dict[str, bool | int]:
    """["gateup_fused=0", "ffn_f16=1,graphs=false"] -> {"gateup_fused": False, ...}.
    An unknown field or a bad value is a MinferError (one line)."""
    fields = known()
    out: dict[str, bool | int] = {}
    for item in items or ():
        for kv in item.split(","):
            k, sep, v = kv.partition("=")
            k = k.strip()
            if not sep or not k:
                raise MinferError(f"a setting is FIELD=VALUE, got {kv!r}")
            if k not in fields:
                raise MinferError(f"unknown setting {k!r} (CudaSettings fields: {', '.join(fields)})")
            out[k] = parse_value(k, v, fields[k])
    return out


def split(fields: dict) -> tuple[dict, dict]:
    """-> (load-time fields, run-time fields)"""
    return ({k: v for k, v in fields.items() if k in LOAD_TIME},
            {k: v for k, v in fields.items() if k not in LOAD_TIME})


def text(fields: dict) -> str:
    """{"gateup_fused": False} -> "gateup_fused=0" (as they are written on the command line)"""
    return ", ".join(f"{k}={int(v)}" for k, v in fields.items()) or "defaults"


def load_engine(model, backend: str, n_ctx: int | None, load_fields: dict):
    """Engine.load with the load-time fields applied on top of the environment's settings."""
    from minfer.engine import Engine
    extra = {"settings": dict(load_fields)} if load_fields else {}
    return Engine.load(model, backend=backend, n_ctx=n_ctx, progress=False, **extra)


def using(engine, run_fields: dict):
    """A context manager running with the run-time fields set on the engine's backend."""
    if not run_fields:
        return contextlib.nullcontext()
    if not hasattr(engine.backend, "using"):
        raise MinferError(f"settings ({text(run_fields)}) are the CUDA backend's; "
                          f"the {engine.backend.name} backend has none")
    return engine.backend.using(**run_fields)
