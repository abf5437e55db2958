"""An OpenAI-compatible HTTP server over one model, with continuous batching.

`minfer serve`: POST /v1/completions and /v1/chat/completions; GET /v1/models,
/health and /metrics (minfer/serve/app.py).

The process: check the flags, bind the socket (so a port in use fails before the
model loads), load and warm the model, then serve on uvicorn until SIGTERM or
Ctrl-C: the socket closes (nothing new is admitted), running requests get
--shutdown-timeout seconds to finish, then the rest is cancelled and the process
exits 0. One line on stderr says where it listens once it is ready.
"""
from __future__ import annotations

import ipaddress
import re
import signal
import socket
import sys

from ..errors import MinferError

DEFAULT_PARALLEL = 4            # llama-server's default number of slots
DEFAULT_BATCH = 512             # rows of one step (llama-server's -ub default; vLLM's max_num_batched_tokens)
DEFAULT_QUEUE = 64
UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
         "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
         "tib": 1 << 40}


def add_arguments(p) -> None:
    from ..cli import add_backend_arg, add_model_arg
    add_model_arg(p)
    add_backend_arg(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every "
                        "interface, with --api-key)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free port, printed)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require Authorization: Bearer KEY on every route but /health (401 otherwise)")
    p.add_argument("-a", "--alias", default=None, metavar="NAME",
                   help="the model's name in the API (default: the file's name without .gguf)")
    p.add_argument("-np", "--parallel", type=int, default=DEFAULT_PARALLEL, metavar="N",
                   help=f"sequences generated at once (default {DEFAULT_PARALLEL}); more requests wait")
    p.add_argument("-c", "--ctx-size", type=int, default=None, metavar="N",
                   help="context of each sequence (default: min(training context, 4096))")
    p.add_argument("--kv-memory", default=None, metavar="SIZE",
                   help="memory of the paged KV cache that all sequences share, e.g. 512MiB or 2G "
                        "(default: --parallel full contexts)")
    p.add_argument("-b", "--batch-size", type=int, default=DEFAULT_BATCH, metavar="N",
                   help=f"rows of one step's forward (default {DEFAULT_BATCH}): the decoding sequences' "
                        f"next tokens, then chunks of waiting prompts (chunked prefill)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_QUEUE, metavar="N",
                   help=f"requests that may wait for a slot (default {DEFAULT_QUEUE}); one more gets 503 "
                        f"with Retry-After")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, seconds running requests get to finish (default 30)")
    p.add_argument("--deterministic", action="store_true",
                   help="every request's text independent of the others in its batch, of how its prompt "
                        "is chunked and of the prefix cache (Engine.load's deterministic)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up after load")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress bar and no line naming the backend auto chose")


def parse_size(text: str) -> int:
    """'512MiB', '2G', '1.5 GB', '1048576' -> bytes (K, M, G, T are powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text or "")
    if not m or m.group(2).lower() not in UNITS:
        raise MinferError(f"--kv-memory {text!r}: give a size such as 512MiB, 2G or a number of bytes")
    n = int(float(m.group(1)) * UNITS[m.group(2).lower()])
    if n < 1:
        raise MinferError(f"--kv-memory {text!r}: must be at least one byte")
    return n


def check_args(args) -> None:
    """Every flag checked before anything is bound or loaded."""
    for name, v, lo in (("--parallel", args.parallel, 1), ("--batch-size", args.batch_size, 1),
                        ("--max-queue", args.max_queue, 0)):
        if v < lo:
            raise MinferError(f"{name} must be at least {lo}, got {v}")
    if not 0 <= args.port <= 65535:
        raise MinferError(f"--port must be in 0..65535, got {args.port}")
    if args.shutdown_timeout < 0:
        raise MinferError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.api_key is not None and not args.api_key.strip():
        raise MinferError("--api-key is empty")
    if args.kv_memory is not None:
        parse_size(args.kv_memory)
    if args.batch_size < args.parallel:
        raise MinferError(f"--batch-size {args.batch_size} is below --parallel {args.parallel}: a step must "
                          f"hold one row of every running sequence")


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise MinferError(f"--host {host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise MinferError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(args) -> int:
    check_args(args)
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ModuleNotFoundError as e:
        raise MinferError(f"`minfer serve` needs the serve extra ({e.name} is not installed): "
                          f"pip install 'minfer[serve]'") from None
    from pathlib import Path

    from ..cli import model_path
    from ..engine import Engine, ModelFile
    from .app import ServerState, create_app
    from .metrics import Metrics
    from .scheduler import Scheduler

    sock = _bind(args.host, args.port)
    path = model_path(args.model)
    mf = ModelFile.open(path, args.ctx_size)
    engine = Engine.from_file(mf, args.backend, progress=not args.quiet)
    engine.backend.set_deterministic(args.deterministic)
    if args.kv_memory is not None:
        probe = engine.backend.new_cache(64)
        per_pos = (probe.k.nbytes + probe.v.nbytes) // 64       # bytes of one position, all layers
        del probe
        engine.kv_tokens = max(parse_size(args.kv_memory) // per_pos, 1)
    else:
        engine.kv_tokens = args.parallel * engine.n_ctx
    if not args.no_warmup:
        engine.warmup()
    kv = engine.kv_cache                    # the paged cache the engine's calls share: the server owns them
    metrics = Metrics()
    sched = Scheduler(engine, kv, args.parallel, args.max_queue, args.batch_size, metrics)
    metrics.gauge("queue_depth", "requests waiting for a slot", sched.queue_depth)
    metrics.gauge("running_sequences", "sequences in the running batch", lambda: sched.n_running)
    metrics.gauge("kv_blocks_used", "KV cache blocks held by sequences (the pad block included)",
                  lambda: sched.kv_used)
    metrics.gauge("kv_blocks_total", "KV cache blocks", lambda: kv.pool.n_blocks)
    model_id = args.alias or Path(path).name.removesuffix(".gguf")
    state = ServerState(engine=engine, model_id=model_id, scheduler=sched, metrics=metrics, api_key=args.api_key)
    app = create_app(state)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=args.shutdown_timeout)
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    if not _loopback(args.host) and args.api_key is None:
        print(f"minfer: warning: listening on {args.host} without --api-key: anyone who can reach this "
              f"port can use the model", file=sys.stderr)
    print(f"minfer: serving {model_id} on http://{host}:{port} (backend {engine.backend.name}, "
          f"--parallel {args.parallel}, context {engine.n_ctx}, KV cache {kv.n_tokens} positions)",
          file=sys.stderr, flush=True)
    # uvicorn handles SIGTERM (graceful shutdown) and then raises it again for the
    # handler that was there before: a no-op one, so a graceful stop exits 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run(sockets=[sock])
    if not server.started:
        raise MinferError("the server did not start (see the lines above)")
    return 0
