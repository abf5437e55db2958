"""Tokenizer built from GGUF metadata, reproducing llama.cpp's `llama_tokenize`.

Two vocabulary kinds (`tokenizer.ggml.model`):

  gpt2   byte-level BPE. The merges run in the `tokenizers` library; the
         pre-tokenizer is the regex list llama.cpp uses for `tokenizer.ggml.pre`
         (minfer/text/pretokenizers.py), which may also set the BOS default and
         ignore_merges.
  llama  SentencePiece-style BPE over scores, with <0xXX> byte fallback. The
         merges run in `sentencepiece` on a model proto built from the vocabulary.

What llama.cpp does around the merges is done here, in Python, the same way:
  1. special-token partition (`tokenizer_st_partition`): CONTROL, USER_DEFINED
     and UNKNOWN tokens, longest text first, are cut out of the text; with
     parse_special=False the CONTROL/UNKNOWN ones are skipped (treated as plain
     text) but USER_DEFINED ones are still cut out, as in llama.cpp;
  2. BOS per `tokenizer.ggml.add_bos_token` (overridable per call);
  3. for `llama`, a space is prefixed to every text fragment that starts the
     text or follows a special token (`add_space_prefix`), and ' ' becomes '▁';
  4. the end-of-generation set and the auto-detected EOT/FIM ids (by token text,
     as llama.cpp's `llama_vocab::impl::load` does).

Decoding works on bytes (`token_bytes`, llama.cpp's `token_to_piece`); text is
UTF-8-decoded only at the end, or incrementally by `StreamDecoder`, which holds
back an incomplete multibyte sequence until its last byte arrives.
"""
from __future__ import annotations

import codecs
from pathlib import Path
from typing import Iterable

from gguf import Keys, TokenType

from ..errors import MinferError
from .pretokenizers import PRE_TOKENIZERS, PreTokenizer

K = Keys.Tokenizer

# Token texts llama.cpp treats as end-of-turn / end-of-generation / FIM markers
# (llama_vocab::impl::load, "auto-detect special tokens by text"). Order matters
# only for the EOT/FIM id when several texts are present: llama.cpp walks a hash
# map (unspecified order); we take the first text of the list that exists.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
              "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
))

_SPM_SPACE = "\u2581"  # '▁', SentencePiece's escaped space


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves,
    the other bytes are shifted to U+0100.. so every byte is one visible char."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


# byte-level char -> the byte it stands for, as a str.translate table to Latin-1
_BYTE_DECODE = {ord(c): chr(b) for b, c in _byte_to_unicode().items()}


class Tokenizer:
    """Text <-> token ids exactly as llama.cpp does it for the same GGUF file."""

    def __init__(self, meta: dict, path: str = "?"):
        self.path = path
        self.model = meta.get(K.MODEL)
        if self.model is None:
            raise MinferError(f"{path}: no tokenizer in the GGUF metadata ({K.MODEL} missing)")
        if self.model not in ("gpt2", "llama"):
            raise MinferError(f"{path}: unsupported tokenizer model {self.model!r} "
                              "(supported: gpt2, llama)")
        tokens = meta.get(K.LIST)
        if not tokens:
            raise MinferError(f"{path}: {K.LIST} missing or empty")
        n = len(tokens)
        # llama.cpp renames empty tokens so that every id has a distinct text
        self.tokens: list[str] = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types = meta.get(K.TOKEN_TYPE)
        if types is None:
            types = [TokenType.NORMAL] * n
        if len(types) < n:
            raise MinferError(f"{path}: {K.TOKEN_TYPE} has {len(types)} entries for {n} tokens")
        self.token_type: list[int] = [int(t) for t in types[:n]]
        self.token_to_id: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            if self.token_to_id.setdefault(t, i) != i:
                raise MinferError(f"{path}: duplicate token {t!r} (ids {self.token_to_id[t]} and {i})")

        spm = self.model == "llama"
        self.pre: PreTokenizer | None = None if spm else _pre_tokenizer(meta, path)
        self.add_space_prefix = bool(meta.get(K.ADD_PREFIX, spm))
        # llama.cpp's defaults when the key is absent: SPM adds BOS, BPE as its
        # pre-tokenizer type says (LLAMA3 does, most do not)
        self.add_bos = bool(meta.get(K.ADD_BOS, spm or self.pre.add_bos))
        self.add_eos = bool(meta.get(K.ADD_EOS, False))

        # SPM ids default to llama's <unk>=0, <s>=1, </s>=2 like llama.cpp
        self.bos_id = self._special_id(meta, K.BOS_ID, 1 if spm else None)
        self.eos_id = self._special_id(meta, K.EOS_ID, 2 if spm else None)
        self.unk_id = self._special_id(meta, K.UNK_ID, 0 if spm else None)
        self.pad_id = self._special_id(meta, K.PAD_ID)
        self.eot_id = self._special_id(meta, K.EOT_ID)
        self.eom_id = self._special_id(meta, K.EOM_ID)
        if self.add_bos and self.bos_id is None:
            raise MinferError(f"{path}: {K.ADD_BOS} is true but {K.BOS_ID} is not set")
        self.chat_template: str | None = meta.get(K.CHAT_TEMPLATE)
        self._detect_special(meta)

        # Special-token partition order: longest text first (llama.cpp sorts by
        # length only; ties keep id order here).
        special_types = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
        self._specials = sorted(
            ((self.tokens[i], i, self.token_type[i] != TokenType.USER_DEFINED)
             for i in range(n) if self.token_type[i] in special_types),
            key=lambda s: -len(s[0].encode("utf-8")))

        self._pieces: list[bytes] = [self._piece(i) for i in range(n)]
        if spm:
            self._spm = _build_sentencepiece(self, meta, path)
        else:
            self._bpe = _build_bpe(self, meta, path)

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, meta: dict, path: str = "?") -> "Tokenizer":
        return cls(meta, path)

    @classmethod
    def from_gguf(cls, gf) -> "Tokenizer":
        """gf: a minfer.format.gguf.GGUFFile (anything with .metadata and .path)."""
        return cls(gf.metadata, path=str(gf.path))

    def _special_id(self, meta: dict, key: str, default: int | None = None) -> int | None:
        """A token id from the metadata, range-checked; default when the key is absent."""
        v = meta.get(key, default)
        if v is None:
            return None
        if not 0 <= int(v) < len(self.tokens):
            raise MinferError(f"{self.path}: {key} = {v} is outside the vocabulary "
                              f"(size {len(self.tokens)})")
        return int(v)

    def _detect_special(self, meta: dict) -> None:
        """EOT/EOM/FIM ids by token text, and the end-of-generation set (llama.cpp's rules).

        A token found this way is forced to CONTROL, as llama.cpp does, which
        matters for parse_special=False (CONTROL texts are then plain text)."""
        def first_present(key: str, texts: Iterable[str]) -> int | None:
            v = self._special_id(meta, key)
            if v is not None:
                return v
            for t in texts:
                i = self.token_to_id.get(t)
                if i is not None:
                    self._force_control(i)
                    return i
            return None

        if self.eot_id is None:
            self.eot_id = first_present(K.EOT_ID, _EOT_TEXTS)
        if self.eom_id is None:
            self.eom_id = first_present(K.EOM_ID, _EOM_TEXTS)
        fim_pad = first_present(K.FIM_PAD_ID, _FIM_PAD_TEXTS)
        fim_rep = first_present(K.FIM_REP_ID, _FIM_REP_TEXTS)
        fim_sep = first_present(K.FIM_SEP_ID, _FIM_SEP_TEXTS)

        eog = {i for i in (fim_pad, fim_rep, fim_sep) if i is not None}
        for t in _EOG_TEXTS:
            i = self.token_to_id.get(t)
            if i is not None:
                eog.add(i)
                self._force_control(i)
        eog |= {i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None}
        self.eog_ids: frozenset[int] = frozenset(eog)

    def _force_control(self, i: int) -> None:
        if self.token_type[i] not in (TokenType.CONTROL, TokenType.UNKNOWN):
            self.token_type[i] = TokenType.CONTROL

    def _piece(self, i: int) -> bytes:
        """The bytes token i stands for (llama.cpp's token_to_piece with special=True)."""
        text, tt = self.tokens[i], self.token_type[i]
        if tt in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED):
            return text.encode("utf-8")
        if tt == TokenType.BYTE:  # <0xXX>
            return bytes([int(text[3:5], 16)])
        if tt != TokenType.NORMAL:  # UNUSED / undefined: llama.cpp renders nothing
            return b""
        if self.model == "llama":
            return text.replace(_SPM_SPACE, " ").encode("utf-8")
        try:
            return text.translate(_BYTE_DECODE).encode("latin-1")
        except UnicodeEncodeError:
            # a char outside the byte-level alphabet: llama.cpp writes an
            # [UNK_BYTE_0x..] marker; we keep the char's own UTF-8 and say so here
            return "".join(_BYTE_DECODE.get(ord(c), c) for c in text).encode("utf-8")

    # ---- encode -------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut special tokens out of text: a list of plain-text pieces and token ids."""
        frags: list[str | int] = [text]
        for sp_text, sp_id, is_control in self._specials:
            if is_control and not parse_special:
                continue
            if sp_text not in text:  # fragments are substrings of text
                continue
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or sp_text not in f:
                    out.append(f)
                    continue
                parts = f.split(sp_text)
                for k, p in enumerate(parts):
                    if k:
                        out.append(sp_id)
                    if p:
                        out.append(p)
            frags = out
        return frags

    def encode(self, text: str, parse_special: bool = True, add_bos: bool | None = None) -> list[int]:
        """text -> token ids. add_bos None: the model's flag (tokenizer.ggml.add_bos_token)."""
        # add_bos=False means no special tokens added at all (llama.cpp's add_special=false)
        add_eos = self.add_eos and add_bos is not False
        if add_bos is None:
            add_bos = self.add_bos
        if add_bos and self.bos_id is None:
            raise MinferError(f"{self.path}: BOS requested but the model has no BOS token")
        ids: list[int] = [self.bos_id] if add_bos else []
        frags = self._partition(text, parse_special) if text else []
        if self.model == "gpt2":
            for f in frags:
                if isinstance(f, int):
                    ids.append(f)
                else:
                    ids.extend(self._bpe.encode(f, add_special_tokens=False).ids)
        else:
            prev_special = True  # the first fragment gets the space prefix too
            for f in frags:
                if isinstance(f, int):
                    ids.append(f)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    f = " " + f
                ids.extend(self._spm.encode(f, out_type=int))
                prev_special = False
        if add_eos:
            if self.eos_id is None:
                raise MinferError(f"{self.path}: {K.ADD_EOS} is true but {K.EOS_ID} is not set")
            ids.append(self.eos_id)
        return ids

    # ---- decode -------------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (special tokens as their text)."""
        if not 0 <= token_id < len(self._pieces):
            raise MinferError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return self._pieces[token_id]

    def _render(self, token_id: int, special: bool, first: bool) -> bytes:
        """One token's bytes inside a sequence (llama.cpp's llama_detokenize)."""
        b = self.token_bytes(token_id)
        if not special and self.token_type[token_id] in (TokenType.CONTROL, TokenType.UNKNOWN):
            return b""
        if first and self.add_space_prefix and b.startswith(b" "):
            b = b[1:]  # the prefix space encode() added before the first fragment
        return b

    def _ids_bytes(self, ids: Iterable[int], special: bool) -> bytes:
        return b"".join(self._render(int(i), special, k == 0) for k, i in enumerate(ids))

    def decode(self, ids: Iterable[int], special: bool = True) -> str:
        """ids -> text. special=False drops CONTROL tokens (BOS, <|im_end|>, ...).
        Invalid UTF-8 (e.g. a cut-off multibyte character) becomes U+FFFD."""
        return self._ids_bytes(ids, special).decode("utf-8", errors="replace")

    def stream_decoder(self, special: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, special)


def open_tokenizer(path) -> Tokenizer:
    """The tokenizer of a GGUF file, checked by the tokenizer part of the model
    contract alone (contract.check_vocabulary): what `minfer tokenize` needs.

    Only the header is read, so this also takes vocabulary-only files (llama.cpp's
    ggml-vocab-*.gguf: metadata, no tensors, a config this graph may not run) and
    a header cut where tensor data starts (models/*.header.gguf). A model to run
    goes through engine.ModelFile.open, which checks the whole contract."""
    from ..contract import check_vocabulary
    from ..format.gguf import open_gguf

    path = Path(path)
    if not path.exists():
        raise MinferError(f"{path}: no such model file")
    if not path.is_file():
        raise MinferError(f"{path}: not a regular file")
    with open_gguf(str(path), header_only=True) as gf:
        check_vocabulary(gf)
        return Tokenizer.from_gguf(gf)


class StreamDecoder:
    """Incremental detokenizer: push(id) returns only complete UTF-8 text.

    A multibyte character split across tokens (common for CJK and emoji in
    byte-level BPE) is held back until its last byte arrives; flush() returns
    what is left (a truncated sequence becomes U+FFFD). The concatenation of all
    push() results and flush() equals tok.decode(ids, special)."""

    def __init__(self, tok: Tokenizer, special: bool = True):
        self._tok = tok
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True

    def push(self, token_id: int) -> str:
        b = self._tok._render(int(token_id), self._special, self._first)
        self._first = False
        return self._utf8.decode(b, final=False)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


# ---- backends ---------------------------------------------------------------------------------

def _pre_tokenizer(meta: dict, path: str) -> PreTokenizer:
    """The pre-tokenizer of a gpt2 vocabulary; llama.cpp reads a missing key as
    'default', a type minfer does not implement, so that is an error too."""
    pre = meta.get(K.PRE, "default")
    if pre not in PRE_TOKENIZERS:
        raise MinferError(f"{path}: unsupported pre-tokenizer {K.PRE} = {pre!r} "
                          f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    return PRE_TOKENIZERS[pre]


def _build_bpe(tok: Tokenizer, meta: dict, path: str):
    """A `tokenizers` BPE over the GGUF vocabulary and merges, with llama.cpp's
    pre-tokenizer regexes and GPT-2 byte-level mapping. Specials are handled by
    Tokenizer._partition, so this tokenizer has no added tokens."""
    from tokenizers import Regex, Tokenizer as HFTokenizer, models, pre_tokenizers

    merges_raw = meta.get(K.MERGES)
    if not merges_raw:
        raise MinferError(f"{path}: gpt2 vocabulary without {K.MERGES}")
    merges = []
    for m in merges_raw:
        # llama.cpp splits at the first space after position 0
        k = m.find(" ", 1)
        if k < 0:
            raise MinferError(f"{path}: malformed merge {m!r} in {K.MERGES}")
        merges.append((m[:k], m[k + 1:]))
    try:
        bpe = models.BPE(vocab=tok.token_to_id, merges=merges, fuse_unk=False, byte_fallback=False,
                         ignore_merges=tok.pre.ignore_merges)
    except Exception as e:  # tokenizers raises on merges naming unknown tokens
        raise MinferError(f"{path}: bad BPE vocabulary/merges: {e}") from None
    hf = HFTokenizer(bpe)
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated", invert=False)
              for rx in tok.pre.regexes]
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return hf


def _build_sentencepiece(tok: Tokenizer, meta: dict, path: str):
    """A sentencepiece BPE processor over the GGUF vocabulary (scores = merge priority).

    Normalization is identity and no dummy prefix: the space prefix is added by
    Tokenizer.encode per fragment, as llama.cpp does; ' ' -> '▁' is sentencepiece's
    escape_whitespaces."""
    import sentencepiece as spm

    scores = meta.get(K.SCORES)
    if scores is None:
        raise MinferError(f"{path}: llama vocabulary without {K.SCORES}")
    if tok.unk_id is None or tok.token_type[tok.unk_id] != TokenType.UNKNOWN:
        raise MinferError(f"{path}: llama vocabulary needs an UNKNOWN-type token at {K.UNK_ID}")
    n_bytes = sum(1 for t in tok.token_type if t == TokenType.BYTE)
    if n_bytes not in (0, 256):
        raise MinferError(f"{path}: llama vocabulary has {n_bytes} byte tokens (expected 0 or 256)")
    # piece types: sentencepiece's enum equals GGUF's TokenType numbering
    # (NORMAL=1, UNKNOWN=2, CONTROL=3, USER_DEFINED=4, UNUSED=5, BYTE=6)
    pieces = b"".join(
        _pb_bytes(1, _pb_bytes(1, t.encode("utf-8")) + _pb_float(2, float(s)) + _pb_varint(3, int(tt)))
        for t, s, tt in zip(tok.tokens, scores, tok.token_type))
    trainer = (_pb_varint(3, 2)  # model_type = BPE
               + _pb_varint(35, int(n_bytes == 256))  # byte_fallback
               + _pb_varint(40, tok.unk_id) + _pb_varint(41, -1)  # unk_id, bos_id (-1: we add BOS)
               + _pb_varint(42, -1) + _pb_varint(43, -1))  # eos_id, pad_id
    normalizer = (_pb_bytes(1, b"identity") + _pb_varint(3, 0)  # name, add_dummy_prefix
                  + _pb_varint(4, 0) + _pb_varint(5, 1))  # remove_extra_whitespaces, escape_whitespaces
    proto = pieces + _pb_bytes(2, trainer) + _pb_bytes(3, normalizer)
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(proto)
    except Exception as e:  # sentencepiece validates the model (unk, byte pieces, ...)
        raise MinferError(f"{path}: sentencepiece rejected the vocabulary: {e}") from None
    return sp


# Minimal protobuf wire encoding for sentencepiece's ModelProto (field numbers
# from sentencepiece_model.proto), so that no protobuf runtime is needed.
def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1  # negative int32 -> 10-byte two's complement, as protobuf does
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _pb_varint(field: int, v: int) -> bytes:
    return _varint(field << 3 | 0) + _varint(v)


def _pb_float(field: int, v: float) -> bytes:
    import struct
    return _varint(field << 3 | 5) + struct.pack("<f", v)


def _pb_bytes(field: int, b: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(b)) + b
