"""The token ids a generation starts from: the prompt text as is, or the model's
chat template rendered around it (or around a list of messages)."""
from __future__ import annotations

from .chat import apply_chat_template
from ..errors import MinferError


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The model's chat template rendered around messages [{"role", "content"}]
    with its own BOS and EOS texts -> prompt text (special-token text included)."""
    tok = tokenizer
    bos = tok.tokens[tok.bos_id] if tok.bos_id is not None else ""
    eos = tok.tokens[tok.eos_id] if tok.eos_id is not None else ""
    return apply_chat_template(tok.chat_template, messages, bos_token=bos, eos_token=eos,
                               add_generation_prompt=add_generation_prompt)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of messages rendered by the chat template, ending in the
    generation prompt. Raises MinferError when the ids are empty."""
    text = render_chat(tokenizer, messages)
    bos = tokenizer.tokens[tokenizer.bos_id] if tokenizer.bos_id is not None else ""
    # a template that writes the BOS text itself parses to the BOS token: the
    # tokenizer's own BOS would double it
    add_bos = False if bos and text.startswith(bos) else None     # None: the model's flag
    return _nonempty(tokenizer.encode(text, parse_special=True, add_bos=add_bos))


def prompt_ids(tokenizer, text: str, chat: bool = False, system: str | None = None) -> list[int]:
    """Token ids of a prompt, special-token text (<|im_start|>) parsed.

    chat=False: `text` is tokenized as given, with the tokenizer's own BOS rule.
    chat=True: the tokenizer's chat template renders an optional `system`
    message and `text` as the user message, ending in the generation prompt
    (`system` is used only with chat). Raises MinferError when the ids are empty.
    """
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + \
                   [{"role": "user", "content": text}]
        return chat_ids(tokenizer, messages)
    return _nonempty(tokenizer.encode(text, parse_special=True))


def check_fits(n_prompt: int, n_ctx: int, what: str = "the prompt") -> None:
    """A prompt must leave its last position inside the context."""
    if n_prompt > n_ctx:
        raise MinferError(f"{what} is {n_prompt} tokens, longer than the context of {n_ctx}; "
                          f"shorten it or raise the context (-c, n_ctx)")


def _nonempty(ids: list[int]) -> list[int]:
    if len(ids) == 0:
        raise MinferError("empty prompt: it tokenizes to nothing")
    return ids
