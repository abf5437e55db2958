"""llama.cpp's pre-tokenizers for byte-level BPE vocabularies, by `tokenizer.ggml.pre`.

A pre-tokenizer cuts text into words before the BPE merges run. llama.cpp
(llama-vocab.cpp) maps each `tokenizer.ggml.pre` name to a pre-tokenizer type,
and each type to a list of regexes applied one after another: every regex
splits the pieces the previous one produced, and both its matches and the text
between them are kept (tokenizers' Split with behavior="isolated"). Some types
also change two tokenizer flags:

  ignore_merges  a word that is itself a vocabulary token is emitted whole,
                 without running the merges (LLAMA3, TEKKEN)
  add_bos        the default of tokenizer.ggml.add_bos_token when the key is
                 absent (LLAMA3, TEKKEN add BOS; other BPE types do not)

The regexes are llama.cpp's, in the form its own matcher runs them: for LLAMA3
and QWEN2 the case-insensitive contraction group `(?i:'s|...)` is spelled out as
`'[sS]|...`, and TEKKEN's upper/lower-case letter classes are llama.cpp's
lookahead rewrite, not the original tokenizer.json's \\p{Lu}/\\p{Ll}. They run
in the `tokenizers` library (Oniguruma), whose Unicode classes agree with
llama.cpp's tables on the test vocabularies (tests/test_tokenizer.py).

Which types are checked against llama.cpp's own ids, and which are only
transcribed, is said per entry below; an unknown name is an error, never a
fallback to some default regex.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PreTokenizer:
    kind: str                  # llama.cpp's LLAMA_VOCAB_PRE_TYPE_* name
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


# llama.cpp's rewrite of (?i:'s|'t|'re|'ve|'m|'ll|'d)
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
# CJK ideographs U+4E00..U+9FA5, U+0800..U+4E00 (sic), Hangul U+AC00..U+D7FF
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
           r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek LLM's cased letters (Unicode category LC), as code points: several of
# them (U+1F7D, U+1FBE, U+1FD3, U+1FDB, U+2126, U+212A) have canonical
# equivalents, so a copy that passed through NFC would silently change them
_DEEPSEEK_LLM_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
    "\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    "\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b"
    "\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787"
    "\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943")

_TYPES: dict[str, tuple[PreTokenizer, tuple[str, ...]]] = {
    # Llama 3 and its derivatives. Transcribed only: no Llama 3 vocabulary is
    # available to the tests.
    "LLAMA3": (PreTokenizer("LLAMA3", (_LLAMA3,), ignore_merges=True, add_bos=True),
               ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                "lfm2", "jina-v5-nano")),
    # same regex as LLAMA3, without its flags. Transcribed only.
    "SMAUG": (PreTokenizer("SMAUG", (_LLAMA3,)), ("smaug-bpe", "dbrx")),
    # DeepSeek-Coder (llama architecture). Checked: llama.cpp's ggml-vocab-deepseek-coder test.
    "DEEPSEEK_CODER": (PreTokenizer("DEEPSEEK_CODER", (
        "[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")), ("deepseek-coder",)),
    # DeepSeek LLM (llama architecture). Transcribed only.
    "DEEPSEEK_LLM": (PreTokenizer("DEEPSEEK_LLM", (
        "[\r\n]", r"\s?[" + _DEEPSEEK_LLM_LETTERS + "]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$", _CJK,
        r"\p{N}+")), ("deepseek-llm",)),
    # digits one by one, then GPT-2's regex: SmolLM/SmolLM2 (llama architecture)
    # and the other names llama.cpp gives this regex list. Checked: SmolLM2-135M's
    # fixture (tests/fixtures/tokenizer_smollm2-135m.json).
    "SMOLLM": (PreTokenizer("SMOLLM", (r"\p{N}", _GPT2)),
               ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b",
                "mellum2")),
    # GPT-2's regex alone. Transcribed only.
    "GPT2": (PreTokenizer("GPT2", (_GPT2,)),
             ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
              "a.x-4.0", "mellum", "modern-bert", "mpt", "olmo", "jais", "trillion",
              "granite-docling", "exaone4")),
    # Qwen2/2.5 and DeepSeek-R1-Distill-Qwen (qwen2 architecture); megrez is a llama
    # model with this vocabulary. Checked: llama.cpp's ggml-vocab-qwen2 test and the
    # Qwen2.5-Coder-1.5B and DeepSeek-R1-Distill-Qwen-7B fixtures.
    "QWEN2": (PreTokenizer("QWEN2", (_QWEN2,)),
              ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
               "solar-open")),
    # Seed-Coder (llama architecture). Transcribed only.
    "SEED_CODER": (PreTokenizer("SEED_CODER", (_SEED_CODER,)), ("seed-coder",)),
    # Mistral NeMo's Tekken (llama architecture). Transcribed only.
    "TEKKEN": (PreTokenizer("TEKKEN", (_TEKKEN,), ignore_merges=True, add_bos=True), ("tekken",)),
    # Viking (llama architecture). Transcribed only.
    "VIKING": (PreTokenizer("VIKING", (
        " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+", r"\p{N}")), ("viking",)),
}

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    name: pre for pre, names in _TYPES.values() for name in names}
