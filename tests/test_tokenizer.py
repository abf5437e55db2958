"""Tokenizer vs llama.cpp's llama-tokenize (tests/fixtures/tokenizer_*.json), plus a tiny
hand-built SentencePiece vocabulary for the `llama` path."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from gguf import Keys, TokenType

from minfer.errors import MinferError
from minfer.gguf import open_gguf
from minfer.tokenizer import Tokenizer

K = Keys.Tokenizer
# the parametrizations need the fixture files at collection time, before any fixture
FIXTURES = Path(__file__).resolve().parent / "fixtures"

QWEN_FIXTURE = json.loads((FIXTURES / "tokenizer_qwen2.5-coder-1.5b.json").read_text(encoding="utf-8"))
DEEPSEEK_FIXTURE = json.loads((FIXTURES / "tokenizer_deepseek-r1-distill-qwen-7b.json").read_text(encoding="utf-8"))


def llama_cpp_unescape(text: str) -> str:
    """What llama-tokenize does to its prompt before tokenizing (common's
    string_process_escapes, on by default): the fixture texts were passed through
    it, so `printf("%d\\n")` in a fixture was tokenized with a real newline."""
    simple = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\"}

    def sub(m: re.Match) -> str:
        e = m.group(1)
        return chr(int(e[1:], 16)) if e[0] == "x" else simple[e]

    return re.sub(r"\\(x[0-9a-fA-F]{2}|[nrt'\"\\])", sub, text)


def _case_id(i: int, e: dict) -> str:
    return f"{i:02d}-" + re.sub(r"\W+", "_", e["text"][:24]).strip("_")


@pytest.fixture(scope="module")
def qwen_tok(real_model_path) -> Tokenizer:
    with open_gguf(real_model_path) as gf:
        return Tokenizer.from_gguf(gf)


@pytest.fixture(scope="module")
def deepseek_meta(header_7b) -> dict:
    with open_gguf(header_7b, header_only=True) as gf:
        return dict(gf.metadata)


@pytest.fixture(scope="module")
def deepseek_tok(deepseek_meta, header_7b) -> Tokenizer:
    return Tokenizer.from_metadata(deepseek_meta, path=str(header_7b))


# ---- fixtures: exact ids, both modes, every text --------------------------------------------

@pytest.mark.model
@pytest.mark.parametrize("case", QWEN_FIXTURE, ids=[_case_id(i, e) for i, e in enumerate(QWEN_FIXTURE)])
def test_qwen_matches_llama_cpp(qwen_tok, case):
    text = llama_cpp_unescape(case["text"])
    assert qwen_tok.encode(text, parse_special=True) == case["ids_parse_special"]
    assert qwen_tok.encode(text, parse_special=False) == case["ids_no_parse_special"]
    for ids in (case["ids_parse_special"], case["ids_no_parse_special"]):
        assert qwen_tok.decode(ids) == text


@pytest.mark.parametrize("case", DEEPSEEK_FIXTURE, ids=[_case_id(i, e) for i, e in enumerate(DEEPSEEK_FIXTURE)])
def test_deepseek_matches_llama_cpp(deepseek_tok, case):
    text = llama_cpp_unescape(case["text"])
    assert deepseek_tok.encode(text, parse_special=True) == case["ids_parse_special"]
    assert deepseek_tok.encode(text, parse_special=False) == case["ids_no_parse_special"]
    for ids in (case["ids_parse_special"], case["ids_no_parse_special"]):
        assert ids[0] == deepseek_tok.bos_id
        assert deepseek_tok.decode(ids[1:]) == text


@pytest.mark.model
def test_qwen_greedy_prompts_match_llama_cpp(qwen_tok):
    # the prompts of the greedy fixture were tokenized by llama-completion
    greedy = json.loads((FIXTURES / "greedy_qwen2.5-coder-1.5b.json").read_text(encoding="utf-8"))
    for rec in greedy:
        assert qwen_tok.encode(rec["prompt"]) == rec["prompt_ids"], rec["prompt"][:40]


def test_fixture_escape_case_is_present():
    # guards llama_cpp_unescape: exactly the texts with a backslash differ, and one does
    changed = [e["text"] for e in QWEN_FIXTURE if llama_cpp_unescape(e["text"]) != e["text"]]
    assert changed and all("\\" in t for t in changed)


# ---- BOS, special ids, metadata -------------------------------------------------------------

def test_deepseek_bos_flag_and_override(deepseek_tok):
    assert deepseek_tok.add_bos and deepseek_tok.bos_id == 151646
    case = DEEPSEEK_FIXTURE[0]
    assert deepseek_tok.encode(case["text"], add_bos=False) == case["ids_parse_special"][1:]
    assert deepseek_tok.eos_id in deepseek_tok.eog_ids
    assert deepseek_tok.tokens[deepseek_tok.eos_id] == "<｜end▁of▁sentence｜>"
    assert deepseek_tok.vocab_size == len(deepseek_tok.tokens) == 152064


@pytest.mark.model
def test_qwen_no_bos_and_eog(qwen_tok):
    assert not qwen_tok.add_bos
    case = QWEN_FIXTURE[0]
    assert qwen_tok.encode(case["text"], add_bos=True) == [qwen_tok.bos_id] + case["ids_parse_special"]
    im_end = qwen_tok.token_to_id["<|im_end|>"]
    endoftext = qwen_tok.token_to_id["<|endoftext|>"]
    assert {qwen_tok.eos_id, im_end, endoftext} <= qwen_tok.eog_ids
    assert qwen_tok.token_to_id["<|im_start|>"] not in qwen_tok.eog_ids
    assert isinstance(qwen_tok.chat_template, str) and "<|im_start|>" in qwen_tok.chat_template
    # decode(special=False) drops control tokens, keeps the text between them
    ids = qwen_tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert qwen_tok.decode(ids, special=False) == "user\nhi"


def test_unknown_pre_tokenizer_is_named(deepseek_meta):
    meta = dict(deepseek_meta)
    meta[K.PRE] = "no-such-pre"
    with pytest.raises(MinferError, match="no-such-pre"):
        Tokenizer.from_metadata(meta)


def test_bad_metadata_errors(deepseek_meta):
    with pytest.raises(MinferError, match="no tokenizer"):
        Tokenizer.from_metadata({})
    with pytest.raises(MinferError, match="unsupported tokenizer model 'bert'"):
        Tokenizer.from_metadata({**deepseek_meta, K.MODEL: "bert"})
    with pytest.raises(MinferError, match="outside the vocabulary"):
        Tokenizer.from_metadata({**deepseek_meta, K.BOS_ID: 10**6})


def test_token_bytes(deepseek_tok):
    # byte-level BPE: 'Ġ' stands for the space byte, 'Ċ' for newline
    assert deepseek_tok.token_bytes(deepseek_tok.token_to_id["Ġ"]) == b" "
    assert deepseek_tok.token_bytes(deepseek_tok.token_to_id["Ċ"]) == b"\n"
    assert deepseek_tok.token_bytes(deepseek_tok.bos_id) == "<｜begin▁of▁sentence｜>".encode()
    with pytest.raises(MinferError):
        deepseek_tok.token_bytes(deepseek_tok.vocab_size)


# ---- streaming ------------------------------------------------------------------------------

def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    dec = tok.stream_decoder()
    return [dec.push(i) for i in ids] + [dec.flush()]


MULTIBYTE = [e for e in DEEPSEEK_FIXTURE if any(ord(c) > 0x7F for c in e["text"])]


@pytest.mark.parametrize("case", MULTIBYTE, ids=[_case_id(i, e) for i, e in enumerate(MULTIBYTE)])
def test_stream_decoder_never_breaks_utf8(deepseek_tok, case):
    ids = case["ids_parse_special"][1:]
    full = deepseek_tok.decode(ids)
    chunks = _stream(deepseek_tok, ids)
    assert "".join(chunks) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in c for c in chunks)


def test_stream_decoder_holds_back_split_characters(deepseek_tok):
    # the emoji text has characters whose bytes span several tokens: those push()
    # calls must return nothing until the character is complete
    case = next(e for e in DEEPSEEK_FIXTURE if "😀" in e["text"])
    ids = case["ids_parse_special"][1:]

    def whole_utf8(b: bytes) -> bool:
        try:
            b.decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    assert not all(whole_utf8(deepseek_tok.token_bytes(i)) for i in ids), \
        "fixture should contain tokens that are not whole UTF-8 characters"
    chunks = _stream(deepseek_tok, ids)
    assert "" in chunks[:-1]
    # a stream cut inside a character: flush() reports the cut character as U+FFFD
    k = next(k for k, i in enumerate(ids) if not whole_utf8(deepseek_tok.token_bytes(i)))
    cut = _stream(deepseek_tok, ids[: k + 1])
    assert "\ufffd" not in "".join(cut[:-1]) and cut[-1] == "\ufffd"


# ---- llama / SentencePiece, on a tiny vocabulary built here ----------------------------------

def _tiny_spm_meta() -> dict:
    """<unk> <s> </s>, 256 byte tokens, and a few pieces whose scores fix the merge
    order: ll > he > ▁he > llo > ▁hello (higher score merges first)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    pieces = [("▁", -10.0), ("h", -10.5), ("e", -11.0), ("l", -11.5), ("o", -12.0), ("w", -12.25),
              ("ll", -1.0), ("he", -2.0), ("▁he", -3.0), ("llo", -4.0), ("▁hello", -5.0)]
    for p, s in pieces:
        tokens.append(p)
        types.append(TokenType.NORMAL)
        scores.append(s)
    return {K.MODEL: "llama", K.LIST: tokens, K.TOKEN_TYPE: [int(t) for t in types], K.SCORES: scores,
            K.BOS_ID: 1, K.EOS_ID: 2, K.UNK_ID: 0}


@pytest.fixture(scope="module")
def spm_tok() -> Tokenizer:
    return Tokenizer.from_metadata(_tiny_spm_meta(), path="tiny-spm")


def test_spm_merges_and_bos(spm_tok):
    t = spm_tok.token_to_id
    assert spm_tok.add_bos  # llama vocabularies default to BOS, as in llama.cpp
    assert spm_tok.encode("hello") == [1, t["▁hello"]]
    assert spm_tok.encode("hello hello", add_bos=False) == [t["▁hello"], t["▁hello"]]
    # 'ő' is not in the vocabulary: its two UTF-8 bytes come out as byte tokens
    assert spm_tok.encode("hőllo", add_bos=False) == [t["▁"], t["h"], t["<0xC5>"], t["<0x91>"], t["llo"]]


def test_spm_specials_and_space_prefix(spm_tok):
    t = spm_tok.token_to_id
    # a parsed special token is followed by a fresh space prefix (llama.cpp's SPM rule)
    assert spm_tok.encode("hello</s>hello", add_bos=False) == [t["▁hello"], 2, t["▁hello"]]
    plain = spm_tok.encode("hello</s>hello", parse_special=False, add_bos=False)
    assert 2 not in plain
    assert spm_tok.decode(plain) == "hello</s>hello"


@pytest.mark.parametrize("text", ["hello", "hello  world\n", "wheel 3€ 😀 llo", " lead"])
def test_spm_round_trip(spm_tok, text):
    ids = spm_tok.encode(text, add_bos=False)
    assert spm_tok.decode(ids) == text
    assert "".join(_stream(spm_tok, ids)) == text


def test_spm_stream_holds_back_byte_tokens(spm_tok):
    ids = spm_tok.encode("h€", add_bos=False)  # '€' = E2 82 AC, three byte tokens
    chunks = _stream(spm_tok, ids)
    assert chunks == ["", "h", "", "", "€", ""]  # "▁" alone: the stripped prefix space
