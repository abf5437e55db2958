"""The request bodies of /v1/completions and /v1/chat/completions, after OpenAI's
schemas (with vLLM's top_k, min_p and repetition_penalty), as pydantic models, and
what they map to: one prompt, a max_tokens, minfer.SamplingParams, stop strings,
a logprobs count.

Unknown fields are ignored, as OpenAI's server does. Fields this server cannot
honour yet are refused with a 400 naming the field (`unsupported`), never dropped:
n > 1, best_of > 1, suffix, logit_bias, tools and function calls, a response_format
other than text, echo with logprobs, more than one prompt, non-text message parts.
"""
from __future__ import annotations

import secrets
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from .errors import APIError

MAX_TOP_LOGPROBS = 20           # minfer.logprobs.MAX_TOP_LOGPROBS: the engine's bound
COMPLETION_DEFAULT_MAX_TOKENS = 16      # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE = 1.0       # OpenAI's default: a request that names none is sampled


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampled(BaseModel):
    """The fields both endpoints share."""
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)          # vLLM's: -1 or 0 is off
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)     # vLLM's (llama.cpp's repeat_penalty)
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False                          # vLLM's

    def sampling(self):
        """-> minfer.SamplingParams (MinferError for a value it refuses). No seed: a
        fresh random one, as OpenAI's server draws differently each time."""
        from ..sampling import SamplingParams
        top_k = self.top_k if self.top_k is not None and self.top_k > 0 else 0
        return SamplingParams(
            temperature=DEFAULT_TEMPERATURE if self.temperature is None else float(self.temperature),
            top_k=top_k, top_p=1.0 if self.top_p is None else float(self.top_p),
            min_p=0.0 if self.min_p is None else float(self.min_p),
            repeat_penalty=1.0 if self.repetition_penalty is None else float(self.repetition_penalty),
            frequency_penalty=float(self.frequency_penalty or 0.0),
            presence_penalty=float(self.presence_penalty or 0.0),
            seed=secrets.randbits(63) if self.seed is None else int(self.seed))

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        for s in stops:
            if not s:
                raise APIError(400, "stop: each stop string must be non-empty text", "stop")
        return stops

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported(self) -> None:
        """400 for a field whose value this server cannot honour."""
        if self.n != 1:
            raise APIError(400, f"n={self.n}: only n=1 is supported", "n")
        if self.best_of not in (None, 1):
            raise APIError(400, f"best_of={self.best_of}: only best_of=1 is supported", "best_of")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options needs stream=true", "stream_options")


class CompletionRequest(_Sampled):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs (the prompt's logprobs) is not supported", "echo")

    def one_prompt(self) -> str | list[int]:
        """The prompt: text or token ids (a list holding one of them is that one)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"{len(p)} prompts: give one prompt per request", "prompt")
            p = p[0]
        if len(p) == 0:
            raise APIError(400, "empty prompt", "prompt")
        return p

    def max_new(self, room: int) -> int:
        return COMPLETION_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: Union[str, list[TextPart], None] = None
    tool_calls: list[Any] | None = None

    def text(self, i: int) -> str:
        if self.tool_calls:
            raise APIError(400, "tool calls are not supported", f"messages[{i}].tool_calls")
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise APIError(400, f"a message part of type {part.type!r}: only text parts are supported",
                               f"messages[{i}].content[{j}]")
            out.append(part.text)
        return "".join(out)


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ChatRequest(_Sampled):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict | None = None

    def unsupported(self) -> None:
        super().unsupported()
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise APIError(400, f"{name} (function calling) is not supported", name)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise APIError(400, f"{name} (function calling) is not supported", name)
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(400, f"response_format {self.response_format.get('type')!r}: only text is supported",
                           "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")

    def chat_messages(self) -> list[dict]:
        """The messages as the chat template takes them (developer is system's newer name)."""
        out = []
        for i, m in enumerate(self.messages):
            role = ROLES.get(m.role)
            if role is None:
                raise APIError(400, f"role {m.role!r}: roles are system, developer, user and assistant",
                               f"messages[{i}].role")
            out.append({"role": role, "content": m.text(i)})
        return out

    def n_logprobs(self) -> int | None:
        """The engine's logprobs: None off, else the top entries per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new(self, room: int) -> int:
        """max_completion_tokens, else max_tokens, else up to the context (room)."""
        for v in (self.max_completion_tokens, self.max_tokens):
            if v is not None:
                return v
        return room


Kind = Literal["completion", "chat"]
