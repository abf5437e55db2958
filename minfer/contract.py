"""The model contract: what a GGUF file must hold before anything is allocated for it.

The header walk (minfer/format/gguf.py) bounds every length by the file's size; this
module bounds the values by what the model needs, in three checks, each failure
one MinferError line naming the key or tensor:

  hyperparameters(gf, arch)  every config key type- and range-checked; head geometry
                             (ModelConfig.from_gguf calls it)
  check_tensors(gf, cfg)     every tensor's shape and type against expected_tensors(cfg)
  check_tokenizer(gf, cfg)   the tokenizer arrays' types and lengths, BYTE tokens,
                             special token ids, flags and the chat template's type;
                             one token per embedding row
  check_vocabulary(gf)       the same without a model: all that tokenizing needs
                             (minfer.text.tokenizer.open_tokenizer; llama.cpp's
                             vocabulary-only GGUFs have no tensors and need not
                             have a config this graph can run)

ModelFile.open (minfer/engine.py) runs the first three before the tokenizer is
built and before any backend exists. Weight values are not scanned (a NaN costs a
full pass over 1+ GB); non-finite logits stop generation and perplexity instead.
"""
from __future__ import annotations

import math
import re

from gguf import Keys, TokenType

from .format import quants
from .errors import MinferError

# Counts and dimensions index int32 on the device; anything larger is a lying header.
MAX_COUNT = 2**31 - 1
# Tensors every layer must have (the q/k/v biases come on top for qwen2).
_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                  "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
_TOKEN_TYPES = frozenset(int(t) for t in TokenType) | {0}     # 0: llama.cpp's UNDEFINED
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_SPECIAL_IDS = tuple(v for k, v in vars(Keys.Tokenizer).items()
                     if isinstance(v, str) and v.endswith("_token_id"))
_FLAGS = (Keys.Tokenizer.ADD_BOS, Keys.Tokenizer.ADD_EOS, Keys.Tokenizer.ADD_PREFIX)
_REQUIRED = object()


def show_value(v) -> str:
    """A value for an error message: its repr, cut short (arrays can be huge)."""
    if isinstance(v, list):
        return f"an array of {len(v)}"
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _is_int(v) -> bool:
    return type(v) is int            # bool is an int subclass, and not a count


# --- hyperparameters ------------------------------------------------------------

def _int_key(gf, key: str, default=_REQUIRED, lo: int = 1, hi: int = MAX_COUNT) -> int:
    v = gf.get(key, default)
    if v is _REQUIRED:
        raise MinferError(f"{gf.path}: missing metadata key {key}")
    if not _is_int(v):
        raise MinferError(f"{gf.path}: {key} must be an integer, got {show_value(v)}")
    if not lo <= v <= hi:
        raise MinferError(f"{gf.path}: {key} = {v} is out of range ({lo}..{hi})")
    return v


def _positive_float_key(gf, key: str, default: float) -> float:
    v = gf.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise MinferError(f"{gf.path}: {key} must be a number, got {show_value(v)}")
    if not (math.isfinite(v) and v > 0):
        raise MinferError(f"{gf.path}: {key} = {v} must be finite and positive")
    return float(v)


def hyperparameters(gf, arch: str) -> dict:
    """The ModelConfig fields read from metadata, each checked -> dict.

    vocab_size is the embedding table's row count when the file has one (the
    ground truth; check_tokenizer ties the vocabulary to it), else the
    `{arch}.vocab_size` key, else the token list's length."""
    def k(fmt: str) -> str:
        return fmt.format(arch=arch)

    v = {
        "n_layer": _int_key(gf, k(Keys.LLM.BLOCK_COUNT)),
        "d_model": _int_key(gf, k(Keys.LLM.EMBEDDING_LENGTH)),
        "n_head": _int_key(gf, k(Keys.Attention.HEAD_COUNT)),
        "d_ff": _int_key(gf, k(Keys.LLM.FEED_FORWARD_LENGTH)),
        "n_ctx_train": _int_key(gf, k(Keys.LLM.CONTEXT_LENGTH), default=2048),
        "rope_base": _positive_float_key(gf, k(Keys.Rope.FREQ_BASE), 10000.0),
        "rms_eps": _positive_float_key(gf, k(Keys.Attention.LAYERNORM_RMS_EPS), 1e-5),
    }
    v["n_head_kv"] = _int_key(gf, k(Keys.Attention.HEAD_COUNT_KV), default=v["n_head"])
    d, nh, nkv = v["d_model"], v["n_head"], v["n_head_kv"]
    if d % nh or nh % nkv or (d // nh) % 2:
        raise MinferError(f"{gf.path}: inconsistent head geometry (d_model {d}, heads {nh}/{nkv}): "
                          f"head_count must divide embedding_length, head_count_kv must divide "
                          f"head_count, and the head size must be even")
    hd = d // nh
    # keys that would make the model compute something this graph does not
    for key in (k(Keys.Rope.DIMENSION_COUNT), k(Keys.Attention.KEY_LENGTH), k(Keys.Attention.VALUE_LENGTH)):
        if key in gf.metadata and _int_key(gf, key) != hd:
            raise MinferError(f"{gf.path}: {key} = {gf.get(key)} differs from the head size {hd} "
                              f"(d_model / head_count); not supported")
    scaling = gf.get(k(Keys.Rope.SCALING_TYPE), "none")
    if scaling != "none":
        raise MinferError(f"{gf.path}: {k(Keys.Rope.SCALING_TYPE)} = {show_value(scaling)} is not supported")

    tokens = gf.get(Keys.Tokenizer.LIST)
    embd = gf.tensors.get("token_embd.weight")
    if embd is not None:
        v["vocab_size"] = int(embd.shape[0])
        key = k(Keys.LLM.VOCAB_SIZE)
        if key in gf.metadata and _int_key(gf, key) != v["vocab_size"]:
            raise MinferError(f"{gf.path}: {key} = {gf.get(key)}, the embedding table "
                              f"token_embd.weight has {v['vocab_size']} rows")
    else:
        v["vocab_size"] = _int_key(gf, k(Keys.LLM.VOCAB_SIZE),
                                   default=len(tokens) if isinstance(tokens, list) and tokens else _REQUIRED)
    return v


# --- tensors ----------------------------------------------------------------------

ROPE_FREQS = "rope_freqs.weight"


def expected_tensors(cfg) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Every tensor the graph reads: GGUF name -> (numpy shape, required).

    Numpy order, as minfer.format.gguf.TensorInfo.shape: a linear weight is (n_out, n_in).
    `output.weight` is optional (absent: the LM head is token_embd, tied); so is a
    llama model's `rope_freqs.weight` (RoPE frequency factors, minfer/rope.py)."""
    d, V, ff = cfg.d_model, cfg.vocab_size, cfg.d_ff
    q, kv = cfg.n_head * cfg.head_dim, cfg.kv_dim
    t = {"token_embd.weight": ((V, d), True),
         "output_norm.weight": ((d,), True),
         "output.weight": ((V, d), False)}
    if cfg.arch == "llama":
        t[ROPE_FREQS] = ((cfg.head_dim // 2,), False)
    layer = {"attn_norm.weight": (d,), "attn_q.weight": (q, d), "attn_k.weight": (kv, d),
             "attn_v.weight": (kv, d), "attn_output.weight": (d, q), "ffn_norm.weight": (d,),
             "ffn_gate.weight": (ff, d), "ffn_up.weight": (ff, d), "ffn_down.weight": (d, ff)}
    if cfg.qkv_bias:
        layer |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    for i in range(cfg.n_layer):
        t |= {f"blk.{i}.{name}": (shape, True) for name, shape in layer.items()}
    return t


def check_tensors(gf, cfg) -> None:
    """Each tensor the graph needs is present, has its shape and a supported type;
    no tensor is left over (the graph would ignore it and compute another model)."""
    per_layer = len(_LAYER_TENSORS) + (3 if cfg.qkv_bias else 0)
    if cfg.n_layer * per_layer > len(gf.tensors):      # before building the table
        raise MinferError(f"{gf.path}: {cfg.arch}.block_count = {cfg.n_layer} needs "
                          f"{cfg.n_layer * per_layer} layer tensors, the file has "
                          f"{len(gf.tensors)} tensors")
    want = expected_tensors(cfg)
    for name, (shape, required) in want.items():
        t = gf.tensors.get(name)
        if t is None:
            if required:
                raise MinferError(f"{gf.path}: tensor {name} is missing")
            continue
        if tuple(t.shape) != shape:
            raise MinferError(f"{gf.path}: tensor {name} has shape {tuple(t.shape)}, "
                              f"the config says {shape}")
        if t.qtype not in quants.SUPPORTED:
            raise MinferError(f"{gf.path}: tensor {name} has type {t.qtype.name}, not supported "
                              f"(supported: {', '.join(sorted(q.name for q in quants.SUPPORTED))})")
    extra = [n for n in gf.tensors if n not in want]
    if extra:
        raise MinferError(f"{gf.path}: tensor {extra[0]} is not part of a {cfg.arch} model of "
                          f"{cfg.n_layer} layers ({len(extra)} such tensors)")


# --- tokenizer ----------------------------------------------------------------------

def _array(gf, key: str, item_ok, what: str, n: int | None = None) -> list | None:
    """The array at key (None if absent), every item checked by item_ok, length n if given."""
    a = gf.get(key)
    if a is None:
        return None
    if not isinstance(a, list):
        raise MinferError(f"{gf.path}: {key} must be an array, got {show_value(a)}")
    bad = next((i for i, x in enumerate(a) if not item_ok(x)), None)
    if bad is not None:
        raise MinferError(f"{gf.path}: {key}[{bad}] = {show_value(a[bad])} is not {what}")
    if n is not None and len(a) != n:
        raise MinferError(f"{gf.path}: {key} has {len(a)} entries for {n} tokens")
    return a


def check_tokenizer(gf, cfg) -> None:
    """The vocabulary is one token list of the embedding's size, the parallel arrays
    match it in type and length, BYTE tokens read <0xXX>, special ids are in range."""
    _check_vocabulary(gf, cfg.vocab_size)


def check_vocabulary(gf) -> int:
    """check_tokenizer without a model: the token list's own length is the vocabulary
    size -> that size."""
    return _check_vocabulary(gf, None)


def _check_vocabulary(gf, n_rows: int | None) -> int:
    """n_rows: the embedding table's rows, which the token list must match (None: no model)."""
    K = Keys.Tokenizer
    for key in (K.MODEL, K.PRE, K.CHAT_TEMPLATE):
        v = gf.get(key)
        if v is not None and not isinstance(v, str):
            raise MinferError(f"{gf.path}: {key} must be a string, got {show_value(v)}")
    tokens = _array(gf, K.LIST, lambda x: type(x) is str, "a string")
    if not tokens:
        raise MinferError(f"{gf.path}: {K.LIST} missing or empty")
    n = len(tokens)
    if n_rows is not None and n != n_rows:
        raise MinferError(f"{gf.path}: {K.LIST} has {n} tokens, the embedding table "
                          f"token_embd.weight has {n_rows} rows")
    types = _array(gf, K.TOKEN_TYPE, lambda x: _is_int(x) and x in _TOKEN_TYPES,
                   f"a token type ({min(_TOKEN_TYPES)}..{max(_TOKEN_TYPES)})", n)
    _array(gf, K.SCORES, lambda x: type(x) in (int, float) and math.isfinite(x), "a finite number", n)
    _array(gf, K.MERGES, lambda x: type(x) is str, "a string")
    if types is not None:
        bad = next((i for i, t in enumerate(types)
                    if t == TokenType.BYTE and not _BYTE_TOKEN.fullmatch(tokens[i])), None)
        if bad is not None:
            raise MinferError(f"{gf.path}: token {bad} is a BYTE token but reads "
                              f"{show_value(tokens[bad])}, not <0xXX>")
    for key in _SPECIAL_IDS:
        if key in gf.metadata:
            _int_key(gf, key, lo=0, hi=n - 1)
    for key in _FLAGS:
        v = gf.get(key)
        if v is not None and type(v) is not bool:
            raise MinferError(f"{gf.path}: {key} must be true or false, got {show_value(v)}")
    return n


def check_model(gf, cfg) -> None:
    """Everything after the header that the config alone does not check."""
    check_tensors(gf, cfg)
    check_tokenizer(gf, cfg)
