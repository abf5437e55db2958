"""kernels/argmax.cu: the greedy step on the device.

    argmax        greedy id and an all-finite flag, one block
    advance_feed  a decode step's [token, pos] input <- [its id, pos + 1]
"""
from __future__ import annotations

import numpy as np

from ..launch import check, cp, kernel, out_array
from ..nvrtc import K


def argmax(logits, out=None):
    """logits f32 (1, n) or (n,) -> int32 (2,) on the device: [the first index of the
    maximum, 1 if every logit is finite else 0]"""
    check(logits, "argmax logits", cp.float32)
    out = out_array(out, (2,), "argmax out", cp.int32)
    kernel("argmax.cu", "argmax_f32")((1,), (K["ARGMAX_THREADS"],), (logits, np.int32(logits.size), out))
    return out


def advance_feed(out, feed) -> None:
    """out int32 (2,) (argmax's [id, finite]), feed int32 (2,) [token, pos] on the
    device -> feed = [id, pos + 1]: the input of the next decode step"""
    check(out, "advance_feed out", cp.int32, (2,))
    check(feed, "advance_feed feed", cp.int32, (2,))
    kernel("argmax.cu", "advance_feed")((1,), (1,), (out, feed))
