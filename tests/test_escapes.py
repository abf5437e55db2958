"""Escape processing of -p (minfer/text/escapes.py), case by case against llama.cpp's
rules; the fixture texts given to llama-tokenize are checked in test_tokenizer.py
and, through the command line, in test_front_door.py."""
from __future__ import annotations

import pytest

from minfer.text.escapes import process_escapes


@pytest.mark.parametrize("given, want", [
    (rb"a\nb", b"a\nb"),
    (rb"\r\t", b"\r\t"),
    (rb"\'\"", b"'\""),
    (rb"x\\y", b"x\\y"),
    (rb"\\n", b"\\n"),                    # an escaped backslash, then a plain n
    (rb"\\\n", b"\\\n"),                  # an escaped backslash, then a newline escape
    (rb"\x41\x7a", b"Az"),
    (rb"\xc3\xa9t\xc3\xa9", "été".encode()),      # bytes: two escapes make one character
    (rb"\x4", rb"\x4"),                   # too short: kept as written
    (rb"\x4g", rb"\x4g"),                 # not two hex digits: kept
    (rb"\X41", rb"\X41"),                 # only a lower-case x
    (rb"\q\a\0", rb"\q\a\0"),             # unknown escapes are kept, backslash included
    (b"end\\", b"end\\"),                 # a trailing backslash is kept
    (b"\\\n", b"\\\n"),                   # a backslash before a real newline is kept
    ("\\é".encode(), "\\é".encode()),      # before a multibyte character: kept whole
    (b"", b""),
])
def test_escape_rules(given, want):
    assert process_escapes(given) == want


def test_plain_text_is_unchanged():
    text = "def f(x):\n\treturn x  # no backslash here: ünïcode 😀".encode()
    assert process_escapes(text) == text
