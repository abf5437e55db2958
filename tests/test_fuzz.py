"""Adversarial input: every damaged model, chat template and command line ends in exactly
one stderr line `minfer: error: ...`, exit code 2, no traceback, in under 10 s.

Each case writes its own damaged input: a tiny model built here with gguf.GGUFWriter
(qwen2 or llama, 2 layers, d 32, float32 weights; a byte-level BPE or a
SentencePiece vocabulary of a few hundred tokens), with one metadata value, tensor,
tokenizer array, weight, template or argument broken. The command runs in-process
(`minfer.cli.main`); the undamaged model is checked to run first, so each failure
is the damage's. The message must name what is wrong (a fragment per case). The
last tests need real processes: a closed stdout, a model file truncated under a run.
"""
from __future__ import annotations

import io
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf import GGUFWriter, TokenType
from gguf.gguf_writer import GGUFValue

from minfer.cli import main

D, HEADS, KV_HEADS, FF, LAYERS = 32, 4, 2, 64, 2
KV = KV_HEADS * D // HEADS
DROP = object()                       # a mutation that removes the key or tensor
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = "hello hello world " * 12      # perplexity text: 72 tokens, enough for -c 8


# --- the tiny model -------------------------------------------------------------------

def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet, the 256 characters a byte-level BPE vocabulary starts with."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, shifted = [], 0
    for b in range(256):
        out.append(chr(b) if b in keep else chr(256 + shifted))
        shifted += b not in keep
    return out


def _vocab(kind: str) -> dict:
    """tokenizer.* metadata: (type, value, item type) per key."""
    if kind == "gpt2":
        tokens = _byte_chars() + ["he", "ll", "llo", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        types = [TokenType.NORMAL] * (len(tokens) - 3) + [TokenType.CONTROL] * 3
        return {"tokenizer.ggml.model": (V.STRING, "gpt2"), "tokenizer.ggml.pre": (V.STRING, "qwen2"),
                "tokenizer.ggml.tokens": (V.ARRAY, tokens, V.STRING),
                "tokenizer.ggml.token_type": (V.ARRAY, [int(t) for t in types], V.INT32),
                "tokenizer.ggml.merges": (V.ARRAY, ["h e", "l l", "ll o"], V.STRING),
                "tokenizer.ggml.bos_token_id": (V.UINT32, len(tokens) - 3),
                "tokenizer.ggml.eos_token_id": (V.UINT32, len(tokens) - 1),
                "tokenizer.ggml.add_bos_token": (V.BOOL, False),
                "tokenizer.chat_template": (V.STRING, CHAT_TEMPLATE)}
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "▁he", "llo", "▁hello", "▁w", "▁world"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = ([TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
             + [TokenType.NORMAL] * len(pieces))
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return {"tokenizer.ggml.model": (V.STRING, "llama"),
            "tokenizer.ggml.tokens": (V.ARRAY, tokens, V.STRING),
            "tokenizer.ggml.token_type": (V.ARRAY, [int(t) for t in types], V.INT32),
            "tokenizer.ggml.scores": (V.ARRAY, scores, V.FLOAT32),
            "tokenizer.ggml.bos_token_id": (V.UINT32, 1), "tokenizer.ggml.eos_token_id": (V.UINT32, 2),
            "tokenizer.ggml.unknown_token_id": (V.UINT32, 0),
            "tokenizer.chat_template": (V.STRING, CHAT_TEMPLATE.replace("<|im_start|>", "<s>")
                                        .replace("<|im_end|>", "</s>"))}


@dataclass
class Spec:
    """A model to write: metadata key -> (type, value[, item type]), tensor name -> array
    (float32) or (raw bytes, type)."""
    arch: str
    meta: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)

    @property
    def n_vocab(self) -> int:
        return len(self.meta["tokenizer.ggml.tokens"][1])


def base_spec(arch: str = "qwen2") -> Spec:
    s = Spec(arch)
    a = arch
    s.meta = {"general.architecture": (V.STRING, arch),
              f"{a}.block_count": (V.UINT32, LAYERS), f"{a}.context_length": (V.UINT32, 256),
              f"{a}.embedding_length": (V.UINT32, D), f"{a}.feed_forward_length": (V.UINT32, FF),
              f"{a}.attention.head_count": (V.UINT32, HEADS),
              f"{a}.attention.head_count_kv": (V.UINT32, KV_HEADS),
              f"{a}.rope.freq_base": (V.FLOAT32, 10000.0),
              f"{a}.attention.layer_norm_rms_epsilon": (V.FLOAT32, 1e-6),
              **_vocab("gpt2" if arch == "qwen2" else "llama")}
    rng = np.random.default_rng(7)

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    n = s.n_vocab
    t = {"token_embd.weight": w(n, D), "output_norm.weight": norm(D), "output.weight": w(n, D)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        t |= {p + "attn_norm.weight": norm(D), p + "attn_q.weight": w(D, D), p + "attn_k.weight": w(KV, D),
              p + "attn_v.weight": w(KV, D), p + "attn_output.weight": w(D, D),
              p + "ffn_norm.weight": norm(D), p + "ffn_gate.weight": w(FF, D), p + "ffn_up.weight": w(FF, D),
              p + "ffn_down.weight": w(D, FF)}
        if arch == "qwen2":
            t |= {p + "attn_q.bias": w(1, D)[0] * 0.1, p + "attn_k.bias": w(1, KV)[0] * 0.1,
                  p + "attn_v.bias": w(1, KV)[0] * 0.1}
    s.tensors = t
    return s


def write(spec: Spec, path: Path) -> Path:
    w = GGUFWriter(path, spec.arch)
    # the spec's metadata only, as given (it may damage general.architecture too)
    w.kv_data[0] = {k: GGUFValue(v[1], v[0], *v[2:]) for k, v in spec.meta.items() if v is not DROP}
    for name, t in spec.tensors.items():
        if t is DROP:
            continue
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- running the command ---------------------------------------------------------------

def run(argv: list[str], capsys, stdin: bytes | None = None, monkeypatch=None) -> tuple[int, str, str, float]:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    capsys.readouterr()
    t0 = time.perf_counter()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:          # argparse's errors exit (one line, status 2)
        rc = e.code
    dt = time.perf_counter() - t0
    out, err = capsys.readouterr()
    return rc, out, err, dt


BACKEND_NOTE = re.compile(r"minfer: backend (cpu|cuda) \(.+\)")


def error_lines(err: str) -> list[str]:
    """The lines of stderr as a terminal shows them, less the one note that names
    the backend `--backend auto` chose (it comes before a failure after the choice):
    a progress bar erased with \\r is not a line."""
    shown = [line.rsplit("\r", 1)[-1] for line in err.split("\n") if line.rsplit("\r", 1)[-1].strip()]
    if shown and BACKEND_NOTE.fullmatch(shown[0]):
        shown = shown[1:]
    return shown


def assert_one_line_error(rc: int, err: str, dt: float, fragment: str) -> None:
    assert "Traceback" not in err
    lines = error_lines(err)
    assert rc == 2, (rc, err)
    assert len(lines) == 1 and lines[0].startswith("minfer: error: "), err
    assert fragment in lines[0], lines[0]
    assert dt < 10, f"{dt:.1f} s"


GEN = ["generate", "-p", "hello world", "-n", "3", "-q"]
CHAT = ["generate", "-p", "hello", "-n", "2", "-q", "--chat"]


def key(s: Spec, k: str, *v) -> None:
    """Set (or with DROP remove) metadata key k; `{a}` is the architecture."""
    s.meta[k.format(a=s.arch)] = v[0] if v[0] is DROP else v


# --- the cases: (id, architecture, mutation, command, fragment of the message) ---------------
# command: argv after the subcommand's model path is added (-m MODEL), or a function
# (model path, tmp_path) -> argv for commands that need more.

HYPER = [
    ("block_count-string", lambda s: key(s, "{a}.block_count", V.STRING, "2"), "block_count must be an integer"),
    ("block_count-zero", lambda s: key(s, "{a}.block_count", V.UINT32, 0), "block_count = 0"),
    ("block_count-negative", lambda s: key(s, "{a}.block_count", V.INT32, -1), "block_count = -1"),
    ("block_count-2^40", lambda s: key(s, "{a}.block_count", V.UINT64, 2**40), "block_count"),
    ("block_count-2^30", lambda s: key(s, "{a}.block_count", V.UINT32, 2**30), "block_count"),
    ("block_count-float", lambda s: key(s, "{a}.block_count", V.FLOAT32, 2.0), "block_count must be an integer"),
    ("block_count-bool", lambda s: key(s, "{a}.block_count", V.BOOL, True), "block_count must be an integer"),
    ("block_count-array", lambda s: key(s, "{a}.block_count", V.ARRAY, [2], V.UINT32), "block_count"),
    ("block_count-missing", lambda s: key(s, "{a}.block_count", DROP), "missing metadata key qwen2.block_count"),
    ("block_count-more-than-tensors", lambda s: key(s, "{a}.block_count", V.UINT32, 3), "block_count = 3"),
    ("block_count-fewer-than-tensors", lambda s: key(s, "{a}.block_count", V.UINT32, 1), "blk.1."),
    ("embedding_length-zero", lambda s: key(s, "{a}.embedding_length", V.UINT32, 0), "embedding_length = 0"),
    ("embedding_length-string", lambda s: key(s, "{a}.embedding_length", V.STRING, "32"), "embedding_length"),
    ("embedding_length-2^40", lambda s: key(s, "{a}.embedding_length", V.UINT64, 2**40), "embedding_length"),
    ("embedding_length-not-the-tensors", lambda s: key(s, "{a}.embedding_length", V.UINT32, 48), "token_embd.weight"),
    ("head_count-zero", lambda s: key(s, "{a}.attention.head_count", V.UINT32, 0), "head_count = 0"),
    ("head_count-negative", lambda s: key(s, "{a}.attention.head_count", V.INT32, -4), "head_count = -4"),
    ("head_count-not-dividing", lambda s: key(s, "{a}.attention.head_count", V.UINT32, 5), "head geometry"),
    ("head_count-odd-head-size", lambda s: key(s, "{a}.attention.head_count", V.UINT32, 32), "head geometry"),
    ("head_count-string", lambda s: key(s, "{a}.attention.head_count", V.STRING, "4"), "head_count"),
    ("head_count-not-the-tensors", lambda s: key(s, "{a}.attention.head_count", V.UINT32, 8), "attn_k.weight"),
    ("head_count_kv-zero", lambda s: key(s, "{a}.attention.head_count_kv", V.UINT32, 0), "head_count_kv = 0"),
    ("head_count_kv-not-dividing", lambda s: key(s, "{a}.attention.head_count_kv", V.UINT32, 3), "head geometry"),
    ("head_count_kv-above-heads", lambda s: key(s, "{a}.attention.head_count_kv", V.UINT32, 8), "head geometry"),
    ("head_count_kv-float", lambda s: key(s, "{a}.attention.head_count_kv", V.FLOAT32, 2.0), "head_count_kv"),
    ("feed_forward_length-zero", lambda s: key(s, "{a}.feed_forward_length", V.UINT32, 0), "feed_forward_length = 0"),
    ("feed_forward_length-not-the-tensors", lambda s: key(s, "{a}.feed_forward_length", V.UINT32, 128), "ffn_gate.weight"),
    ("feed_forward_length-string", lambda s: key(s, "{a}.feed_forward_length", V.STRING, "x"), "feed_forward_length"),
    ("context_length-zero", lambda s: key(s, "{a}.context_length", V.UINT32, 0), "context_length = 0"),
    ("context_length-negative", lambda s: key(s, "{a}.context_length", V.INT64, -1), "context_length = -1"),
    ("context_length-string", lambda s: key(s, "{a}.context_length", V.STRING, "4096"), "context_length"),
    ("context_length-float", lambda s: key(s, "{a}.context_length", V.FLOAT64, 4096.0), "context_length"),
    ("rope_base-nan", lambda s: key(s, "{a}.rope.freq_base", V.FLOAT32, float("nan")), "freq_base = nan"),
    ("rope_base-zero", lambda s: key(s, "{a}.rope.freq_base", V.FLOAT32, 0.0), "freq_base = 0.0"),
    ("rope_base-negative", lambda s: key(s, "{a}.rope.freq_base", V.FLOAT32, -10000.0), "freq_base"),
    ("rope_base-inf", lambda s: key(s, "{a}.rope.freq_base", V.FLOAT64, float("inf")), "freq_base = inf"),
    ("rope_base-string", lambda s: key(s, "{a}.rope.freq_base", V.STRING, "1e4"), "freq_base must be a number"),
    ("rms_eps-nan", lambda s: key(s, "{a}.attention.layer_norm_rms_epsilon", V.FLOAT32, float("nan")), "rms_epsilon"),
    ("rms_eps-negative", lambda s: key(s, "{a}.attention.layer_norm_rms_epsilon", V.FLOAT32, -1e-6), "rms_epsilon"),
    ("rms_eps-zero", lambda s: key(s, "{a}.attention.layer_norm_rms_epsilon", V.FLOAT32, 0.0), "rms_epsilon"),
    ("rms_eps-inf", lambda s: key(s, "{a}.attention.layer_norm_rms_epsilon", V.FLOAT32, float("inf")), "rms_epsilon"),
    ("rms_eps-bool", lambda s: key(s, "{a}.attention.layer_norm_rms_epsilon", V.BOOL, True), "rms_epsilon"),
    ("rope_dimension_count-partial", lambda s: key(s, "{a}.rope.dimension_count", V.UINT32, 4), "dimension_count"),
    ("key_length-not-head-size", lambda s: key(s, "{a}.attention.key_length", V.UINT32, 16), "key_length"),
    ("rope_scaling-yarn", lambda s: key(s, "{a}.rope.scaling.type", V.STRING, "yarn"), "scaling.type"),
    ("vocab_size-not-the-embedding", lambda s: key(s, "{a}.vocab_size", V.UINT32, 999), "vocab_size = 999"),
    ("vocab_size-string", lambda s: key(s, "{a}.vocab_size", V.STRING, "261"), "vocab_size"),
    ("architecture-missing", lambda s: key(s, "general.architecture", DROP), "unsupported architecture None"),
    ("architecture-gptj", lambda s: key(s, "general.architecture", V.STRING, "gptj"), "'gptj'"),
    ("architecture-number", lambda s: key(s, "general.architecture", V.UINT32, 7), "unsupported architecture 7"),
    ("architecture-empty", lambda s: key(s, "general.architecture", V.STRING, ""), "unsupported architecture"),
]


def tensor(s: Spec, name: str, value) -> None:
    s.tensors[name] = value


def scaled(name: str, factor: float):
    """Multiply one weight by factor (nan, inf)."""
    def f(s: Spec):
        t = s.tensors[name].copy()
        t.flat[0] *= factor
        s.tensors[name] = t
    return f


rng = np.random.default_rng(1)
TENSORS = [
    ("token_embd-missing", lambda s: tensor(s, "token_embd.weight", DROP), "token_embd.weight is missing"),
    ("output_norm-missing", lambda s: tensor(s, "output_norm.weight", DROP), "output_norm.weight is missing"),
    ("attn_q-missing", lambda s: tensor(s, "blk.0.attn_q.weight", DROP), "blk.0.attn_q.weight is missing"),
    ("ffn_down-missing", lambda s: tensor(s, "blk.1.ffn_down.weight", DROP), "blk.1.ffn_down.weight is missing"),
    ("attn_k_bias-missing", lambda s: tensor(s, "blk.0.attn_k.bias", DROP), "blk.0.attn_k.bias is missing"),
    ("attn_k-transposed", lambda s: tensor(s, "blk.0.attn_k.weight", np.ones((D, KV), np.float32)), "blk.0.attn_k.weight"),
    ("ffn_down-transposed", lambda s: tensor(s, "blk.1.ffn_down.weight", np.ones((FF, D), np.float32)), "ffn_down"),
    ("ffn_gate-short", lambda s: tensor(s, "blk.0.ffn_gate.weight", np.ones((FF - 1, D), np.float32)), "ffn_gate"),
    ("attn_norm-short", lambda s: tensor(s, "blk.1.attn_norm.weight", np.ones(D - 1, np.float32)), "attn_norm"),
    ("output_norm-2d", lambda s: tensor(s, "output_norm.weight", np.ones((1, D), np.float32)), "output_norm.weight"),
    ("attn_v_bias-short", lambda s: tensor(s, "blk.0.attn_v.bias", np.ones(KV // 2, np.float32)), "attn_v.bias"),
    ("output-other-vocab", lambda s: tensor(s, "output.weight", np.ones((s.n_vocab - 1, D), np.float32)), "output.weight"),
    ("token_embd-other-width", lambda s: tensor(s, "token_embd.weight", np.ones((s.n_vocab, 24), np.float32)), "token_embd"),
    ("ffn_up-3d", lambda s: tensor(s, "blk.0.ffn_up.weight", np.ones((2, FF // 2, D), np.float32)), "ffn_up"),
    ("extra-layer-tensor", lambda s: tensor(s, "blk.2.attn_q.weight", np.ones((D, D), np.float32)), "blk.2.attn_q.weight"),
    ("extra-rope_freqs", lambda s: tensor(s, "rope_freqs.weight", np.ones(4, np.float32)), "rope_freqs.weight"),
    ("unsupported-type-iq4_nl", lambda s: tensor(s, "blk.0.attn_q.weight", (np.zeros((D, 18), np.uint8), Q.IQ4_NL)), "IQ4_NL"),
    ("unsupported-type-f64", lambda s: tensor(s, "blk.0.ffn_norm.weight", np.ones(D, np.float64)), "F64"),
]

TOKENIZER = [
    ("tokens-missing", lambda s: key(s, "tokenizer.ggml.tokens", DROP), "tokenizer.ggml.tokens missing"),
    ("tokens-a-string", lambda s: key(s, "tokenizer.ggml.tokens", V.STRING, "abc"), "tokenizer.ggml.tokens must be an array, got 'abc'"),
    ("tokens-ints", lambda s: key(s, "tokenizer.ggml.tokens", V.ARRAY, list(range(s.n_vocab)), V.INT32), "tokenizer.ggml.tokens[0]"),
    ("tokens-fewer-than-embedding", lambda s: key(s, "tokenizer.ggml.tokens", V.ARRAY,
                                                  s.meta["tokenizer.ggml.tokens"][1][:-5], V.STRING), "rows"),
    ("tokens-duplicate", lambda s: key(s, "tokenizer.ggml.tokens", V.ARRAY,
                                       ["a"] + s.meta["tokenizer.ggml.tokens"][1][1:], V.STRING), "duplicate token"),
    ("token_type-short", lambda s: key(s, "tokenizer.ggml.token_type", V.ARRAY,
                                       s.meta["tokenizer.ggml.token_type"][1][:-1], V.INT32), "token_type has"),
    ("token_type-strings", lambda s: key(s, "tokenizer.ggml.token_type", V.ARRAY,
                                         ["1"] * s.n_vocab, V.STRING), "tokenizer.ggml.token_type[0]"),
    ("token_type-99", lambda s: key(s, "tokenizer.ggml.token_type", V.ARRAY,
                                    [99] + s.meta["tokenizer.ggml.token_type"][1][1:], V.INT32), "token_type[0] = 99"),
    ("token_type-negative", lambda s: key(s, "tokenizer.ggml.token_type", V.ARRAY,
                                          [-1] * s.n_vocab, V.INT32), "token_type[0] = -1"),
    ("token_type-floats", lambda s: key(s, "tokenizer.ggml.token_type", V.ARRAY,
                                        [1.0] * s.n_vocab, V.FLOAT32), "token_type[0]"),
    ("byte-token-not-0xXX", lambda s: key(s, "tokenizer.ggml.token_type", V.ARRAY,
                                          [int(TokenType.BYTE)] + s.meta["tokenizer.ggml.token_type"][1][1:],
                                          V.INT32), "BYTE token"),
    ("merges-ints", lambda s: key(s, "tokenizer.ggml.merges", V.ARRAY, [1, 2], V.INT32), "tokenizer.ggml.merges[0]"),
    ("merges-no-space", lambda s: key(s, "tokenizer.ggml.merges", V.ARRAY, ["he"], V.STRING), "malformed merge"),
    ("merges-unknown-token", lambda s: key(s, "tokenizer.ggml.merges", V.ARRAY, ["x y", "h e"], V.STRING), "merges"),
    ("merges-missing", lambda s: key(s, "tokenizer.ggml.merges", DROP), "without tokenizer.ggml.merges"),
    ("bos-out-of-range", lambda s: key(s, "tokenizer.ggml.bos_token_id", V.UINT32, 10**6), "bos_token_id = 1000000"),
    ("eos-negative", lambda s: key(s, "tokenizer.ggml.eos_token_id", V.INT32, -1), "eos_token_id = -1"),
    ("eos-string", lambda s: key(s, "tokenizer.ggml.eos_token_id", V.STRING, "2"), "eos_token_id must be an integer"),
    ("pad-huge", lambda s: key(s, "tokenizer.ggml.padding_token_id", V.UINT64, 2**63), "padding_token_id"),
    ("eot-bool", lambda s: key(s, "tokenizer.ggml.eot_token_id", V.BOOL, True), "eot_token_id"),
    ("add_bos-int", lambda s: key(s, "tokenizer.ggml.add_bos_token", V.UINT8, 1), "add_bos_token must be true or false"),
    ("add_bos-string", lambda s: key(s, "tokenizer.ggml.add_bos_token", V.STRING, "true"), "add_bos_token"),
    ("add_bos-without-bos-id", lambda s: (key(s, "tokenizer.ggml.add_bos_token", V.BOOL, True),
                                          key(s, "tokenizer.ggml.bos_token_id", DROP)), "bos_token_id"),
    ("tokenizer-model-int", lambda s: key(s, "tokenizer.ggml.model", V.UINT32, 2), "tokenizer.ggml.model must be a string"),
    ("tokenizer-model-bert", lambda s: key(s, "tokenizer.ggml.model", V.STRING, "bert"), "'bert'"),
    ("tokenizer-model-missing", lambda s: key(s, "tokenizer.ggml.model", DROP), "tokenizer.ggml.model"),
    ("pre-int", lambda s: key(s, "tokenizer.ggml.pre", V.INT32, 3), "tokenizer.ggml.pre must be a string"),
    ("pre-unknown", lambda s: key(s, "tokenizer.ggml.pre", V.STRING, "gpt-99"), "pre-tokenizer"),
    ("chat_template-array", lambda s: key(s, "tokenizer.chat_template", V.ARRAY, ["a", "b"], V.STRING), "chat_template"),
]

def rope_freqs(values, qtype=None):
    """A llama model's rope_freqs.weight (head dim 8: 4 factors)."""
    a = np.asarray(values, np.float32)
    return lambda s: tensor(s, "rope_freqs.weight", a if qtype is None else (a.astype(np.float16).view(np.uint8), qtype))


LLAMA_TENSORS = [
    ("rope_freqs-wrong-length", rope_freqs([1.0, 2.0, 4.0]), "rope_freqs.weight has shape (3,)"),
    ("rope_freqs-zero", rope_freqs([1.0, 2.0, 0.0, 8.0]), "rope_freqs.weight[2] = 0.0"),
    ("rope_freqs-negative", rope_freqs([-1.0, 2.0, 4.0, 8.0]), "rope_freqs.weight[0] = -1.0"),
    ("rope_freqs-nan", rope_freqs([1.0, float("nan"), 4.0, 8.0]), "finite and positive"),
    ("rope_freqs-f16", rope_freqs([1.0, 2.0, 4.0, 8.0], Q.F16), "rope_freqs.weight has type F16"),
]

LLAMA_TOKENIZER = [
    ("spm-scores-short", lambda s: key(s, "tokenizer.ggml.scores", V.ARRAY,
                                       s.meta["tokenizer.ggml.scores"][1][:-3], V.FLOAT32), "scores has"),
    ("spm-scores-nan", lambda s: key(s, "tokenizer.ggml.scores", V.ARRAY,
                                     [float("nan")] * s.n_vocab, V.FLOAT32), "tokenizer.ggml.scores[0] = nan"),
    ("spm-scores-strings", lambda s: key(s, "tokenizer.ggml.scores", V.ARRAY, ["0"] * s.n_vocab, V.STRING), "scores[0]"),
    ("spm-scores-missing", lambda s: key(s, "tokenizer.ggml.scores", DROP), "without tokenizer.ggml.scores"),
    ("spm-byte-token-0xZZ", lambda s: key(s, "tokenizer.ggml.tokens", V.ARRAY,
                                          [t if t != "<0x41>" else "<0xZZ>" for t in s.meta["tokenizer.ggml.tokens"][1]],
                                          V.STRING), "<0xZZ>"),
    ("spm-unk-not-unknown", lambda s: key(s, "tokenizer.ggml.unknown_token_id", V.UINT32, 3), "UNKNOWN"),
    ("spm-partial-byte-tokens", lambda s: key(s, "tokenizer.ggml.token_type", V.ARRAY,
                                              [t if i < 100 or t != int(TokenType.BYTE) else int(TokenType.NORMAL)
                                               for i, t in enumerate(s.meta["tokenizer.ggml.token_type"][1])],
                                              V.INT32), "byte tokens"),
    ("llama-with-q-bias", lambda s: tensor(s, "blk.0.attn_q.bias", np.zeros(D, np.float32)), "blk.0.attn_q.bias"),
    ("llama-rope_base-zero", lambda s: key(s, "{a}.rope.freq_base", V.FLOAT32, 0.0), "llama.rope.freq_base"),
]

WEIGHTS = [      # damaged values: found by the non-finite-logits check at run time
    ("nan-attn_q", scaled("blk.0.attn_q.weight", float("nan")), GEN, "non-finite logits"),
    ("inf-output_norm", scaled("output_norm.weight", float("inf")), GEN, "non-finite logits"),
    ("nan-output", scaled("output.weight", float("nan")), GEN, "non-finite logits"),
    ("nan-ffn_down-perplexity", scaled("blk.1.ffn_down.weight", float("nan")),
     lambda m, d: ["perplexity", "-m", m, "-f", text_file(d), "-c", "8"], "non-finite logits (NaN or Inf) in chunk 1"),
]


def chat_template(template):
    return lambda s: key(s, "tokenizer.chat_template", V.STRING, template)


TEMPLATES = [
    ("template-divide-by-zero", "{{ 1/0 }}", "ZeroDivisionError"),
    ("template-self-recursion", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("template-string-times-1e10", "{{ 'a'*10**10 }}", "10,000,000,000 characters"),
    ("template-list-times-1e9", "{{ [0]*10**9 }}", "a `*` result"),
    ("template-format-width", "{{ '{:>999999999}'.format('x') }}", "str.format"),
    ("template-nested-format-width", "{{ '{:>{w}}'.format('x', w=10**9) }}", "str.format"),
    ("template-printf-width", "{{ '%999999999d' % 1 }}", "a `%` result"),
    ("template-format-filter-width", "{{ '%0999999999d'|format(1) }}", "format's result"),
    ("template-power-10^10^6", "{{ 10**(10**6) }}", "bits"),
    ("template-huge-int-to-text", "{{ 10**5000 }}", "ValueError"),
    ("template-float-overflow", "{{ 10.0**1000 }}", "OverflowError"),
    ("template-nested-loops", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "longer than 2 s"),
    ("template-doubling-concat", "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
                                 "{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "a `~` result"),
    ("template-huge-output", "{% for i in range(100000) %}{{ 'x'*100 }}{% endfor %}", "the output would be"),
    ("template-macro-buffer", "{% set s = 'a'*4000000 %}{% macro m() %}{% for i in range(1000) %}{{ s }}"
                              "{% endfor %}{% endmacro %}{{ m() }}", "a block's output"),
    ("template-center", "{{ 'x'|center(10**9) }}", "center"),
    ("template-str-replace", "{% set s = 'a'*100000 %}{{ s.replace('a', s) }}", "str.replace"),
    ("template-join-separator", "{% set s = 'a'*100000 %}{{ s.join(range(10000)|map('string')) }}", "str.join"),
    ("template-raise-exception", "{{ raise_exception('only user and assistant roles') }}",
     "only user and assistant roles"),
    ("template-syntax-error", "{% for %}", "chat template failed"),
    ("template-undefined-call", "{{ nope() }}", "'nope' is undefined"),
    ("template-sandbox-escape", "{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    ("template-too-long", "x" * (1 << 20) + "y", "more than the 1,048,576 allowed"),
]


def text_file(d: Path, data: bytes = TEXT.encode()) -> Path:
    p = d / "text.txt"
    p.write_bytes(data)
    return p


def sparse_file(d: Path, size: int) -> Path:
    p = d / "big.txt"
    with open(p, "wb") as f:
        f.truncate(size)
    return p


CLI = [   # the undamaged model, bad arguments
    ("p-invalid-utf8-generate", ["generate", "-p", "ab\udcff", "-n", "2"], "-p is not valid UTF-8 (invalid start byte at byte 2)"),
    ("p-invalid-utf8-tokenize", ["tokenize", "-p", "\udcc3("], "-p is not valid UTF-8"),
    ("p-lone-surrogate", ["tokenize", "-p", "x\ud800"], "lone surrogate at character 1"),
    ("system-invalid-utf8", ["generate", "-p", "hi", "--chat", "--system", "\udce9t\udce9"], "--system is not valid UTF-8"),
    ("f-invalid-utf8-generate", lambda m, d: ["generate", "-m", m, "-f", text_file(d, b"ok \xff\xfe")], "at byte 3"),
    ("f-invalid-utf8-tokenize", lambda m, d: ["tokenize", "-m", m, "-f", text_file(d, b"\xc3")], "unexpected end of data at byte 0"),
    ("f-invalid-utf8-perplexity", lambda m, d: ["perplexity", "-m", m, "-f", text_file(d, b"a\x80b")], "at byte 1"),
    ("f-dev-zero", lambda m, d: ["generate", "-m", m, "-f", "/dev/zero"], "64 MiB limit"),
    ("f-larger-than-64MiB", lambda m, d: ["tokenize", "-m", m, "-f", sparse_file(d, (64 << 20) + 1)], "64 MiB limit"),
    ("f-missing", lambda m, d: ["generate", "-m", m, "-f", d / "nope.txt"], "No such file"),
    ("f-directory", lambda m, d: ["tokenize", "-m", m, "-f", d], "Is a directory"),
    ("f-empty", lambda m, d: ["generate", "-m", m, "-f", text_file(d, b"")], "empty prompt"),
    ("c-zero", ["generate", "-p", "hi", "-c", "0"], "context size must be between 1"),
    ("c-negative", ["generate", "-p", "hi", "-c", "-5"], "context size"),
    ("c-above-int32", ["generate", "-p", "hi", "-c", str(2**31)], "context size"),
    ("c-10^30", ["generate", "-p", "hi", "-c", str(10**30)], "context size"),
    ("c-beyond-memory", ["generate", "-p", "hi", "-c", str(2**31 - 1), "-q"], "lower -c"),
    ("c-not-a-number", ["generate", "-p", "hi", "-c", "lots"], "invalid int value"),
    ("n-negative", ["generate", "-p", "hi", "-n", "-1"], "-n must be >= 0"),
    ("prompt-longer-than-context", ["generate", "-p", "hello world hello", "-c", "2"], "longer than the context of 2"),
    ("backend-unknown", ["generate", "-p", "hi", "--backend", "tpu", "-q"], "argument --backend: invalid choice: 'tpu'"),
    ("tokenize-p-and-f", ["tokenize", "-p", "hi", "-f", "x"], "argument -f/--file: not allowed with argument -p/--prompt"),
    ("perplexity-c-3", lambda m, d: ["perplexity", "-m", m, "-f", text_file(d), "-c", "3"], "at least 4 tokens"),
    ("perplexity-text-too-short", lambda m, d: ["perplexity", "-m", m, "-f", text_file(d, b"hello"), "-c", "8"],
     "needs at least 16"),
    ("perplexity-c-10^6", lambda m, d: ["perplexity", "-m", m, "-f", text_file(d), "-c", str(10**6)], "needs at least"),
    ("m-missing", lambda m, d: ["generate", "-m", d / "nope.gguf", "-p", "hi"], "no such model file"),
    ("m-directory", lambda m, d: ["generate", "-m", d, "-p", "hi"], "not a regular file"),
    ("m-dev-null", lambda m, d: ["tokenize", "-m", "/dev/null", "-p", "hi"], "not a regular file"),
    ("m-empty-file", lambda m, d: ["tokenize", "-m", text_file(d, b""), "-p", "hi"], "bad magic"),
    ("m-prompt-file", lambda m, d: ["tokenize", "-m", text_file(d), "-p", "hi"], "bad magic"),
]

STDIN = [
    ("stdin-invalid-utf8-generate", ["generate", "-f", "-", "-n", "2"], b"hi \xe2\x82", "stdin is not valid UTF-8"),
    ("stdin-invalid-utf8-tokenize", ["tokenize", "-f", "-"], b"\xff", "stdin is not valid UTF-8 (invalid start byte at byte 0)"),
    ("stdin-empty", ["generate", "-f", "-", "-q"], b"", "empty prompt"),
]


def _model_cases():
    for name, mutate, fragment in HYPER + TENSORS + TOKENIZER:
        yield pytest.param("qwen2", mutate, GEN if "chat_template" not in name else CHAT, fragment, id=name)
    for name, mutate, fragment in LLAMA_TENSORS + LLAMA_TOKENIZER:
        yield pytest.param("llama", mutate, GEN, fragment, id=name)
    for name, mutate, cmd, fragment in WEIGHTS:
        yield pytest.param("qwen2", mutate, cmd, fragment, id=name)
    for name, template, fragment in TEMPLATES:
        yield pytest.param("qwen2", chat_template(template), CHAT, fragment, id=name)
    yield pytest.param("qwen2", lambda s: key(s, "tokenizer.chat_template", V.FLOAT32, 1.5), CHAT,
                       "tokenizer.chat_template must be a string", id="template-a-number")
    yield pytest.param("qwen2", lambda s: key(s, "tokenizer.chat_template", DROP), CHAT,
                       "no chat template", id="template-missing")


MODEL_CASES = list(_model_cases())
N_CASES = len(MODEL_CASES) + len(CLI) + len(STDIN)


def _argv(cmd, model: Path, d: Path) -> list:
    if callable(cmd):
        return cmd(model, d)
    return [cmd[0], "-m", model, *cmd[1:]]


@pytest.fixture(scope="module")
def good_models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("fuzz")
    return {arch: write(base_spec(arch), d / f"{arch}.gguf") for arch in ("qwen2", "llama")}


def test_the_undamaged_models_run(good_models, capsys, tmp_path):
    """The control: every command the cases use works on the undamaged models."""
    for arch, model in good_models.items():
        for cmd in (GEN, CHAT, ["tokenize", "-p", "hello"]):
            rc, out, err, _ = run(_argv(cmd, model, tmp_path), capsys)
            assert rc == 0 and out, (arch, cmd, err)
        rc, out, err, _ = run(["perplexity", "-m", model, "-f", text_file(tmp_path), "-c", "8"], capsys)
        assert rc == 0 and "Final estimate: PPL" in out, err
    rc, out, err, _ = run(["generate", "-m", good_models["qwen2"], "-p", "\u00e9t\u00e9 \U0001f600", "-n", "2", "-q"], capsys)
    assert rc == 0, err                                  # valid non-ASCII text passes the UTF-8 rule


def test_llama_rope_freqs_are_applied(tmp_path):
    """A llama GGUF with rope_freqs.weight (Llama 3.1's RoPE scaling) loads and runs;
    factors of 1 give the logits of the model without the tensor, others change them."""
    from minfer.engine import Engine

    def logits(factors):
        spec = base_spec("llama")
        if factors is not None:
            rope_freqs(factors)(spec)
        path = write(spec, tmp_path / f"rf{len(list(tmp_path.iterdir()))}.gguf")
        eng = Engine.load(str(path), backend="cpu", n_ctx=64, progress=False)
        toks = np.array([1, 260, 261, 262, 263, 264, 265, 266], np.int32)
        return eng.model.forward(toks, 0, eng.new_cache(64), logits_from=0)

    plain = logits(None)
    np.testing.assert_array_equal(logits([1.0, 1.0, 1.0, 1.0]), plain)
    assert np.abs(logits([1.0, 2.0, 4.0, 8.0]) - plain).max() > 1e-4


def test_at_least_100_distinct_bad_inputs():
    assert N_CASES >= 100, N_CASES


@pytest.mark.parametrize("arch, mutate, cmd, fragment", MODEL_CASES)
def test_damaged_model(arch, mutate, cmd, fragment, capsys, tmp_path):
    spec = base_spec(arch)
    mutate(spec)
    model = write(spec, tmp_path / "damaged.gguf")
    rc, out, err, dt = run(_argv(cmd, model, tmp_path), capsys)
    assert_one_line_error(rc, err, dt, fragment)
    assert out == ""                       # caught before any token is printed


@pytest.mark.parametrize("cmd, fragment", [pytest.param(c, f, id=i) for i, c, f in CLI])
def test_bad_command_line(cmd, fragment, good_models, capsys, tmp_path):
    rc, out, err, dt = run(_argv(cmd, good_models["qwen2"], tmp_path), capsys)
    assert_one_line_error(rc, err, dt, fragment)
    assert out == ""


@pytest.mark.parametrize("cmd, data, fragment", [pytest.param(c, b, f, id=i) for i, c, b, f in STDIN])
def test_bad_stdin(cmd, data, fragment, good_models, capsys, tmp_path, monkeypatch):
    rc, out, err, dt = run(_argv(cmd, good_models["qwen2"], tmp_path), capsys, data, monkeypatch)
    assert_one_line_error(rc, err, dt, fragment)


def test_stdin_is_read_with_f_dash(good_models, capsys, tmp_path, monkeypatch):
    rc, out, _, _ = run(["tokenize", "-m", good_models["qwen2"], "-f", "-"], capsys, b"hello", monkeypatch)
    rc2, out2, _, _ = run(["tokenize", "-m", good_models["qwen2"], "-p", "hello"], capsys)
    assert rc == rc2 == 0 and out == out2 and len(out) > 3


def test_a_synthetic_q4k_model_with_a_nan_scale(tmp_path, capsys, good_models):
    """A NaN in a quantized weight (a q4_K block's f16 scale) of a model written by
    minfer.tools.synth: generation stops with one line instead of emitting token 0 for ever."""
    from minfer.format.gguf import open_gguf
    from minfer.tools.synth import write_synthetic

    path = write_synthetic(tmp_path / "synth.gguf", n_layer=1, d_model=256, n_head=2, n_head_kv=1,
                           d_ff=256, tokenizer_from=good_models["qwen2"])
    rc, out, err, _ = run(["generate", "-m", path, "-p", "hello", "-n", "2", "-q"], capsys)
    assert rc == 0, err
    with open_gguf(path) as gf:
        t = gf.tensors["blk.0.attn_q.weight"]
        assert t.qtype == Q.Q4_K
        offset = t.offset                                  # block 0 of row 0: d (f16) first
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.array([np.nan], np.float16).tobytes())
    rc, out, err, dt = run(["generate", "-m", path, "-p", "hello", "-n", "2", "-q"], capsys)
    assert_one_line_error(rc, err, dt, "non-finite logits (NaN or Inf) at position")
    assert out == ""


# --- real processes --------------------------------------------------------------------

def test_closed_stdout_ends_quietly(good_models):
    """`minfer generate ... | head -c 5`: status 141 (as a tool killed by SIGPIPE), nothing
    on stderr: no "Broken pipe" error, no traceback, no "Exception ignored" at exit."""
    cmd = (f"{sys.executable} -m minfer generate -m {good_models['qwen2']} -p 'hello world' -n 2000 "
           f"-c 2048 --ignore-eos -q | head -c 5; echo \" ${{PIPESTATUS[0]}}\"")
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert r.stderr == "", r.stderr
    text, status = r.stdout.rsplit(" ", 1)
    assert len(text.encode()) == 5 and status.strip() == "141", r.stdout


def test_invalid_utf8_bytes_in_argv(good_models):
    """The bytes a shell passes, not a str built in Python: -p b"ab\\xff" is one line naming
    the byte offset."""
    r = subprocess.run([sys.executable, "-m", "minfer", "tokenize", "-m", str(good_models["qwen2"]),
                        "-p", b"ab\xff"], capture_output=True, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 2 and r.stdout == b"" and "Traceback" not in err, err
    assert err.splitlines() == ["minfer: error: -p is not valid UTF-8 (invalid start byte at byte 2)"]


TRUNCATE_SCRIPT = """
import os, sys
from minfer.engine import Engine
from minfer.generate import generate
from minfer.format.gguf import GGUFError
path = sys.argv[1]
engine = Engine.load(path, progress=False, n_ctx=64)
os.truncate(path, 0)                      # the file shrinks under the run
try:
    engine.gf.raw("token_embd.weight")
    sys.exit("the mapping is still open after load")
except GGUFError:
    pass
ids = engine.tokenizer.encode("hello world")
print(len(list(generate(engine, ids, 20, ignore_eos=True))))
"""


def test_a_model_file_truncated_under_a_run_does_not_crash_it(good_models, tmp_path):
    """Nothing reads the mapped file after load (the CPU backend copies the embedding;
    the engine closes the mapping), so truncating the file cannot end the run with SIGBUS."""
    path = tmp_path / "model.gguf"
    path.write_bytes(good_models["qwen2"].read_bytes())
    r = subprocess.run([sys.executable, "-c", TRUNCATE_SCRIPT, str(path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert r.stdout.strip() == "20" and path.stat().st_size == 0
