"""minfer/text/stops.py: stop strings in streamed text, against the text cut before
the earliest occurrence, on random texts split at random, and the moment of stopping
against a brute-force rule written from its definition. CPU only."""
from __future__ import annotations

import random

import pytest

from minfer.errors import MinferError
from minfer.text.stops import StopMatcher


def _run(stops, pieces):
    """Everything emitted (pushes, then flush), and the matcher."""
    m = StopMatcher(stops)
    out = [m.push(p) for p in pieces]
    return "".join(out) + m.flush(), m


def _want(text, stops):
    """text cut before the earliest occurrence, and the stop there (shortest at equal start)."""
    hits = [(text.find(s), len(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    i, _, s = min(hits)
    return text[:i], s


def _first_certain(text, stops):
    """The least p such that text[:p] settles the stop: it holds an occurrence and no
    earlier start could still grow into a stop string. None if never."""
    prefixes = {s[:k] for s in stops for k in range(1, len(s))}
    for p in range(len(text) + 1):
        head, s = _want(text[:p], stops)
        if s is not None and not any(text[j:p] in prefixes for j in range(len(head))):
            return p
    return None


@pytest.mark.parametrize("stops", [None, [], ()])
def test_no_stops_passes_everything_through(stops):
    m = StopMatcher(stops)
    assert [m.push(p) for p in ["a", "", "bc", "\n"]] == ["a", "", "bc", "\n"]
    assert m.flush() == "" and not m.stopped and m.matched is None


@pytest.mark.parametrize("bad", ["", [""], ["a", ""], [1], ["a", None], 5, {"a"}, [b"a"]])
def test_bad_stops_are_one_line_errors(bad):
    with pytest.raises(MinferError, match="^stop: ") as e:
        StopMatcher(bad)
    assert "\n" not in str(e.value)


def test_a_single_string_is_one_stop_and_duplicates_collapse():
    assert StopMatcher("END").stops == ("END",)
    assert StopMatcher(["a", "b", "a"]).stops == ("a", "b")


def test_text_before_the_stop_in_the_same_piece_is_emitted():
    m = StopMatcher(["STOP"])
    assert m.push("hello STOP world") == "hello "
    assert m.stopped and m.matched == "STOP"
    assert m.push("more") == "" and m.push("STOP") == "" and m.flush() == ""


def test_a_stop_split_one_character_at_a_time():
    m = StopMatcher(["</s>"])
    got = [m.push(c) for c in "ab</s>cd"]
    assert got == ["a", "b", "", "", "", "", "", ""] and m.stopped and m.matched == "</s>"


def test_a_held_tail_that_is_not_a_stop_is_released():
    m = StopMatcher(["</s>"])
    assert m.push("a<") == "a" and m.push("/") == "" and m.push("x") == "</x"
    assert m.push("<") == "" and not m.stopped and m.flush() == "<"


def test_at_equal_start_the_shortest_wins_whatever_the_split():
    for pieces in (["xxabcyy"], list("xxabcyy"), ["xxa", "bc", "yy"]):
        text, m = _run(["abc", "ab"], pieces)
        assert text == "xx" and m.matched == "ab"


def test_the_earliest_start_wins_over_the_first_completed():
    m = StopMatcher(["abcd", "bc"])
    assert m.push("xab") == "x" and m.push("c") == "" and not m.stopped   # "abcd" may come
    assert m.push("d") == "" and m.stopped and m.matched == "abcd"
    m = StopMatcher(["abcd", "bc"])
    assert m.push("xabc") == "x" and m.push("e") == "a" and m.matched == "bc"


def test_flush_cuts_before_a_stop_still_waiting_on_an_earlier_candidate():
    m = StopMatcher(["abcd", "bc"])
    assert m.push("xabc") == "x" and not m.stopped
    assert m.flush() == "a" and m.stopped and m.matched == "bc"


def test_unicode_stops():
    stop = "こんにちは🙂"
    m = StopMatcher([stop, "é\n"])
    got = [m.push(c) for c in "日本語こんにちはこんにちは🙂後"]
    assert "".join(got) == "日本語こんにちは" and m.matched == stop
    assert _run(["é\n"], ["caf", "é", "\n", "x"])[0] == "caf"


def test_a_stop_that_is_the_whole_text_or_its_start():
    assert _run(["abc"], ["abc"])[0] == "" and _run(["abc"], list("abc"))[1].matched == "abc"
    assert _run(["ab"], ["a", "b", "c"])[0] == ""


def _random_case(rng):
    alphabet = "ab c\né日🙂"[: rng.randint(2, 9)]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    stops = []
    for _ in range(rng.randint(1, 4)):
        if text and rng.random() < 0.8:                          # drawn from the text: it occurs
            i = rng.randrange(len(text))
            stops.append(text[i:i + rng.randint(1, 6)])
        else:
            stops.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))))
    cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, 12)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    return text, stops, pieces


def test_random_texts_and_splits_against_the_cut_text():
    rng = random.Random(1234)
    for _ in range(3000):
        text, stops, pieces = _random_case(rng)
        want, which = _want(text, stops)
        m = StopMatcher(stops)
        longest, fed, emitted = max(map(len, stops)), "", ""
        for p in pieces:
            emitted += m.push(p)
            fed += p
            assert want.startswith(emitted)                     # never emits past the cut
            if not m.stopped:
                assert len(fed) - len(emitted) < longest        # holds back only a possible stop
        emitted += m.flush()
        assert emitted == want, (text, stops, pieces)
        assert m.stopped == (which is not None) and m.matched == which


def test_one_character_at_a_time_stops_as_soon_as_it_is_certain():
    rng = random.Random(99)
    for _ in range(2000):
        text, stops, _ = _random_case(rng)
        m = StopMatcher(stops)
        when = None
        for p in range(1, len(text) + 1):
            m.push(text[p - 1])
            if m.stopped:
                when = p
                break
        assert when == _first_certain(text, stops), (text, stops)
