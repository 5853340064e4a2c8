"""An Engine driven by one background asyncio task, for servers: `async for out in
engine.generate_async(prompt, params)` streams a request's RequestOutputs while others join.

The driver task runs step() on the event loop's own thread and yields to the loop between steps,
where connections are accepted, outputs written and requests added or aborted; they join at the
next step, as with Engine.add_request. A step in a worker thread would keep the loop free during
it, but torch's OpenMP then keeps a second team of threads, and with more OpenMP threads than
cores libgomp stops spinning at its barriers: on a 2-core CPU every later step, on either thread,
ran 1.6x slower (66 against 41 tokens/s at batch 1). So the engine is used from one thread, the
loop's, which should be the thread that built it.

Cancelling or closing a generate_async iterator (a client that went away) aborts its request.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from ..sampling.params import SamplingParams
from .engine import Engine, Prompt
from .request import RequestOutput

log = logging.getLogger("specengine")


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._streams: dict[str, asyncio.Queue] = {}  # request id -> its outputs
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task | None = None
        self.steps = 0  # steps run so far (tests and the server's /health read it)

    async def generate_async(self, prompt: Prompt, params: SamplingParams | None = None,
                             request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as steps produce them, the last one finished. A bad request raises
        ValueError here, before anything is yielded."""
        request_id = self.add_request(prompt, params, request_id)
        async with contextlib.aclosing(self.outputs(request_id)) as outputs:  # closing this closes that
            async for output in outputs:
                yield output

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request for the next step (a bad one raises ValueError); read its outputs with
        outputs(request_id), which must be started (its finally aborts a request left unread)."""
        request_id = self.engine.add_request(prompt, params, request_id)
        self._streams[request_id] = asyncio.Queue()
        self._start_driver()
        return request_id

    async def outputs(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """The outputs of a request added with add_request. Closing or cancelling the iterator
        before the last output aborts the request."""
        queue = self._streams[request_id]
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # cancelled or closed early: free its row now
                self.abort(request_id)

    def abort(self, request_id: str) -> bool:
        """End a request now (its stream then ends with finish_reason "abort"); False if it had ended."""
        aborted = self.engine.abort(request_id)
        if aborted:
            self._start_driver()  # the next step reports it
        return aborted

    async def close(self):
        """Stop the driver; unfinished requests are aborted."""
        if self._driver is not None:
            self._driver.cancel()
            try:
                await self._driver
            except asyncio.CancelledError:
                pass
            self._driver = None
        for request_id in list(self.engine._unfinished):
            self.engine.abort(request_id)

    def _start_driver(self):
        if self._driver is None or self._driver.done():
            self._wake = asyncio.Event()
            self._driver = asyncio.get_running_loop().create_task(self._drive(), name="specengine-driver")
        self._wake.set()

    async def _drive(self):
        engine = self.engine
        while True:
            if not (engine.has_unfinished_requests() or engine.has_pending_outputs()):
                self._wake.clear()
                await self._wake.wait()
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 (the engine aborted the round's requests; keep serving)
                # Their final outputs (finish_reason "abort", the error in message) come with the next step.
                log.error("a step failed; its requests were aborted: %r", exc)
                outputs = []
            self.steps += 1
            for out in outputs:
                queue = self._streams.get(out.request_id)
                if queue is not None:  # None: its reader has gone (and aborted it)
                    queue.put_nowait(out)
            # Let the loop write the outputs and take new requests: one pass in which the readers
            # take their outputs, and one in which nothing is put. anyio (under Starlette) cancels
            # a task only while the future it awaits is pending, and retries each pass: after one
            # yield a step had always just filled the reader's queue again, so a disconnected
            # stream was never cancelled and ran to its end.
            await asyncio.sleep(0)
            await asyncio.sleep(0)
