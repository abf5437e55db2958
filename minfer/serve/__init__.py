"""`minfer serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over one
engine, with continuous batching (docs/DESIGN.md, the server).

    protocol.py   the request bodies, after OpenAI's schemas (pydantic), and the
                  sampling parameters they map to
    errors.py     OpenAI-style JSON errors: {"error": {"message", "type", "param", "code"}}
    scheduler.py  the one thread that owns the engine: admission, BatchRunner steps,
                  events back to the requests
    metrics.py    the Prometheus text of GET /metrics
    sse.py        server-sent events
    app.py        the FastAPI app: routes, the API key, the body limit
    server.py     the process: bind, load, serve, SIGTERM

Nothing here is imported by the rest of minfer: fastapi and uvicorn are the
`serve` extra (pip install 'minfer[serve]').
"""
