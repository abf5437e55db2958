"""Chat templates: the GGUF's Jinja template, rendered in a bounded jinja2 sandbox.

jinja2's sandbox keeps a template away from Python's internals, but not from
dividing by zero, recursing, looping for hours or building a 10 GB string. Here
any exception while compiling or rendering is one MinferError line, and
rendering is bounded (a real template renders in milliseconds):

- time: TIME_LIMIT_S of wall clock, checked on every line the compiled template
  runs and on every Python call made while it runs (a trace function, so it
  holds in any thread; signal.alarm would only work in the main thread);
- size: no string or container the template builds, and not its output, may
  exceed MAX_CHARS characters beyond the messages' own text. An operation whose
  result size a number sets (`*`, `**`, `%` and format widths, `center`,
  `indent`, `replace`, `join`, ...) is checked before it runs; every other filter,
  method call, operator and `~` is checked after, when at most a small multiple
  of the bound has been allocated.
"""
from __future__ import annotations

import functools
import itertools
import re
import string
import sys
import time

from jinja2 import TemplateError, pass_environment, pass_eval_context
from jinja2.compiler import CodeGenerator
from jinja2.runtime import str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from ..errors import MinferError

TIME_LIMIT_S = 2.0
MAX_CHARS = 4 << 20          # characters a template may add to its messages' text
MAX_TEMPLATE_CHARS = 1 << 20  # the template itself (real ones are a few KB)
MAX_INT_BITS = 1 << 16       # integers a template computes (`**`, `*`)
_MESSAGE_CHARS = 300         # an error message quoted from the template, at most


class _Bound(BaseException):
    """A time or size bound was hit (the message says which). A BaseException, so
    that no `except Exception` inside jinja2 can swallow it."""


def _raise(message):
    raise TemplateError(message)


def text_size(v, limit: int) -> int:
    """About len(str(v)), container reprs included; counting stops past limit."""
    if isinstance(v, (str, bytes)):
        return len(v)
    if isinstance(v, int):
        return v.bit_length() // 3 + 2                  # decimal digits, sign
    if isinstance(v, dict):
        items = itertools.chain.from_iterable(v.items())
    elif isinstance(v, (list, tuple, set, frozenset)):
        items = v
    elif isinstance(v, Namespace):                      # its repr shows its attributes
        items = itertools.chain.from_iterable(v._Namespace__attrs.items())
    else:
        return 32                                       # floats, None, macros, undefined
    n = 2
    for x in items:
        n += text_size(x, limit - n) + 2                # ", " between items
        if n > limit:
            break
    return n


_PRINTF_NUMBERS = re.compile(r"%[#0\- +]*(\*|\d*)(?:\.(\*|\d*))?")


class _Deadline:
    """sys.settrace function: raise _Bound once the wall clock passes the deadline."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def check(self) -> None:
        if time.monotonic() > self.end:
            raise _Bound(f"rendering took longer than {self.seconds:g} s")

    def __call__(self, frame, event, arg):          # every new frame
        self.check()
        return self.line if frame.f_code.co_filename == "<template>" else None

    def line(self, frame, event, arg):              # every line of the compiled template
        if event == "line":
            self.check()
        return self.line


class _CheckedConcat(CodeGenerator):
    """`a ~ b` compiles to a size-checked join (jinja2 calls str_join directly)."""

    def visit_Concat(self, node, frame) -> None:
        if frame.eval_ctx.autoescape or frame.eval_ctx.volatile:
            return super().visit_Concat(node, frame)        # not used here (no autoescape)
        self.write("environment.checked_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "%", "+"})
    code_generator_class = _CheckedConcat

    def __init__(self, limit: int):
        super().__init__(trim_blocks=True, lstrip_blocks=True,     # as HF transformers
                         extensions=["jinja2.ext.loopcontrols"], finalize=self._output)
        self.limit = limit
        self.globals["raise_exception"] = _raise
        del self.globals["lipsum"]          # lorem ipsum of any length; no chat template uses it
        filters = {**self.filters, **self._prechecked_filters(dict(self.filters))}
        self.filters = {name: self._post_checked(name, f) for name, f in filters.items()}

    # --- the bound --------------------------------------------------------------
    def need(self, size: int, what: str) -> None:
        if size > self.limit:
            raise _Bound(f"{what} would be {size:,} characters, more than the {self.limit:,} allowed")

    def sized(self, v, what: str):
        self.need(text_size(v, self.limit), what)
        return v

    def _output(self, v):
        return self.sized(v, "an output value")

    def concat(self, pieces):           # macro, block and call bodies (compiled code's concat)
        pieces = list(pieces)
        self.need(sum(len(p) for p in pieces), "a block's output")
        return "".join(pieces)

    def checked_join(self, parts):      # `~`
        self.need(sum(text_size(p, self.limit) for p in parts), "a `~` result")
        return str_join(parts)

    # --- operators --------------------------------------------------------------
    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
                    self.need(text_size(seq, self.limit) * max(n, 0), "a `*` result")
            if isinstance(left, int) and isinstance(right, int):
                self._int_bits(left.bit_length() + right.bit_length())
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            self._int_bits(left.bit_length() * max(right, 0))
        elif operator == "%" and isinstance(left, str):
            self.need(self._printf_size(left, right), "a `%` result")
        elif operator == "+":
            self.need(text_size(left, self.limit) + text_size(right, self.limit), "a `+` result")
        return self.sized(super().call_binop(context, operator, left, right), f"a `{operator}` result")

    def _int_bits(self, bits: int) -> None:
        if bits > MAX_INT_BITS:
            raise _Bound(f"an integer would have about {bits:,} bits, more than the {MAX_INT_BITS:,} allowed")

    def _printf_size(self, fmt: str, args) -> int:
        """Most characters `fmt % args` can produce: the format, every argument, the
        widths and precisions written in it or taken from the arguments (`*`)."""
        values = list(args.values()) if isinstance(args, dict) else \
            list(args) if isinstance(args, tuple) else [args]
        size = len(fmt) + sum(text_size(v, self.limit) for v in values)
        for width, precision in _PRINTF_NUMBERS.findall(fmt):
            for n in (width, precision):
                size += int(n) if n.isdigit() else 0
            if "*" in (width, precision):
                size += sum(abs(v) for v in values if isinstance(v, int))
        return size

    # --- method calls and str.format ------------------------------------------------
    def call(__self, __context, __obj, *args, **kwargs):     # noqa: N805 (jinja2's signature)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, bytes)):
            name = getattr(__obj, "__name__", "")
            if name == "join" and len(args) == 1 and not isinstance(args[0], (list, tuple)):
                args = (list(args[0]),)         # counted before joining; a generator once only
            __self._check_str_method(owner, name, args, kwargs)
        return __self.sized(super().call(__context, __obj, *args, **kwargs), "a call's result")

    def _check_str_method(self, s, name: str, args, kwargs) -> None:
        a = list(args) + list(kwargs.values())
        ints = [x for x in a if isinstance(x, int)]
        if name in ("center", "ljust", "rjust", "zfill") and ints:
            self.need(max(ints), f"str.{name}")
        elif name == "expandtabs":
            self.need(len(s) * max(ints + [8]), "str.expandtabs")
        elif name == "replace" and len(a) >= 2:
            self.need(self._replace_size(s, a[0], a[1]), "str.replace")
        elif name == "join" and a and isinstance(a[0], (list, tuple)):
            self.need(text_size(a[0], self.limit) + len(s) * len(a[0]), "str.join")
        elif name == "translate" and a and isinstance(a[0], dict):
            self.need(len(s) * max([text_size(v, self.limit) for v in a[0].values()] + [1]),
                      "str.translate")

    def _replace_size(self, s, old, new) -> int:
        if not isinstance(old, (str, bytes)) or not isinstance(new, (str, bytes)):
            return len(s)
        return len(s) + (len(s) + 1 if not old else len(s) // len(old)) * len(new)

    def wrap_str_format(self, value):
        """str.format / format_map: widths and fields checked before formatting."""
        inner = super().wrap_str_format(value)
        if inner is None:
            return None
        fmt = value.__self__

        def checked(*args, **kwargs):
            self.need(self._format_size(fmt, args, kwargs), "a str.format result")
            return inner(*args, **kwargs)
        return checked

    def _format_size(self, fmt: str, args, kwargs) -> int:
        values = list(args) + list(kwargs.values())
        if len(values) == 1 and isinstance(values[0], dict):         # format_map
            values += list(values[0].values())
        biggest = max([text_size(v, self.limit) for v in values] + [0])
        size = len(fmt)
        for _, field, spec, _ in string.Formatter().parse(fmt):
            if field is not None:
                size += biggest + sum(int(n) for n in re.findall(r"\d+", spec or ""))
                if "{" in (spec or ""):                               # nested width: {:{w}}
                    size += sum(abs(v) for v in values if isinstance(v, int))
        return size

    # --- filters ----------------------------------------------------------------
    def _post_checked(self, name: str, f):
        @functools.wraps(f)          # keeps jinja_pass_arg, so jinja passes the same arguments
        def checked(*args, **kwargs):
            return self.sized(f(*args, **kwargs), f"the result of filter {name}")
        return checked

    def _prechecked_filters(self, f: dict) -> dict:
        """The filters whose output size an argument sets, checked before they run
        (f: jinja2's own filters by name)."""
        need, limit = self.need, self.limit

        def center(value, width=80):
            need(width, "center's width")
            return f["center"](value, width)

        def indent(s, width=4, first=False, blank=False):
            pad = len(width) if isinstance(width, str) else width
            need(text_size(s, limit) + pad * (str(s).count("\n") + 1), "indent's result")
            return f["indent"](s, width, first, blank)

        @pass_environment
        def wordwrap(environment, s, width=79, break_long_words=True, wrapstring=None,
                     break_on_hyphens=True):
            lines = text_size(s, limit) // max(width, 1) + 1
            need(text_size(s, limit) + lines * len(wrapstring or "\n"), "wordwrap's result")
            return f["wordwrap"](environment, s, width, break_long_words, wrapstring, break_on_hyphens)

        def format_(value, *args, **kwargs):
            need(self._printf_size(str(value), kwargs or args), "format's result")
            return f["format"](value, *args, **kwargs)

        @pass_eval_context
        def join(eval_ctx, value, d="", attribute=None):
            value = value if isinstance(value, (list, tuple, str)) else list(value)
            need(text_size(value, limit) + len(value) * len(d), "join's result")
            return f["join"](eval_ctx, value, d, attribute)

        @pass_eval_context
        def replace(eval_ctx, s, old, new, count=None):
            need(self._replace_size(str(s), str(old), str(new)), "replace's result")
            return f["replace"](eval_ctx, s, old, new, count)

        def slice_(value, slices, fill_with=None):
            need(slices, "slice's count")
            return f["slice"](value, slices, fill_with)

        def batch(value, linecount, fill_with=None):
            need(linecount if fill_with is not None else 0, "batch's fill")
            return f["batch"](value, linecount, fill_with)

        return {"center": center, "indent": indent, "wordwrap": wordwrap, "format": format_,
                "join": join, "replace": replace, "slice": slice_, "batch": batch}


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    text = text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS - 3] + "..."
    if isinstance(e, (TemplateError, _Bound)):
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def apply_chat_template(template: str | None, messages: list[dict], bos_token: str = "",
                        eos_token: str = "", add_generation_prompt: bool = True,
                        time_limit: float = TIME_LIMIT_S) -> str:
    """Render messages [{"role": ..., "content": ...}] with the model's template -> prompt text."""
    if not template:
        raise MinferError("this model has no chat template (tokenizer.chat_template); drop --chat")
    if not isinstance(template, str):
        raise MinferError(f"the chat template is a {type(template).__name__}, not a string")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise MinferError(f"the chat template is {len(template):,} characters, more than the "
                          f"{MAX_TEMPLATE_CHARS:,} allowed")
    inputs = dict(messages=messages, bos_token=bos_token, eos_token=eos_token,
                  add_generation_prompt=add_generation_prompt)
    limit = MAX_CHARS + text_size(inputs, sys.maxsize)
    deadline = _Deadline(time_limit)
    previous = sys.gettrace()           # a debugger's or coverage's tracer, put back after
    sys.settrace(deadline)
    try:
        env = _BoundedSandbox(limit)
        pieces, size = [], 0
        for piece in env.from_string(template).generate(**inputs):
            size += len(piece)
            env.need(size, "the output")
            pieces.append(piece)
        return "".join(pieces)
    except (Exception, _Bound) as e:  # noqa: BLE001 - whatever the template does fails in one line
        raise MinferError(f"chat template failed: {_one_line(e)}") from None
    finally:
        sys.settrace(previous)
