"""An Engine driven by one background asyncio task, for servers: `async for out in
engine.generate_async(prompt, params)` streams a request's RequestOutputs while others join.

The Engine is not thread-safe, and a step is blocking work (milliseconds to seconds of matrix
products). So one thread runs every call on it: the driver task hands each step, with the requests
added and aborted since the last one, to a worker thread and awaits it, leaving the event loop free
to accept connections meanwhile. Requests join at the next step, as with Engine.add_request.
Cancelling or closing a generate_async iterator (a client that went away) aborts its request.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..sampling.params import SamplingParams
from .engine import Engine, Prompt
from .request import RequestOutput

log = logging.getLogger("specengine")


@dataclass
class _Add:
    prompt: Prompt
    params: SamplingParams | None
    request_id: str | None
    accepted: asyncio.Future = field(default=None)  # -> the request id, or the error that refused it


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: list[_Add | str] = []            # adds, and ids to abort, for the next step
        # (only the event loop's thread touches these three; the worker thread only the engine)
        self._streams: dict[str, asyncio.Queue] = {}     # request id -> its outputs
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task | None = None
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specengine-step")
        self.steps = 0  # steps run so far (tests and the server's /health read it)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate_async(self, prompt: Prompt, params: SamplingParams | None = None,
                             request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as steps produce them, the last one finished. A bad request raises
        ValueError here, before anything is yielded."""
        request_id = await self.add_request(prompt, params, request_id)
        async for output in self.outputs(request_id):
            yield output

    async def outputs(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """The outputs of a request added with add_request. Closing or cancelling the iterator
        before the last output aborts the request. Raises the error of a step that failed it."""
        queue = self._streams[request_id]
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # cancelled or closed early: free its row
                self._command(request_id)

    async def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                          request_id: str | None = None) -> str:
        """Queue a request for the next step (a bad one raises ValueError); read its outputs with
        outputs(request_id)."""
        add = _Add(prompt, params, request_id, asyncio.get_running_loop().create_future())
        self._command(add)
        return await add.accepted

    async def abort(self, request_id: str):
        """Abort a request at the next step boundary (its stream then ends with finish_reason "abort")."""
        self._command(request_id)

    async def close(self):
        """Stop the driver after its step; unfinished requests are aborted."""
        if self._driver is not None:
            self._driver.cancel()
            try:
                await self._driver
            except asyncio.CancelledError:
                pass
            self._driver = None
        self._worker.shutdown(wait=True)
        for request_id in list(self.engine._unfinished):
            self.engine.abort(request_id)

    def _command(self, command: _Add | str):
        self._commands.append(command)
        if self._driver is None or self._driver.done():
            self._wake = asyncio.Event()
            self._driver = asyncio.get_running_loop().create_task(self._drive(), name="specengine-driver")
        self._wake.set()

    async def _drive(self):
        loop = asyncio.get_running_loop()
        while True:
            if not (self._commands or self.engine.has_unfinished_requests() or self.engine.has_pending_outputs()):
                self._wake.clear()
                await self._wake.wait()
            commands, self._commands = self._commands, []
            adds = [c for c in commands if isinstance(c, _Add)]
            results, outputs, error = await loop.run_in_executor(self._worker, self._step, commands)
            self.steps += 1
            for add, result in zip(adds, results):
                if add.accepted.cancelled():  # its caller went away while it was being added
                    if not isinstance(result, BaseException):
                        self._commands.append(result)
                elif isinstance(result, BaseException):
                    add.accepted.set_exception(result)
                else:  # before the outputs below: the first may already be among them
                    self._streams[result] = asyncio.Queue()
                    add.accepted.set_result(result)
            for out in outputs:
                queue = self._streams.get(out.request_id)
                if queue is not None:  # None: its consumer has gone (the abort is queued)
                    queue.put_nowait(out)
            if error is not None:
                log.error("a step failed; its requests were aborted: %r", error)

    def _step(self, commands: list[_Add | str]):
        """On the worker thread: apply the commands in order, then one step of the engine.
        Returns each add's request id or error, the step's outputs, and the step's error."""
        results = []
        for command in commands:
            if isinstance(command, _Add):
                try:
                    results.append(self.engine.add_request(command.prompt, command.params, command.request_id))
                except (ValueError, TypeError) as exc:
                    results.append(exc)
            else:
                self.engine.abort(command)
        try:
            return results, self.engine.step(), None
        except Exception as exc:  # noqa: BLE001 (the engine aborted the round's requests; keep serving)
            # Their final outputs (finish_reason "abort", the error in message) come with the next step.
            return results, [], exc
