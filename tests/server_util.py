"""A specengine server on a free loopback port, in a thread of the test process; a ChatML template
for tiny models' tokenizers; an engine whose steps are held (requests stay where they are)."""
import socket
import threading
import time
from contextlib import contextmanager

import uvicorn

from specengine import AsyncEngine, Engine
from specengine.server.app import Server, create_app
from specengine.server.limits import ServerLimits

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def with_chat_template(engine: Engine) -> Engine:
    engine.tokenizer.chat_template = CHATML
    return engine


@contextmanager
def running_server(engine: Engine, model: str, limits: ServerLimits | None = None):
    """Yields (base_url, AsyncEngine) while the server runs; stops it after."""
    with stoppable_server(engine, model, limits=limits) as (url, async_engine, _):
        yield url, async_engine


@contextmanager
def stoppable_server(engine: Engine, model: str, grace: float | None = None, limits: ServerLimits | None = None):
    """Yields (base_url, AsyncEngine, uvicorn server) while the server runs; stops it after. With
    grace, the server is `specengine serve`'s, whose shutdown gives open requests that long; a
    test may stop it (server.should_exit = True) and join server.thread. limits: create_app's."""
    async_engine = AsyncEngine(engine)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(async_engine, model, limits), log_level="warning")
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


@contextmanager
def held_steps(engine: Engine):
    """While inside, the engine's steps do nothing: the requests added stay waiting for a row, as
    they would behind a full batch, for as long as a test needs (not for as long as a generation
    happens to last). Yields release(), which lets steps run again (leaving releases too). Hold
    before adding requests: with none running, the server's driver then waits between its idle
    steps rather than spinning."""
    engine.step = lambda: []

    def release():
        engine.__dict__.pop("step", None)  # the class's step again

    try:
        yield release
    finally:
        release()


def free_port() -> int:
    """A loopback port free now (for a server in another process: it binds the port itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
