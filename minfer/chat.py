"""Chat templates: the GGUF's Jinja template, rendered in jinja2's sandbox."""
from __future__ import annotations

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import MinferError


def _raise(message):
    raise TemplateError(message)


def apply_chat_template(template: str | None, messages: list[dict], bos_token: str = "",
                        eos_token: str = "", add_generation_prompt: bool = True) -> str:
    """Render messages [{"role": ..., "content": ...}] with the model's template -> prompt text."""
    if not template:
        raise MinferError("this model has no chat template (tokenizer.chat_template); drop --chat")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,  # as HF transformers
                                       extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(template).render(
            messages=messages, bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt)
    except TemplateError as e:
        raise MinferError(f"chat template failed: {e}") from None
