"""Tokenizer vs llama.cpp: llama-tokenize's ids (tests/fixtures/tokenizer_*.json), llama.cpp's
own tokenizer tests (tests/fixtures/vocab/: vocabulary-only GGUFs with inputs and expected
ids), plus a tiny hand-built SentencePiece vocabulary for the `llama` path and one BPE
vocabulary for the pre-tokenizer flags."""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import Keys, TokenType

from minfer.errors import MinferError
from minfer.text.escapes import process_escapes
from minfer.format.gguf import open_gguf
from minfer.text.pretokenizers import PRE_TOKENIZERS
from minfer.text.tokenizer import Tokenizer, open_tokenizer

K = Keys.Tokenizer
# the parametrizations need the fixture files at collection time, before any fixture
FIXTURES = Path(__file__).resolve().parent / "fixtures"
VOCAB = FIXTURES / "vocab"

QWEN_FIXTURE = json.loads((FIXTURES / "tokenizer_qwen2.5-coder-1.5b.json").read_text(encoding="utf-8"))
DEEPSEEK_FIXTURE = json.loads((FIXTURES / "tokenizer_deepseek-r1-distill-qwen-7b.json").read_text(encoding="utf-8"))
SMOLLM2_FIXTURE = json.loads((FIXTURES / "tokenizer_smollm2-135m.json").read_text(encoding="utf-8"))


def llama_cpp_unescape(text: str) -> str:
    """What llama-tokenize does to its prompt before tokenizing (escape processing,
    on by default; minfer.text.escapes, which `minfer tokenize/generate -p` use too): the
    fixture texts were passed through it, so `printf("%d\\n")` in a fixture was
    tokenized with a real newline."""
    return process_escapes(text.encode("utf-8")).decode("utf-8")


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


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_path) -> Tokenizer:
    return open_tokenizer(smollm2_path)


@pytest.mark.model
@pytest.mark.parametrize("case", SMOLLM2_FIXTURE, ids=[_case_id(i, e) for i, e in enumerate(SMOLLM2_FIXTURE)])
def test_smollm2_matches_llama_cpp(smollm2_tok, case):
    # llama architecture, byte-level BPE with the `smollm` pre-tokenizer, no BOS
    text = llama_cpp_unescape(case["text"])
    assert smollm2_tok.encode(text, parse_special=True) == case["ids_parse_special"]
    assert smollm2_tok.encode(text, parse_special=False) == case["ids_no_parse_special"]
    for ids in (case["ids_parse_special"], case["ids_no_parse_special"]):
        assert smollm2_tok.decode(ids) == text


@pytest.mark.model
def test_smollm2_greedy_prompts_and_flags(smollm2_tok):
    greedy = json.loads((FIXTURES / "greedy_smollm2-135m.json").read_text(encoding="utf-8"))
    for rec in greedy:
        assert smollm2_tok.encode(rec["prompt"]) == rec["prompt_ids"], rec["prompt"][:40]
    assert smollm2_tok.pre.kind == "SMOLLM" and not smollm2_tok.add_bos
    # <|im_end|> is the EOS; <|endoftext|> and the FIM repo-name marker end generation too,
    # as in llama.cpp
    t = smollm2_tok.token_to_id
    assert smollm2_tok.eos_id == t["<|im_end|>"]
    assert {t["<|im_end|>"], t["<|endoftext|>"], t["<reponame>"]} == set(smollm2_tok.eog_ids)


def test_fixture_escape_case_is_present():
    # guards llama_cpp_unescape: exactly the texts with a backslash differ, and one does
    changed = [e["text"] for e in QWEN_FIXTURE if llama_cpp_unescape(e["text"]) != e["text"]]
    assert changed and all("\\" in t for t in changed)


# ---- llama.cpp's own tokenizer tests (test-tokenizer-0) ----------------------------------------

def vocab_cases(name: str) -> list[tuple[str, list[int]]]:
    """(text, ids) of llama.cpp's test for ggml-vocab-NAME.gguf: the .inp file holds the
    texts, each followed by the line __ggml_vocab_test__; the .out file one line of ids
    per text (no BOS, special-token text not parsed)."""
    base = VOCAB / f"ggml-vocab-{name}.gguf"
    raw = base.with_name(base.name + ".inp").read_text(encoding="utf-8")
    sep = "\n__ggml_vocab_test__\n"
    assert raw.endswith(sep)
    texts = raw[:-len(sep)].split(sep)
    lines = base.with_name(base.name + ".out").read_text(encoding="utf-8").split("\n")
    assert len(lines) == len(texts) + 1 and lines[-1] == ""
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


VOCAB_TESTS = {name: vocab_cases(name) for name in ("llama-spm", "deepseek-coder", "qwen2")}


@functools.cache
def vocab_tokenizer(name: str) -> Tokenizer:
    # the vocabulary-only files through the path `minfer tokenize` takes
    return open_tokenizer(VOCAB / f"ggml-vocab-{name}.gguf")


def _vocab_params(name: str):
    return [pytest.param(name, i, id=f"{name}-{i:02d}") for i in range(len(VOCAB_TESTS[name]))]


@pytest.mark.parametrize("name,i", _vocab_params("llama-spm") + _vocab_params("deepseek-coder"))
def test_llama_cpp_vocab_test(name, i):
    text, want = VOCAB_TESTS[name][i]
    assert vocab_tokenizer(name).encode(text, parse_special=False, add_bos=False) == want


@pytest.mark.model
def test_llama_cpp_vocab_test_qwen2(real_model_path):
    # the qwen2 test ships no vocabulary file: the real 1.5B's is the same
    tok = open_tokenizer(real_model_path)
    failed = [t for t, want in VOCAB_TESTS["qwen2"] if tok.encode(t, parse_special=False, add_bos=False) != want]
    assert not failed, f"{len(failed)} of {len(VOCAB_TESTS['qwen2'])} inputs differ, first {failed[0]!r}"


def test_vocab_only_files_have_no_tensors_and_no_runnable_config():
    # what the tokenizer-only path is for: nothing but metadata, and a config that the
    # model contract would refuse (deepseek-coder's linear RoPE scaling)
    for name in ("llama-spm", "deepseek-coder"):
        with open_gguf(VOCAB / f"ggml-vocab-{name}.gguf") as gf:
            assert not gf.tensors
    from minfer.engine import ModelFile
    with pytest.raises(MinferError, match="rope.scaling.type"):
        ModelFile.open(VOCAB / "ggml-vocab-deepseek-coder.gguf")


@pytest.mark.parametrize("name", ["llama-spm", "deepseek-coder"])
def test_minfer_tokenize_on_a_vocabulary_only_file(name, tmp_path):
    # the command end to end on the longest input (every kind of whitespace, emoji, CJK)
    text, want = max(VOCAB_TESTS[name], key=lambda c: len(c[0]))
    f = tmp_path / "text.txt"
    f.write_bytes(text.encode("utf-8"))
    r = subprocess.run([sys.executable, "-m", "minfer", "tokenize", "-m", str(VOCAB / f"ggml-vocab-{name}.gguf"),
                        "-f", str(f), "--no-parse-special", "--no-bos"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == want


def _write_vocab_only(path: Path, meta: dict) -> Path:
    """A GGUF holding these tokenizer keys and nothing else (no tensors, no config)."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in meta.items():
        if isinstance(v, list):
            w.add_array(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        else:
            w.add_uint32(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_open_tokenizer_checks_the_vocabulary(tmp_path):
    meta = _tiny_bpe_meta("smollm")
    tok = open_tokenizer(_write_vocab_only(tmp_path / "ok.gguf", meta))
    assert tok.encode("abc") == [3, 2] and tok.vocab_size == 7
    bad = _write_vocab_only(tmp_path / "bad.gguf", {**meta, K.TOKEN_TYPE: meta[K.TOKEN_TYPE][:-1]})
    with pytest.raises(MinferError, match="token_type has 6 entries for 7 tokens"):
        open_tokenizer(bad)
    with pytest.raises(MinferError, match="no such model file"):
        open_tokenizer(tmp_path / "missing.gguf")


# ---- pre-tokenizers ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_compiles_and_splits_losslessly(name):
    from tokenizers import Regex, pre_tokenizers
    text = "Hello, y'all! 3333 ¿Cómo estás?\n\n  tabs\t\there 你好世界 안녕 😀 ½ x=1+2 WORLD's"
    for rx in PRE_TOKENIZERS[name].regexes:
        split = pre_tokenizers.Split(Regex(rx), behavior="isolated")
        pieces = [p for p, _ in split.pre_tokenize_str(text)]
        assert "".join(pieces) == text, (name, rx)


def test_llama3_pre_tokenizer_definition():
    # untested against a real Llama 3 vocabulary (none is available here): these are
    # the definition's own consequences, not llama.cpp's ids
    from tokenizers import Regex, pre_tokenizers
    pre = PRE_TOKENIZERS["llama-bpe"]
    assert pre.ignore_merges and pre.add_bos and pre.kind == "LLAMA3"
    split = pre_tokenizers.Split(Regex(pre.regexes[0]), behavior="isolated")
    words = [p for p, _ in split.pre_tokenize_str("I'LL pay 1234567 in\n\n  cash!!\n")]
    assert words == ["I", "'LL", " pay", " ", "123", "456", "7", " in", "\n\n", " ", " cash", "!!\n"]


def _tiny_bpe_meta(pre: str) -> dict:
    """Byte-level BPE on a, b, c with merges 'a b' before 'b c', and 'abc' a token that
    those merges never build: what ignore_merges changes."""
    tokens = ["a", "b", "c", "ab", "bc", "abc", "<s>"]
    types = [TokenType.NORMAL] * 6 + [TokenType.CONTROL]
    return {K.MODEL: "gpt2", K.PRE: pre, K.LIST: tokens, K.TOKEN_TYPE: [int(t) for t in types],
            K.MERGES: ["a b", "b c"], K.BOS_ID: 6}


def test_ignore_merges_and_bos_default_follow_the_pre_tokenizer():
    llama3 = Tokenizer.from_metadata(_tiny_bpe_meta("llama-bpe"))
    smaug = Tokenizer.from_metadata(_tiny_bpe_meta("smaug-bpe"))       # same regex, no flags
    assert llama3.encode("abc") == [6, 5]           # BOS by default; the whole word is a token
    assert smaug.encode("abc") == [3, 2]            # no BOS; merges: ab + c
    assert llama3.encode("abc", add_bos=False) == [5]
    meta = {**_tiny_bpe_meta("llama-bpe"), K.ADD_BOS: False}      # the key wins over the default
    assert Tokenizer.from_metadata(meta).encode("abc") == [5]


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
