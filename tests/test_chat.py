"""The bounded chat-template sandbox (minfer/text/chat.py) beyond what the CLI fuzz cases
show: the bounds hold off the main thread, leave the caller's tracer in place, and
scale with the messages, so a long prompt still renders."""
from __future__ import annotations

import sys
import threading

import pytest

from minfer.text.chat import MAX_CHARS, apply_chat_template
from minfer.errors import MinferError

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_renders_the_messages():
    out = apply_chat_template(TEMPLATE, [{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_the_time_bound_holds_in_any_thread():
    got = {}

    def render():
        try:
            apply_chat_template(LOOPS, [], time_limit=0.2)
        except MinferError as e:
            got["error"] = str(e)
    t = threading.Thread(target=render)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive() and "longer than 0.2 s" in got["error"]


def test_the_callers_tracer_is_put_back():
    def tracer(frame, event, arg):
        return None
    sys.settrace(tracer)
    try:
        with pytest.raises(MinferError):
            apply_chat_template("{{ 1/0 }}", [])
        apply_chat_template(TEMPLATE, [])
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)


def test_the_size_bound_is_beyond_the_messages_own_text():
    long = "x" * (2 * MAX_CHARS)                   # a long prompt file with --chat
    out = apply_chat_template(TEMPLATE, [{"role": "user", "content": long}])
    assert len(out) > len(long)
    with pytest.raises(MinferError, match="more than the"):        # the template may not add as much
        apply_chat_template(TEMPLATE + "{{ 'y' * " + str(MAX_CHARS + 100) + " }}", [])
