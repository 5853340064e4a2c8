"""A specengine server on a free loopback port, in a thread of the test process."""
import socket
import threading
import time
from contextlib import contextmanager

import uvicorn

from specengine import AsyncEngine, Engine
from specengine.server.app import Server, create_app


@contextmanager
def running_server(engine: Engine, model: str):
    """Yields (base_url, AsyncEngine) while the server runs; stops it after."""
    with stoppable_server(engine, model) as (url, async_engine, _):
        yield url, async_engine


@contextmanager
def stoppable_server(engine: Engine, model: str, grace: float | None = None):
    """Yields (base_url, AsyncEngine, uvicorn server) while the server runs; stops it after. With
    grace, the server is `specengine serve`'s, whose shutdown gives open requests that long; a
    test may stop it (server.should_exit = True) and join server.thread."""
    async_engine = AsyncEngine(engine)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(async_engine, model), log_level="warning")
    uv = uvicorn.Server(config) if grace is None else Server(config, async_engine, grace)
    uv.thread = threading.Thread(target=uv.run, kwargs=dict(sockets=[sock]), daemon=True)
    uv.thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline and uv.thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", async_engine, uv
    finally:
        uv.should_exit = True
        uv.thread.join(timeout=30)
