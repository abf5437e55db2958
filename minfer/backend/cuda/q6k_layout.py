"""The q6_K device layout of the CUDA backend, on the host (pure NumPy, no cupy).

- Padded blocks: each 210-byte q6_K super-block is stored at a 224-byte stride
  (14 zero bytes after it), so every super-block starts 16-byte aligned and the
  kernels can move it with 16-byte loads.
- The W_exp plane: the dense centered int8 form of a q6_K weight,
  element (j, 256*sb + e) = (ql | qh<<4) - 32 of super-block sb of row j, row
  stride = the input dimension (not the padded row length), super-block stride
  256. The MMQ kernel stages it with plain cp.async copies; the scales and d
  stay in the padded blocks.
"""
from __future__ import annotations

import numpy as np

from ...errors import MinferError
from ...format.quants import Q6K_BLOCK, QK_K, for_each_chunk, q6k_centered

Q6K_PADDED = 224                           # 210 rounded up to a multiple of 16
_CHUNK_BLOCKS = 4096                       # super-blocks per expansion chunk


def pad_q6k(raw: np.ndarray) -> np.ndarray:
    """raw uint8 (rows, nb*210) q6_K rows -> (rows, nb*224): each super-block keeps
    its 210 bytes and gets 14 zero bytes, so super-blocks start 16-byte aligned."""
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % Q6K_BLOCK:
        raise MinferError(f"pad_q6k: expected uint8 (rows, nb*{Q6K_BLOCK}), got "
                          f"{raw.dtype} {raw.shape}")
    rows, nb = raw.shape[0], raw.shape[1] // Q6K_BLOCK
    out = np.zeros((rows, nb, Q6K_PADDED), np.uint8)                   # (rows, nb, 224)
    out[:, :, :Q6K_BLOCK] = raw.reshape(rows, nb, Q6K_BLOCK)
    return out.reshape(rows, nb * Q6K_PADDED)


def expand_q6k_dense(padded: np.ndarray, od: int, id: int) -> np.ndarray:
    """padded q6_K (od, id/256*224) uint8 (or flat) -> W_exp int8 (od, id):
    element (j, 256*sb + e) = (ql | qh<<4) - 32 of super-block sb of row j.
    Dense: row stride id, not the padded row length."""
    if od <= 0 or id <= 0 or id % QK_K:
        raise MinferError(f"expand_q6k_dense: id={id} must be a positive multiple of {QK_K} (od={od})")
    nb = id // QK_K
    padded = np.asarray(padded)
    if padded.dtype != np.uint8 or padded.size != od * nb * Q6K_PADDED:
        raise MinferError(f"expand_q6k_dense: expected {od * nb * Q6K_PADDED} uint8 bytes "
                          f"for ({od}, {id}), got {padded.dtype} {padded.shape}")
    blocks = padded.reshape(od * nb, Q6K_PADDED)                       # (od*nb, 224)
    out = np.empty((od * nb, QK_K), np.int8)                           # (od*nb, 256) == (od, id)
    step = _CHUNK_BLOCKS

    def work(b0: int) -> None:
        blk = blocks[b0:b0 + step]
        out[b0:b0 + step] = q6k_centered(blk[:, 0:128], blk[:, 128:192])

    for_each_chunk(work, range(0, od * nb, step))
    return out.reshape(od, id)
