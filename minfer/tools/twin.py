"""`minfer twin`: write the 7B benchmark model (the real header + synthetic tensor data).

The twin is the real DeepSeek-R1-Distill-Qwen-7B Q4_K_M header (every metadata
pair and the whole tensor table, byte for byte) followed by synthetic tensor
data at the header's offsets.

Kernels see the real shapes, types and alignment, so throughput on the twin is
the real model's throughput (models/README.md). The tensor data are the
project's quantizers (fast mode) applied to seeded Gaussian values drawn by
`minfer.tools.synth.draw_rows` (norms near 1, small biases, linears std 1/sqrt(n_in)).

How: the header bytes are copied verbatim (so metadata order, value types and
the tensor table are identical by construction), the file is extended to its
full size, and worker processes each draw + quantize a block-aligned row chunk
of one tensor and `os.pwrite` it at its offset — no tensor is ever whole in
memory and the parent never touches tensor data. Afterwards `verify_twin`
re-opens the file with minfer.format.gguf, compares the table with the header's, and
dequantizes random rows with gguf.quants against a fresh draw.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np

from ..errors import MinferError
from .synth import draw_rows, header_7b_path, rows_per_draw_block, tensor_bytes

TWIN_NAME = "deepseek-r1-distill-qwen-7b-q4_k_m.twin.gguf"
CHUNK_ELEMENTS = 1 << 24      # ~16M values per job: 64 MB of float32 per worker at a time

# relative RMS error of a dequantized row vs the drawn row that verification
# accepts (Gaussian data, fast quantizers: q4_K ~0.08, q6_K ~0.02)
TOLERANCE = {"F32": 0.0, "F16": 1e-3, "Q8_0": 0.01, "Q6_K": 0.04, "Q4_K": 0.12}


def default_output() -> Path:
    from ..pull import models_dir
    return models_dir() / TWIN_NAME


def file_size(hdr) -> int:
    """Bytes of the complete file: the end of the last tensor (offsets are absolute)."""
    return max(t.offset + t.nbytes for t in hdr.tensors.values())


def jobs_for(hdr, names, seed: int) -> list[tuple]:
    """(name, shape, qtype, seed, row0, row1, file_offset) per block-aligned row chunk,
    largest first (so the pool ends on small jobs)."""
    jobs = []
    for name in names:
        t = hdr.tensors[name]
        n_cols = t.shape[-1]
        rb = rows_per_draw_block(n_cols)
        step = max(1, CHUNK_ELEMENTS // (rb * n_cols)) * rb          # whole draw blocks
        for r0 in range(0, t.n_rows, step):
            r1 = min(r0 + step, t.n_rows)
            jobs.append((name, t.shape, t.qtype, seed, r0, r1, t.offset + r0 * t.row_bytes))
    jobs.sort(key=lambda j: -(j[5] - j[4]) * j[1][-1])
    return jobs


_fd = -1


def _open_out(path: str, single_threaded: bool = False) -> None:
    global _fd
    _fd = os.open(path, os.O_WRONLY)
    if single_threaded:
        # the process pool is the parallelism: the thread pool that quantize
        # chunks through (quants.for_each_chunk, up to 8 threads per call) would
        # oversubscribe the cores 8x
        from ..format import quants
        quants.set_threads(1)


def _fill(job) -> int:
    """Draw, quantize and write one row chunk -> bytes written."""
    name, shape, qtype, seed, r0, r1, off = job
    data = tensor_bytes(name, shape, qtype, seed, r0, r1)        # (r1-r0, row_bytes) uint8
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):                                       # pwrite may write less
        done += os.pwrite(_fd, view[done:], off + done)
    return done


def make_twin(header_path=None, out_path=None, seed: int = 0, workers: int | None = None,
              tensors=None, progress: bool = True, verify: bool = True) -> Path:
    """Write the twin of `header_path` (default: the bundled 7B header) -> out_path.

    tensors: names to fill (default: all). A partial fill leaves the other tensors'
    bytes zero (the file is still complete and valid: zero k-quant blocks have d = 0);
    it exists for tests. Written to OUT.part, verified, then renamed.
    """
    from ..format.gguf import open_gguf
    from ..progress import bar as progress_bar

    header_path = Path(header_path) if header_path is not None else header_7b_path()
    out_path = Path(out_path) if out_path is not None else default_output()
    workers = (os.cpu_count() or 1) if workers is None else workers
    if workers < 1:
        raise MinferError(f"--workers must be at least 1, got {workers}")
    hdr = open_gguf(str(header_path), header_only=True)
    names = list(hdr.tensors) if tensors is None else list(tensors)
    missing = [n for n in names if n not in hdr.tensors]
    if missing:
        raise MinferError(f"{header_path}: no tensor named {missing[0]}")
    size = file_size(hdr)
    with open(header_path, "rb") as f:
        head = f.read(hdr.data_offset)
    if len(head) != hdr.data_offset:
        raise MinferError(f"{header_path}: shorter ({len(head)} bytes) than its own header "
                          f"({hdr.data_offset} bytes)")

    out_path.parent.mkdir(parents=True, exist_ok=True)
    part = out_path.with_name(out_path.name + ".part")
    with open(part, "wb") as f:
        f.write(head)                   # metadata + tensor table, verbatim
        f.truncate(size)                # tensor data: zero until filled (sparse where supported)

    jobs = jobs_for(hdr, names, seed)
    total = sum((j[5] - j[4]) * hdr.tensors[j[0]].row_bytes for j in jobs)
    bar = progress_bar(enabled=progress, total=total, unit="B", unit_scale=True, desc="twin")
    if workers == 1 or len(jobs) == 1:
        _open_out(str(part))
        try:
            for j in jobs:
                bar.update(_fill(j))
        finally:
            os.close(_fd)
    else:
        # fork: workers inherit the imported modules; each opens the file once
        with mp.get_context("fork").Pool(min(workers, len(jobs)), _open_out, (str(part), True)) as pool:
            for n in pool.imap_unordered(_fill, jobs):
                bar.update(n)
    bar.close()
    hdr.close()

    if verify:
        verify_twin(part, header_path, seed, filled=names)
    os.replace(part, out_path)
    return out_path


def verify_twin(path, header_path, seed: int, filled=None, n_rows: int = 6) -> None:
    """Raise MinferError unless `path` opens, has the header's exact metadata and
    tensor table, and random rows of filled tensors dequantize (gguf.quants) close to
    a fresh draw while unfilled tensors are zero."""
    import gguf

    from ..format.gguf import open_gguf

    hdr = open_gguf(str(header_path), header_only=True)
    tw = open_gguf(str(path))
    try:
        if list(tw.metadata.items()) != list(hdr.metadata.items()):
            raise MinferError(f"{path}: metadata differs from {header_path}")
        tab = lambda g: [(t.name, t.qtype, t.shape, t.offset, t.nbytes) for t in g.tensors.values()]
        if tab(tw) != tab(hdr) or tw.alignment != hdr.alignment or tw.data_offset != hdr.data_offset:
            raise MinferError(f"{path}: tensor table differs from {header_path}")
        if os.path.getsize(path) != file_size(hdr):
            raise MinferError(f"{path}: {os.path.getsize(path)} bytes, expected {file_size(hdr)}")
        filled = set(tw.tensors) if filled is None else set(filled)
        rng = np.random.default_rng(seed + 1)
        names = sorted(filled)
        picks = [names[i] for i in rng.choice(len(names), size=min(n_rows, len(names)), replace=False)]
        for name in picks:
            t = tw.tensors[name]
            r = int(rng.integers(t.n_rows))
            got = gguf.quants.dequantize(np.asarray(tw.raw(name)[r]), t.qtype)     # (n_cols,)
            rb = rows_per_draw_block(t.shape[-1])
            b0 = r - r % rb
            want = draw_rows(name, t.shape, seed, b0, min(b0 + rb, t.n_rows))[r - b0]
            err = float(np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want ** 2)))
            if not np.isfinite(got).all() or err > TOLERANCE[t.qtype.name] + 1e-7:
                raise MinferError(f"{path}: {name} row {r} does not match its draw "
                                  f"(relative error {err:.3g})")
        for name in [n for n in tw.tensors if n not in filled][:n_rows]:
            if np.asarray(tw.raw(name)[0]).any():
                raise MinferError(f"{path}: {name} was not to be filled but is not zero")
    finally:
        tw.close()
        hdr.close()


# --- the command ----------------------------------------------------------------

def add_arguments(p) -> None:
    p.add_argument("-o", "--output", default=None,
                   help=f"output file (default: $MINFER_HOME/models/{TWIN_NAME}, "
                        f"MINFER_HOME defaulting to ~/.cache/minfer)")
    p.add_argument("--header", default=None, help="GGUF header to copy (default: the bundled 7B header)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights (default 0)")
    p.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def main(args) -> int:
    t0 = time.perf_counter()
    out = make_twin(args.header, args.output, seed=args.seed, workers=args.workers,
                    progress=not args.quiet)
    print(f"{out}: {os.path.getsize(out):,} bytes, written and verified in "
          f"{time.perf_counter() - t0:.1f} s")
    return 0
