"""Stop strings for streamed text (OpenAI's `stop`, llama.cpp's antiprompts).

Text arrives piece by piece (whatever the stream decoder released: whole str
characters, so a multi-byte character is never split here). A stop string may
span any number of pieces, so the tail of what has arrived that could still
grow into a stop string is held back until it either completes one or cannot.

Which occurrence ends the text, a function of the whole text alone (not of how
it was split into pieces):

    the one that starts earliest; of stop strings that start at the same place,
    the shortest (it is complete first, and the text emitted is the same either
    way: everything before that place).

The stop string itself is not emitted (OpenAI's API does the same). Starting
earliest beats completing first: with stops "abcd" and "bc", the text "abcd"
ends before "a" (at "abcd"), not after it (at "bc"), so once "abc" has arrived
the matcher waits for one more character before it decides. `stopped` turns
True as soon as the decision is certain, never later.
"""
from __future__ import annotations

from ..errors import MinferError


def _checked(stops) -> tuple[str, ...]:
    """stops as a tuple of distinct non-empty strings, in the order given."""
    if stops is None:
        return ()
    if isinstance(stops, str):
        stops = [stops]
    if not isinstance(stops, (list, tuple)):
        raise MinferError(f"stop: expected a string or a list of strings, got {type(stops).__name__}")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise MinferError(f"stop: each stop string must be non-empty text, got {s!r}")
    return tuple(dict.fromkeys(stops))


class StopMatcher:
    """Streams text pieces through, holding back any tail that could be the start
    of a stop string, and ends at the first occurrence of any stop string (the stop
    string itself is not emitted, as OpenAI's API does).

    None or an empty list makes a matcher that never stops (every piece is emitted
    whole). No limit on the number of stop strings (OpenAI allows 4, llama.cpp any;
    a server may enforce its own); a push costs about (held + piece) x stops.
    """

    def __init__(self, stops: list[str] | tuple[str, ...] | str | None):
        self._stops = _checked(stops)
        # every proper prefix of a stop string: a tail equal to one may still grow into it
        self._prefixes = {s[:k] for s in self._stops for k in range(1, len(s))}
        self._longest = max(map(len, self._stops), default=0)
        self._held = ""                   # arrived, not yet emitted; shorter than _longest
        self._matched: str | None = None

    @property
    def stops(self) -> tuple[str, ...]:
        return self._stops

    @property
    def stopped(self) -> bool:
        """True once a stop string has ended the text: stop generating."""
        return self._matched is not None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, None until then (and if none did)."""
        return self._matched

    def push(self, piece: str) -> str:
        """The text safe to emit now, given one more piece ("" after a stop)."""
        if self._matched is not None:
            return ""
        if not self._stops:
            return piece
        return self._scan(self._held + piece, final=False)

    def flush(self) -> str:
        """At the end of generation: what was held back, cut before a stop string
        it completes (one that was waiting on an earlier candidate that never came)."""
        if self.stopped:
            return ""
        return self._scan(self._held, final=True)

    def _scan(self, text: str, final: bool) -> str:
        # the earliest complete occurrence, the shortest at equal start
        best = None
        for s in self._stops:
            i = text.find(s)
            if i >= 0 and (best is None or (i, len(s)) < (best[0], len(best[1]))):
                best = (i, s)
        end = best[0] if best is not None else len(text)
        # the earliest place before `end` where the rest could still become a stop
        # string; every occurrence starting before it is already complete (none)
        hold = end if final else self._partial_start(text, end)
        if best is not None and hold == end:
            self._held, self._matched = "", best[1]
            return text[:end]
        self._held = text[hold:]
        return text[:hold]

    def _partial_start(self, text: str, end: int) -> int:
        for j in range(max(0, len(text) - self._longest + 1), end):
            if text[j:] in self._prefixes:
                return j
        return end
