"""minfer.text.prompt.prompt_ids on the 7B header's tokenizer (DeepSeek-R1-Distill-Qwen:
adds a BOS, and its chat template writes the BOS text itself).

The expected chat prompts are written out here from the template's output
format, not rendered by minfer."""
from __future__ import annotations

import pytest
from gguf import Keys

from minfer.errors import MinferError
from minfer.format.gguf import open_gguf
from minfer.text.prompt import prompt_ids
from minfer.text.tokenizer import Tokenizer

K = Keys.Tokenizer
BOS = "<｜begin▁of▁sentence｜>"


@pytest.fixture(scope="module")
def meta(header_7b) -> dict:
    with open_gguf(header_7b, header_only=True) as gf:
        return dict(gf.metadata)


@pytest.fixture(scope="module")
def tok(meta) -> Tokenizer:
    t = Tokenizer.from_metadata(meta)
    assert t.add_bos and t.tokens[t.bos_id] == BOS       # what the tests below rely on
    return t


def test_plain_prompt_is_the_tokenizer_encoding(tok):
    text = "def f(x):<｜User｜> return x"
    ids = prompt_ids(tok, text)
    assert ids == tok.encode(text, parse_special=True)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert tok.token_to_id["<｜User｜>"] in ids           # special-token text is parsed
    assert prompt_ids(tok, text, system="ignored without chat") == ids


def test_chat_bos_not_doubled(tok):
    ids = prompt_ids(tok, "Hi there", chat=True)
    # the template writes the BOS; the tokenizer must not add a second one
    assert ids == tok.encode(f"{BOS}<｜User｜>Hi there<｜Assistant｜>", add_bos=False)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1


def test_chat_system_message(tok):
    ids = prompt_ids(tok, "Hi there", chat=True, system="Answer in one word.")
    assert ids == tok.encode(f"{BOS}Answer in one word.<｜User｜>Hi there<｜Assistant｜>",
                             add_bos=False)
    assert "Answer in one word." in tok.decode(ids)


def test_chat_template_without_bos_gets_the_tokenizers(meta):
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")
    t = Tokenizer.from_metadata({**meta, K.CHAT_TEMPLATE: template})
    ids = prompt_ids(t, "Hi", chat=True, system="Be brief.")
    assert ids == [t.bos_id] + t.encode("system: Be brief.\nuser: Hi\n<｜Assistant｜>", add_bos=False)


def test_errors(meta, tok):
    no_bos = Tokenizer.from_metadata({**meta, K.ADD_BOS: False})
    with pytest.raises(MinferError, match="tokenizes to nothing"):
        prompt_ids(no_bos, "")
    assert prompt_ids(tok, "") == [tok.bos_id]            # the BOS alone is a prompt
    no_template = Tokenizer.from_metadata({k: v for k, v in meta.items() if k != K.CHAT_TEMPLATE})
    with pytest.raises(MinferError, match="no chat template"):
        prompt_ids(no_template, "Hi", chat=True)
