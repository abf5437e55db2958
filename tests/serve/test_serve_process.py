"""The `minfer serve` process: its flags (bad ones one line and exit 2, before any
load), SIGTERM (nothing new admitted, the running stream finishes, exit 0), and a
soak of a few hundred requests from 16 clients (every one answered, 503s retried,
nothing lost, the resident memory flat)."""
from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")


def _serve_cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "minfer", "serve", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("args, fragment", [
    (["--parallel", "0"], "--parallel must be at least 1"),
    (["--port", "70000"], "--port must be in"),
    (["--kv-memory", "lots"], "--kv-memory 'lots'"),
    (["--max-queue", "-1"], "--max-queue must be at least 0"),
    (["--batch-size", "2", "--parallel", "4"], "below --parallel"),
    (["--api-key", " "], "--api-key is empty"),
    (["--parallel", "many"], "invalid int value"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["-m", "/nonexistent.gguf", "--port", "0"], "no such model file"),
])
def test_bad_flags_are_one_line_and_exit_2(args, fragment):
    r = _serve_cli(*args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("minfer: error: ") and fragment in r.stderr
    assert "Traceback" not in r.stderr


def test_a_port_in_use_is_one_line_before_the_model_loads(smollm2_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        t0 = time.monotonic()
        r = _serve_cli("-m", str(smollm2_path), "--backend", "cpu", "--port", str(port))
    assert r.returncode == 2 and r.stderr.startswith(f"minfer: error: cannot listen on 127.0.0.1:{port}")
    assert r.stderr.count("\n") == 1 and time.monotonic() - t0 < 30


def test_serve_help():
    r = _serve_cli("--help")
    assert r.returncode == 0
    for flag in ("--host", "--port", "--api-key", "--parallel", "--ctx-size", "--kv-memory", "--deterministic",
                 "--max-queue", "--batch-size"):
        assert flag in r.stdout


@pytest.mark.model
def test_sigterm_lets_the_running_stream_finish_and_exits_0(serve, truth):
    s = serve("--shutdown-timeout", "60")
    body = {"model": s.model, "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "stream": True}
    lines, first = [], threading.Event()

    def read():
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    first.set()
        first.set()

    t = threading.Thread(target=read, daemon=True)
    t.start()
    assert first.wait(60)
    s.proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines[:-1] if json.loads(x[6:])["choices"])
    assert text == truth.generate("Once upon a time", max_tokens=48, ignore_eos=True).text
    assert s.proc.wait(60) == 0
    with pytest.raises(httpx.TransportError):                # nothing is admitted any more
        httpx.get(s.url + "/health", timeout=5)
    assert "Traceback" not in s.stderr


@pytest.mark.model
def test_a_soak_of_many_requests_from_16_clients(serve, truth):
    """208 requests from 16 closed-loop clients against 4 slots and a queue of 4:
    every request answered with its right text (a 503 is retried after its
    Retry-After), none lost, and the memory after the first 48 is flat."""
    s = serve("--parallel", "4", "--max-queue", "4", "--kv-memory", "32MiB")
    prompts = [f"Item {k}:" for k in range(8)]
    want = {p: truth.generate(p, max_tokens=4).text for p in prompts}
    results, rejected, lock = [], [0], threading.Lock()
    rss = {}

    def client(c: int, n: int):
        with httpx.Client(base_url=s.url, timeout=60) as h:
            for i in range(n):
                p = prompts[(c + i) % len(prompts)]
                deadline = time.monotonic() + 120
                while True:
                    r = h.post("/v1/completions", json={"model": s.model, "prompt": p, "max_tokens": 4,
                                                        "temperature": 0})
                    if r.status_code != 503:
                        break
                    with lock:
                        rejected[0] += 1
                    assert time.monotonic() < deadline
                    time.sleep(float(r.headers["Retry-After"]))
                with lock:
                    results.append((p, r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text))

    t0 = time.monotonic()
    for phase, n in (("warm", 3), ("soak", 10)):
        with cf.ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda c: client(c, n), range(16), timeout=600))
        rss[phase] = s.rss_kib()
    dt = time.monotonic() - t0
    assert len(results) == 16 * 13
    bad = [(p, st, t) for p, st, t in results if st != 200 or t != want[p]]
    assert not bad, bad[:3]
    m = s.metrics()
    assert m['minfer_requests_total{outcome="ok"}'] == 208
    assert m.get('minfer_requests_total{outcome="rejected"}', 0) == rejected[0]
    assert m["minfer_running_sequences"] == 0 and m["minfer_queue_depth"] == 0 and m["minfer_kv_blocks_used"] == 1
    assert rss["soak"] - rss["warm"] < 40 * 1024, rss        # KiB: flat, within 40 MiB
    print(f"\n[soak] 208 requests in {dt:.1f} s, {rejected[0]} 503s retried, RSS {rss}")
    s.terminate()
