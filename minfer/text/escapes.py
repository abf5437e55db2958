"""llama.cpp's escape processing of a prompt given on the command line.

llama.cpp's tools (llama-cli, llama-completion, llama-tokenize) rewrite escape
sequences in `-p` by default (common's `string_process_escapes`; `--no-escape`
turns it off), so `-p 'a\\nb'` is three characters with a real newline. minfer
does the same to `-p`, with the same rules, so the same command line gives the
same tokens:

    \\n \\r \\t    newline, carriage return, tab
    \\' \\" \\\\     the quote or backslash itself
    \\xHH        the byte 0xHH (two hex digits): bytes, so \\xc3\\xa9 is "é"

Any other backslash (\\q, \\x4 at the end, a trailing backslash) stays as written,
the character after it included. One difference: llama.cpp reads the two \\x
characters with strtol, which also takes " 5" or "-1"; here only two hex digits
make a \\xHH escape.
"""
from __future__ import annotations

import re

# one escape: \xHH, or a backslash and any one byte (newline included)
_ESCAPE = re.compile(rb"\\(x[0-9A-Fa-f]{2}|.)", re.DOTALL)
_SIMPLE = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"'": b"'", b'"': b'"', b"\\": b"\\"}


def _one(m: re.Match) -> bytes:
    e = m.group(1)
    if len(e) == 3:                         # xHH
        return bytes([int(e[1:], 16)])
    return _SIMPLE.get(e, m.group(0))       # unknown: the backslash and the byte, kept


def process_escapes(data: bytes) -> bytes:
    """The UTF-8 bytes of a prompt with its escape sequences processed (left to
    right, each backslash read once: `\\\\n` is a backslash and an n)."""
    return _ESCAPE.sub(_one, data)
