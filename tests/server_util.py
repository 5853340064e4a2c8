"""A specengine server on a free loopback port, in a thread of the test process."""
import socket
import threading
import time
from contextlib import contextmanager

import uvicorn

from specengine import AsyncEngine, Engine
from specengine.server.app import create_app


@contextmanager
def running_server(engine: Engine, model: str):
    """Yields (base_url, AsyncEngine) while the server runs; stops it after."""
    async_engine = AsyncEngine(engine)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(create_app(async_engine, model), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", async_engine
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
