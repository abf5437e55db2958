"""Weights by GGUF name, and every load-time fix in one function."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from ..contract import ROPE_FREQS, expected_tensors
from ..errors import MinferError
from ..progress import bar


@dataclass
class LayerWeights:
    attn_norm: Any
    attn_q: Any
    attn_k: Any
    attn_v: Any
    attn_q_bias: Any
    attn_k_bias: Any
    attn_v_bias: Any
    attn_output: Any
    ffn_norm: Any
    ffn_gate: Any
    ffn_up: Any
    ffn_down: Any


@dataclass
class Weights:
    token_embd: Any
    layers: list[LayerWeights]
    output_norm: Any
    output: Any


def load_weights(gf, cfg, backend, progress: bool = True) -> Weights:
    """Register every tensor the graph needs with `backend`.

    Load-time fixes, all here:
    - tied output: a model without `output.weight` uses `token_embd.weight` as
      its LM head (registered once, shared).
    - RoPE layout: llama GGUFs store q/k permuted for adjacent-pair rotation and
      qwen2 GGUFs do not; nothing is rewritten, cfg.rope_neox (config.py)
      tells the backend which rotation to apply.
    - biases: qwen2 has q/k/v biases, llama none (None is passed to linear).
    - RoPE frequency factors: a llama GGUF may carry `rope_freqs.weight` (Llama
      3.1's RoPE scaling); its values go to the backend's RoPE tables
      (backend.set_rope_factors), not to an op.
    """
    def need(name: str):
        if name not in gf.tensors:
            raise MinferError(f"{gf.path}: tensor {name} is missing")
        return gf.tensors[name]

    # the tensors the graph reads: the model contract's one table (minfer/contract.py)
    tied = "output.weight" not in gf.tensors
    names = [n for n, (_, required) in expected_tensors(cfg).items() if required or n in gf.tensors]

    if ROPE_FREQS in names:
        names.remove(ROPE_FREQS)
        backend.set_rope_factors(_rope_factors(gf, need(ROPE_FREQS)))

    h: dict[str, Any] = {}
    for name in bar(names, enabled=progress, desc=f"load ({backend.name})", unit="tensor", leave=False):
        h[name] = backend.load_weight(name, need(name), gf.raw(name))

    def lw(i: int) -> LayerWeights:
        p = f"blk.{i}."
        b = (lambda x: h[p + f"attn_{x}.bias"]) if cfg.qkv_bias else (lambda x: None)
        return LayerWeights(
            attn_norm=h[p + "attn_norm.weight"], attn_q=h[p + "attn_q.weight"],
            attn_k=h[p + "attn_k.weight"], attn_v=h[p + "attn_v.weight"],
            attn_q_bias=b("q"), attn_k_bias=b("k"), attn_v_bias=b("v"),
            attn_output=h[p + "attn_output.weight"], ffn_norm=h[p + "ffn_norm.weight"],
            ffn_gate=h[p + "ffn_gate.weight"], ffn_up=h[p + "ffn_up.weight"],
            ffn_down=h[p + "ffn_down.weight"])

    return Weights(token_embd=h["token_embd.weight"], layers=[lw(i) for i in range(cfg.n_layer)],
                   output_norm=h["output_norm.weight"],
                   output=h["token_embd.weight"] if tied else h["output.weight"])


def _rope_factors(gf, info) -> np.ndarray:
    """rope_freqs.weight -> float32 (hd/2,) host; F32, every factor finite and > 0
    (each divides a RoPE frequency)."""
    if info.qtype != GGMLQuantizationType.F32:
        raise MinferError(f"{gf.path}: tensor {ROPE_FREQS} has type {info.qtype.name}, expected F32")
    f = np.array(np.ascontiguousarray(gf.raw(ROPE_FREQS)).view(np.float32).reshape(-1))
    bad = ~(np.isfinite(f) & (f > 0))
    if bad.any():
        raise MinferError(f"{gf.path}: tensor {ROPE_FREQS}[{int(np.argmax(bad))}] = {float(f[bad][0])}: "
                          f"RoPE frequency factors must be finite and positive")
    return f
