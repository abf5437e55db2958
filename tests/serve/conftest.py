"""A real `minfer serve` process for the server tests: the CPU backend, the real
SmolLM2-135M, a free loopback port (--port 0; the port read from its ready line),
killed in teardown whatever happened. Every wait is bounded."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.importorskip("httpx")

N_CTX = 1024
READY_S = 120               # load + warm-up of SmolLM2 on 2 cores takes a few seconds
READY = re.compile(r"minfer: serving (\S+) on (http://127\.0\.0\.1:\d+)")


class Server:
    """One `minfer serve` process: .url, .model, .proc; its stderr collected by a thread."""

    def __init__(self, model_path, *flags: str, env: dict | None = None):
        cmd = [sys.executable, "-m", "minfer", "serve", "-m", str(model_path), "--backend", "cpu",
               "--host", "127.0.0.1", "--port", "0", "-c", str(N_CTX), "-q", *flags]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url = self.model = None
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(READY_S) or self.url is None:
            self.kill()
            raise AssertionError(f"minfer serve did not become ready in {READY_S} s:\n" + "".join(self.lines))

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            m = READY.search(line)
            if m:
                self.model, self.url = m.group(1), m.group(2)
                self._ready.set()
        self._ready.set()                       # the process ended

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def client(self, **kw):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "unused"), timeout=120,
                             max_retries=0, **kw)

    def metrics(self, **headers) -> dict[str, float]:
        """The unlabelled series of /metrics (and requests_total by outcome) -> {name: value}."""
        import httpx
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=30).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_metric(self, name: str, want: float, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m.get(name) == want or time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def rss_kib(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(next(line for line in f if line.startswith("VmRSS")).split()[1])

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture(scope="session")
def serve(smollm2_path):
    """-> start(*flags) -> a running Server; every server started is killed at the end."""
    started: list[Server] = []

    def start(*flags, env=None) -> Server:
        s = Server(smollm2_path, *flags, env=env)
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()


@pytest.fixture(scope="session")
def server(serve):
    """The shared server: 8 sequences at once, a small step budget (prompts chunked)."""
    return serve("--parallel", "8", "--batch-size", "64", "--kv-memory", "64MiB")


@pytest.fixture(scope="session")
def n_ctx() -> int:
    """The context every test server runs with (-c)."""
    return N_CTX


@pytest.fixture(scope="session")
def truth(smollm2_path):
    """An in-process CPU engine on the same model and context: what the server's
    answers are checked against (the engine is checked against llama.cpp elsewhere)."""
    from minfer.engine import Engine
    e = Engine.load(str(smollm2_path), backend="cpu", n_ctx=N_CTX, progress=False)
    yield e
    e.close()
