"""GET /metrics: the server's counters, gauges and histograms in Prometheus's text
format (version 0.0.4), written here rather than through prometheus_client: a
dozen series do not need a dependency.

Counters only grow (since the server started); gauges are read when scraped
(queue depth, running sequences, KV blocks); histograms have cumulative `le`
buckets, a `_sum` and a `_count`. Updated from the scheduler thread and the request
handlers, so every update and the scrape hold one lock.
"""
from __future__ import annotations

import math
import threading
from typing import Callable

PREFIX = "minfer_"
# seconds: from a few milliseconds (a GPU decode step) to a minute (a long CPU prefill)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Histogram:
    def __init__(self, buckets):
        self.bounds = tuple(buckets)
        self.counts = [0] * len(self.bounds)        # per bucket, not cumulative
        self.sum, self.count = 0.0, 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.bounds):
            if v <= b:
                self.counts[i] += 1
                break
        self.sum += v
        self.count += 1


class Metrics:
    """What /metrics reports. gauges: name -> (help, a function read at scrape time)."""

    COUNTERS = {
        "requests_total": "requests finished, by outcome (ok, cancelled, error, rejected)",
        "prompt_tokens_total": "prompt tokens of the requests admitted",
        "prompt_tokens_cached_total": "prompt tokens taken from the prefix cache (not prefilled)",
        "generation_tokens_total": "tokens generated",
    }

    def __init__(self):
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, tuple], float] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.gauges: dict[str, tuple[str, Callable[[], float]]] = {}

    def inc(self, name: str, v: float = 1, **labels) -> None:
        assert name in self.COUNTERS, name
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + v

    def observe_ttft(self, s: float) -> None:
        with self._lock:
            self.ttft.observe(s)

    def observe_itl(self, s: float) -> None:
        with self._lock:
            self.itl.observe(s)

    def gauge(self, name: str, help_: str, read: Callable[[], float]) -> None:
        self.gauges[name] = (help_, read)

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            for name, help_ in self.COUNTERS.items():
                full = PREFIX + name
                lines += [f"# HELP {full} {help_}", f"# TYPE {full} counter"]
                series = [(lab, v) for (n, lab), v in sorted(self._counters.items()) if n == name]
                for lab, v in series or [((), 0)]:
                    lines.append(f"{full}{_labels(lab)} {_num(v)}")
            for name, h, help_ in (("time_to_first_token_seconds", self.ttft,
                                    "from a request's arrival to its first generated token"),
                                   ("inter_token_latency_seconds", self.itl,
                                    "between consecutive generated tokens of a request")):
                full = PREFIX + name
                lines += [f"# HELP {full} {help_}", f"# TYPE {full} histogram"]
                cum = 0
                for b, c in zip(h.bounds, h.counts):
                    cum += c
                    lines.append(f'{full}_bucket{{le="{_num(b)}"}} {cum}')
                lines.append(f'{full}_bucket{{le="+Inf"}} {h.count}')
                lines += [f"{full}_sum {_num(h.sum)}", f"{full}_count {h.count}"]
        for name, (help_, read) in self.gauges.items():
            full = PREFIX + name
            lines += [f"# HELP {full} {help_}", f"# TYPE {full} gauge", f"{full} {_num(read())}"]
        return "\n".join(lines) + "\n"


def _labels(lab: tuple) -> str:
    if not lab:
        return ""
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in lab)
    return "{" + inner + "}"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 2**53):
        return str(int(v))
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))
