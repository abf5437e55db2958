"""The greedy decode step on the device: one CUDA graph per KV cache, replayed one step
ahead of the host.

A step's input is a device buffer feed = [token, pos] that the kernels read (the
embedding row, RoPE, the KV store, attention), and its last launch writes the step's
greedy id into feed and advances pos (kernels/argmax.py's advance_feed). So once a
step is queued, the next one can be queued at once, before the host has read this
one's token: while the host reads token n and hands it back, the device is already
computing step n + 1 from the token it produced itself. The host-side work of a step
(Python, the copies, the wait) then overlaps the device's instead of adding to it.

The queued step (cache.queued) is used when the caller asks for exactly it (the
token the device produced, at the next position), which is what greedy generation
does; any other call (teacher forcing, a new prompt) queues a fresh step from the
given token and position. The queued step has then written the KV row of its
position, which every later use of that row overwrites before reading it (a step
stores its own row before attending; a prefill stores its rows first). No step is
queued past the cache's last position, nor across a change of graph key (the decode
attention's one-launch limit, kernels/decode_attn.py's decode_short): the next
position's graph may not exist yet.

A cache's first step runs eagerly, its second is captured (graphs.py); from the
third on, steps are replays. With graphs off (or after a failed capture) every step
runs eagerly and nothing is queued.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .graphs import Graph
from .kernels.argmax import advance_feed
from .launch import DevicePos, cp


@dataclass(eq=False)
class Queued:
    """A step on the stream: the graph key and [token, pos] it reads, and the pinned
    host slot its [id, finite] lands in once `done` has passed."""
    key: object
    token: int | None           # None until the id of the step before it is read
    pos: int
    host: np.ndarray            # pinned int32 (2,)
    done: object                # cupy Event


class DecodeIO:
    """A cache's pinned host buffers: the [token, pos] a fresh step starts from, and
    two result slots used in turn (the queued step must not overwrite the
    slot of the step being read). Each is rewritten only after the copy that used
    it has been waited for."""

    def __init__(self):
        self._feed_mem = cp.cuda.alloc_pinned_memory(8)
        self.feed = np.frombuffer(self._feed_mem, np.int32, 2)                  # (2,)
        self._slot_mem = [cp.cuda.alloc_pinned_memory(8) for _ in range(2)]
        self.slots = [np.frombuffer(m, np.int32, 2) for m in self._slot_mem]    # 2 x (2,)
        self.turn = 0

    def next_slot(self) -> np.ndarray:
        self.turn ^= 1
        return self.slots[self.turn]


class DecodeRunner:
    """decode(cache, step, token, pos, key_of) for one backend; `graphs` is its
    GraphRunner, `use_graphs()` says whether graphs are on now."""

    def __init__(self, graphs, use_graphs):
        self.graphs, self.use_graphs = graphs, use_graphs

    def decode(self, cache, step, token: int, pos: int, key_of) -> tuple[int, bool]:
        """step(tokens (1,), DevicePos) -> argmax's [id, finite] on the device ->
        (id, finite) of the step at (token, pos). cache: a CudaCache (its graphs,
        queued step and io); key_of(pos): the graph key of a step at pos (the steps of one
        key replay one graph)."""
        key = key_of(pos)

        def fn(feed):
            out = step(feed[0:1], DevicePos(pos, feed[1:2]))
            advance_feed(out, feed)
            return out

        rec = cache.graphs.get(key)
        if not (self.use_graphs() and isinstance(rec, Graph)):      # eager, or the capture
            cache.queued = None
            feed = cp.asarray(np.array([token, pos], dtype=np.int32))            # (2,)
            out = self.graphs.run(cache.graphs, key, fn, feed) if self.use_graphs() else fn(feed)
            nxt, finite = (int(v) for v in out.get())
            return nxt, bool(finite)
        io = cache.io = cache.io or DecodeIO()
        stream = cp.cuda.get_current_stream()
        queued = cache.queued
        if queued is not None and (queued.key, queued.token, queued.pos) == (key, token, pos):
            cur = queued
        else:
            io.feed[:] = (token, pos)
            rec.inp.set(io.feed, stream=stream)
            cur = self._queue(rec, io, stream, key, token, pos)
        nxt_pos = pos + 1
        cache.queued = (self._queue(rec, io, stream, key, None, nxt_pos)
                        if nxt_pos < cache.n_ctx and key_of(nxt_pos) == key else None)
        cur.done.synchronize()
        nxt, finite = int(cur.host[0]), bool(cur.host[1])
        if cache.queued is not None:
            cache.queued.token = nxt
        return nxt, finite

    def _queue(self, rec: Graph, io: DecodeIO, stream, key, token: int | None, pos: int) -> Queued:
        """Replay the step graph on its feed as it stands; its [id, finite] copied
        to the next pinned slot without waiting."""
        out = self.graphs.replay(rec)
        host = io.next_slot()
        out.get(stream=stream, out=host)
        done = cp.cuda.Event()
        done.record(stream)
        return Queued(key, token, pos, host, done)
