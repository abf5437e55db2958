"""The token ids a generation starts from: the prompt text as is, or the model's
chat template rendered around it."""
from __future__ import annotations

from .chat import apply_chat_template
from .errors import MinferError


def prompt_ids(tokenizer, text: str, chat: bool = False, system: str | None = None) -> list[int]:
    """Token ids of a prompt, special-token text (<|im_start|>) parsed.

    chat=False: `text` is tokenized as given, with the tokenizer's own BOS rule.
    chat=True: the tokenizer's chat template renders an optional `system`
    message and `text` as the user message, ending in the generation prompt
    (`system` is used only with chat). Raises MinferError when the ids are empty.
    """
    add_bos = None                       # None: the model's tokenizer.ggml.add_bos_token
    if chat:
        tok = tokenizer
        bos = tok.tokens[tok.bos_id] if tok.bos_id is not None else ""
        eos = tok.tokens[tok.eos_id] if tok.eos_id is not None else ""
        messages = ([{"role": "system", "content": system}] if system else []) + \
                   [{"role": "user", "content": text}]
        text = apply_chat_template(tok.chat_template, messages, bos_token=bos, eos_token=eos)
        if bos and text.startswith(bos):
            # the template wrote the BOS text itself, which parses to the BOS
            # token: the tokenizer's own BOS would double it
            add_bos = False
    ids = tokenizer.encode(text, parse_special=True, add_bos=add_bos)
    if len(ids) == 0:
        raise MinferError("empty prompt: it tokenizes to nothing")
    return ids
