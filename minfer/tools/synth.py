"""Synthetic models: seeded Gaussian weights, quantized with the project's
quantizers, written as complete GGUF files with the real model's tensor names
and types.

Two users: `write_synthetic` (a small qwen2/llama model for tests: real names,
real quantization mix, the 7B's tokenizer; `synth_model` caches one by its
parameters, e.g. SMALL_MODEL) and `minfer.tools.twin` (the 7B's exact layout).
Both draw tensor values through `draw_rows`, so a tensor's values are a function of (seed, tensor name, row block) only — independent of how the
work is split between processes, and the same bytes on every run.

Scales are chosen so a random model behaves like a model: linear weights have
std 1/sqrt(n_in) (activations stay O(1) through the layers, logits ~ N(0, 1)),
norm weights are 1 + 0.1*N(0,1), biases 0.02*N(0,1), the embedding table
std 1/sqrt(d) (like a trained model's, ~0.02 at d=3584).
"""
from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, Keys, LlamaFileType

from ..errors import MinferError
from ..package_data import package_data_dir
from ..format.quantize import quantize

Q = GGMLQuantizationType
HEADER_7B_NAME = "deepseek-r1-distill-qwen-7b-q4_k_m.header.gguf"

# Values are drawn in blocks of about this many elements, each block from its own
# seeded stream, so any split of a tensor into block-aligned row chunks
# reproduces the same values.
DRAW_BLOCK_ELEMENTS = 1 << 20


def header_7b_path() -> Path:
    """The bundled 7B header: installed package `minfer.models`, else the
    repository checkout (minfer.package_data)."""
    d = package_data_dir("minfer.models", HEADER_7B_NAME)
    if d is None:
        raise MinferError(f"the 7B header {HEADER_7B_NAME} was not found; reinstall minfer")
    return d / HEADER_7B_NAME


# --- values -------------------------------------------------------------------

def value_law(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of the Gaussian a tensor is drawn from, by its GGUF name."""
    if name.endswith("_norm.weight"):
        return 1.0, 0.1
    if name.endswith(".bias"):
        return 0.0, 0.02
    if name == "rope_freqs.weight":                        # RoPE frequency factors: all 1
        return 1.0, 0.0
    if len(shape) != 2:
        raise MinferError(f"synthetic weights: no value law for {name} of shape {shape}")
    if name == "token_embd.weight":
        return 0.0, 1.0 / np.sqrt(shape[1])              # (vocab, d): std 1/sqrt(d)
    return 0.0, 1.0 / np.sqrt(shape[1])                  # (n_out, n_in): std 1/sqrt(n_in)


def rows_per_draw_block(n_cols: int) -> int:
    return max(1, DRAW_BLOCK_ELEMENTS // n_cols)


def draw_rows(name: str, shape: tuple[int, ...], seed: int, row0: int, row1: int) -> np.ndarray:
    """Rows row0..row1-1 of tensor `name` (numpy shape; 1-D = one row) -> float32
    (row1-row0, n_cols). row0 must sit on a draw-block boundary."""
    n_cols = shape[-1]
    n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    rb = rows_per_draw_block(n_cols)
    if row0 % rb or not 0 <= row0 < row1 <= n_rows:
        raise ValueError(f"draw_rows({name}): rows {row0}..{row1} not block-aligned (block {rb}) "
                         f"or outside 0..{n_rows}")
    mean, std = value_law(name, shape)
    key = zlib.crc32(name.encode())
    out = np.empty((row1 - row0, n_cols), dtype=np.float32)   # (rows, n_cols)
    for b0 in range(row0, row1, rb):
        b1 = min(b0 + rb, row1)
        rng = np.random.default_rng(np.random.SeedSequence([seed, key, b0 // rb]))
        block = rng.standard_normal((b1 - b0, n_cols), dtype=np.float32)
        out[b0 - row0:b1 - row0] = block * np.float32(std) + np.float32(mean)
    return out


def quantize_rows(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 (rows, cols) -> uint8 (rows, row_bytes) in `qtype`, with the project's
    quantizers in their fast mode (search=False: ggml's first scale guess, no
    iterative search; valid blocks, ~10x faster, RMS error 0.078 vs 0.072 of std
    for q4_K on Gaussian data)."""
    return quantize(np.ascontiguousarray(x, dtype=np.float32), qtype, search=False)


def tensor_bytes(name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType, seed: int,
                 row0: int = 0, row1: int | None = None) -> np.ndarray:
    """The file bytes of rows row0..row1 of one synthetic tensor -> uint8 (rows, row_bytes)."""
    n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    return quantize_rows(draw_rows(name, shape, seed, row0, n_rows if row1 is None else row1), qtype)


# --- the small model ------------------------------------------------------------

def synthetic_tensors(arch: str, n_layer: int, d_model: int, n_head: int, n_head_kv: int,
                      d_ff: int, vocab: int) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    """(name, numpy shape, type) in the real Q4_K_M file's order and mix:
    q4_K linears, q6_K attn_v / ffn_down / output, f32 norms and biases."""
    hd = d_model // n_head
    kv = n_head_kv * hd
    t = [("output.weight", (vocab, d_model), Q.Q6_K),
         ("output_norm.weight", (d_model,), Q.F32),
         ("token_embd.weight", (vocab, d_model), Q.Q4_K)]
    for i in range(n_layer):
        p = f"blk.{i}."
        layer = [("attn_k.bias", (kv,), Q.F32), ("attn_k.weight", (kv, d_model), Q.Q4_K),
                 ("attn_norm.weight", (d_model,), Q.F32),
                 ("attn_output.weight", (d_model, d_model), Q.Q4_K),
                 ("attn_q.bias", (d_model,), Q.F32), ("attn_q.weight", (d_model, d_model), Q.Q4_K),
                 ("attn_v.bias", (kv,), Q.F32), ("attn_v.weight", (kv, d_model), Q.Q6_K),
                 ("ffn_down.weight", (d_model, d_ff), Q.Q6_K),
                 ("ffn_gate.weight", (d_ff, d_model), Q.Q4_K),
                 ("ffn_norm.weight", (d_model,), Q.F32),
                 ("ffn_up.weight", (d_ff, d_model), Q.Q4_K)]
        if arch != "qwen2":      # llama: no q/k/v biases
            layer = [x for x in layer if not x[0].endswith(".bias")]
        t += [(p + n, s, q) for n, s, q in layer]
    return t


def _add_metadata_value(w: GGUFWriter, key: str, value) -> None:
    """Write one metadata value read back from a GGUF with the type llama.cpp uses for
    it: bool -> BOOL, int -> UINT32, float -> FLOAT32, str -> STRING, lists by their
    first element (int arrays as INT32, like tokenizer.ggml.token_type)."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        w.add_array(key, list(value))
    else:
        raise MinferError(f"cannot copy metadata key {key} of type {type(value).__name__}")


def write_synthetic(path, *, n_layer: int = 2, d_model: int = 512, n_head: int = 4,
                    n_head_kv: int = 2, d_ff: int = 1280, seed: int = 0, arch: str = "qwen2",
                    tokenizer_from=None) -> Path:
    """Write a complete small GGUF model to `path` -> Path.

    Real tensor names and quantization mix, the tokenizer (every `tokenizer.*`
    key) of `tokenizer_from` (default: the bundled 7B header), seeded Gaussian
    weights (see the module docstring). Same arguments, same bytes.
    """
    from ..format.gguf import open_gguf

    if arch not in ("qwen2", "llama"):
        raise MinferError(f"synthetic models: unsupported architecture {arch!r} (qwen2, llama)")
    if d_model % n_head or n_head % n_head_kv or (d_model // n_head) % 2:
        raise MinferError(f"synthetic models: inconsistent heads (d_model {d_model}, "
                          f"heads {n_head}/{n_head_kv})")
    qk = GGML_QUANT_SIZES[Q.Q4_K][0]
    for what, n in (("d_model", d_model), ("d_ff", d_ff)):     # the row lengths of the linears
        if n % qk:
            raise MinferError(f"synthetic models: {what} = {n} is not a multiple of the "
                              f"k-quant super-block ({qk})")

    src = open_gguf(tokenizer_from if tokenizer_from is not None else header_7b_path(),
                    header_only=True)
    try:
        tok_meta = [(k, v) for k, v in src.metadata.items() if k.startswith("tokenizer.")]
        src_arch = src.get(Keys.General.ARCHITECTURE)
        rope_base = src.get(Keys.Rope.FREQ_BASE.format(arch=src_arch), 10000.0)
        rms_eps = src.get(Keys.Attention.LAYERNORM_RMS_EPS.format(arch=src_arch), 1e-6)
    finally:
        src.close()
    tokens = dict(tok_meta).get(Keys.Tokenizer.LIST)
    if not tokens:
        raise MinferError(f"{tokenizer_from}: no tokenizer ({Keys.Tokenizer.LIST}) to copy")
    vocab = len(tokens)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(path, arch)           # writes general.architecture first
    w.add_name(f"minfer synthetic {arch} L{n_layer} d{d_model} seed{seed}")
    w.add_block_count(n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(d_model)
    w.add_feed_forward_length(d_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(float(rope_base))
    w.add_layer_norm_rms_eps(float(rms_eps))
    for k, v in tok_meta:
        _add_metadata_value(w, k, v)
    w.add_quantization_version(2)
    w.add_file_type(LlamaFileType.MOSTLY_Q4_K_M)

    for name, shape, qtype in synthetic_tensors(arch, n_layer, d_model, n_head, n_head_kv, d_ff, vocab):
        data = tensor_bytes(name, shape, qtype, seed)        # (rows, row_bytes)
        if len(shape) == 1:
            data = data.reshape(-1)    # a vector stays 1-D in the file (ne = [n])
        w.add_tensor(name, data, raw_dtype=qtype)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return path


# The model of the golden streams (scripts/check/golden.py, tests/golden/) and of the
# GPU parity and CUDA-graph tests: 3 layers, d 512, GQA 2:1, head_dim 128.
SMALL_MODEL = {"n_layer": 3, "d_model": 512, "n_head": 4, "n_head_kv": 2, "d_ff": 1280,
               "seed": 20261129, "arch": "qwen2"}


def synth_model(model_dir, params: dict = SMALL_MODEL) -> Path:
    """The synthetic model for `params` (write_synthetic's keyword arguments, all
    of SMALL_MODEL's keys) in model_dir -> Path, written on first use.

    The file name encodes every parameter, so a cached file is reused only for
    the same parameters, which give the same bytes."""
    p = dict(params)
    name = "synth-{arch}-L{n_layer}-d{d_model}-h{n_head}-{n_head_kv}-f{d_ff}-s{seed}.gguf".format(**p)
    path = Path(model_dir) / name
    if not path.is_file():
        tmp = path.with_suffix(".tmp")
        write_synthetic(tmp, **p)
        os.replace(tmp, path)        # never a half-written file under the final name
    return path
