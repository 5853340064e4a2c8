"""An Engine driven by one background asyncio task, for servers: `async for out in
engine.generate_async(prompt, params)` streams a request's RequestOutputs while others join.

The driver task runs step() on the event loop's own thread and yields to the loop between steps,
where connections are accepted, outputs written and requests added or aborted; they join at the
next step, as with Engine.add_request. A step in a worker thread would keep the loop free during
it, but torch's OpenMP then keeps a second team of threads, and with more OpenMP threads than
cores libgomp stops spinning at its barriers, so every later step, on either thread, runs slower
(measured: bench/results/serve-2026-12-01.md). So the engine is used from one thread, the loop's,
which should be the thread that built it.

Cancelling or closing a generate_async iterator (a client that went away) aborts its request;
each iterator reads only its own request, so one reader's end never ends another's.

Listeners (the server's metrics) are told of every request added and every output delivered,
whether or not anyone still reads it: an aborted request's last output is seen too.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Protocol

from ..sampling.params import SamplingParams
from .engine import Engine, Prompt
from .request import RequestOutput

log = logging.getLogger("specengine")


class Listener(Protocol):
    """Told, on the loop's thread, of each request added and of each step's outputs as they are
    delivered. It must be quick (a step waits for it); what it raises is logged, not raised."""

    def added(self, request_id: str) -> None: ...

    def delivered(self, outputs: list[RequestOutput]) -> None: ...


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._streams: dict[str, asyncio.Queue] = {}  # request id -> its outputs
        self._reasons: dict[str, str] = {}  # request id -> why abort() ended it (its last output's message)
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task | None = None
        self.steps = 0  # steps run so far (tests and the server's /health read it)
        self.stopping: str | None = None  # why abort_all() ended every request (a shutdown), else None
        self.listeners: list[Listener] = []

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
        outputs(request_id), which must be started (its finally aborts a request left unread), or
        give it up with discard(request_id)."""
        if request_id is not None and request_id in self._streams:
            # Its stream is still open (the request ended, its reader has not seen it yet): a second
            # request of that id would take the first one's outputs, or be aborted by its reader.
            raise ValueError(f"request_id {request_id!r} is already in flight")
        request_id = self.engine.add_request(prompt, params, request_id)
        self._streams[request_id] = asyncio.Queue()
        self._tell("added", request_id)
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
            # Only while its queue is still the id's: once discarded, the id may be another
            # request's, which this reader must not end.
            if self._streams.get(request_id) is queue:
                del self._streams[request_id]
                if not finished:  # cancelled or closed early: free its row now
                    self.abort(request_id)

    def discard(self, request_id: str):
        """Give up a request whose outputs will not be read (if its outputs() was never started,
        nothing else would abort it): abort it if unfinished and drop its stream."""
        self._streams.pop(request_id, None)
        self.abort(request_id)

    def abort(self, request_id: str, reason: str | None = None) -> bool:
        """End a request now (its stream then ends with finish_reason "abort", and `reason` as the
        message when given); False if it had ended."""
        aborted = self._abort(request_id, reason)
        if aborted:
            self._start_driver()  # the next step reports it
        return aborted

    def abort_all(self, reason: str) -> int:
        """End every unfinished request now (a server shutting down): each open stream ends with
        finish_reason "abort" and `reason` as its message, and `stopping` says why. How many ended."""
        self.stopping = reason
        return sum(self.abort(request_id, reason) for request_id in self.engine.unfinished_request_ids)

    def _abort(self, request_id: str, reason: str | None) -> bool:
        aborted = self.engine.abort(request_id)
        if aborted and reason is not None and request_id in self._streams:
            self._reasons[request_id] = reason
        return aborted

    async def close(self):
        """Stop the driver. Unfinished requests are aborted, and their open streams get their last
        output (finish_reason "abort") rather than wait for it forever."""
        if self._driver is not None:
            self._driver.cancel()
            try:
                await self._driver
            except asyncio.CancelledError:
                pass
            self._driver = None
        self.stopping = self.stopping or "the engine was closed"
        for request_id in self.engine.unfinished_request_ids:
            self._abort(request_id, self.stopping)  # not abort(): that would start the driver again
        if self.engine.has_pending_outputs():
            try:
                self._deliver(self.engine.step())  # nothing runs now: this only reports the aborts
            except Exception:  # noqa: BLE001 (closing regardless)
                log.exception("reporting the aborted requests at close failed")

    def _start_driver(self):
        if self._driver is None or self._driver.done():
            self._wake = asyncio.Event()
            self._driver = asyncio.get_running_loop().create_task(self._drive(), name="specengine-driver")
        self._wake.set()

    def _deliver(self, outputs: list[RequestOutput]):
        for out in outputs:
            if out.finished:
                reason = self._reasons.pop(out.request_id, None)
                if reason is not None and out.finish_reason == "abort":
                    out.message = reason
            queue = self._streams.get(out.request_id)
            if queue is not None:  # None: its reader has gone (and aborted it)
                queue.put_nowait(out)
        if outputs:
            self._tell("delivered", outputs)

    def _tell(self, event: str, arg):
        for listener in self.listeners:
            try:
                getattr(listener, event)(arg)
            except Exception:  # noqa: BLE001 (a listener's fault must not stop serving)
                log.exception("listener %r failed on %s", listener, event)

    async def _idle(self, timeout: float | None = None):
        """Wait until add_request or abort has something for the next step (or timeout seconds)."""
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def _drive(self):
        engine = self.engine
        stuck_reported: set[str] = set()
        while True:
            if not (engine.has_unfinished_requests() or engine.has_pending_outputs()):
                await self._idle()
            try:
                outputs = engine.step()
            except Exception:  # noqa: BLE001 (the engine aborted the round's requests; keep serving)
                # Their final outputs (finish_reason "abort", the error in message) come with the next step.
                log.exception("a step failed; its requests were aborted")
                outputs = []
            self.steps += 1
            self._deliver(outputs)
            if not outputs and not engine.has_pending_outputs() and engine.num_running == 0:
                # The step did nothing (every step reports each decoding request; requests being
                # prefilled count as running): stepping again at once would spin a core. Wait for
                # add_request or abort instead. Requests left unfinished although none runs or
                # waits (an engine bug) are ended, so that their readers get an answer rather than
                # wait forever.
                stuck = set(engine.unfinished_request_ids) if engine.num_running == 0 and engine.num_waiting == 0 else set()
                if stuck - stuck_reported:
                    log.error("requests %s are unfinished but neither running nor waiting; aborting them",
                              sorted(stuck))
                    stuck_reported |= stuck
                    for request_id in stuck:
                        try:
                            self.abort(request_id, "aborted: the engine lost track of this request")
                        except Exception:  # noqa: BLE001 (waited on below, not retried in a loop)
                            log.exception("aborting request %s failed", request_id)
                if not engine.has_pending_outputs():
                    # Re-checked once a second: whatever is still unfinished may run again.
                    await self._idle(1.0 if engine.has_unfinished_requests() else None)
                continue
            stuck_reported.clear()
            # Let the loop write the outputs and take new requests: one pass in which the readers
            # take their outputs, and one in which nothing is put. anyio (under Starlette) cancels
            # a task only while the future it awaits is pending, and retries each pass: after one
            # yield a step had always just filled the reader's queue again, so a disconnected
            # stream was never cancelled and ran to its end.
            await asyncio.sleep(0)
            await asyncio.sleep(0)
