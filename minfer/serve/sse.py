"""Server-sent events as OpenAI's streaming endpoints write them: each event one
`data: <json>` line and a blank line, the stream ended by `data: [DONE]`."""
from __future__ import annotations

import json

DONE = b"data: [DONE]\n\n"


def event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"
