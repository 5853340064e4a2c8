"""An OpenAI-compatible HTTP server over an AsyncEngine (FastAPI; run it with uvicorn, or
`specengine serve`).

  POST /v1/completions, /v1/chat/completions   JSON, or server-sent events with "stream": true
  GET  /v1/models, /health
  GET  /metrics                                Prometheus' text format (see server/metrics.py)

Every request is its own engine request, joining the running batch at the next round. A bad
request gets HTTP 400 with an OpenAI error body naming the parameter (a body that is not JSON
names none); a client that disconnects (streaming or not) aborts its requests, and only its own.
At SIGTERM or Ctrl-C, Server (what `specengine serve` runs) stops accepting, lets open requests
run for a grace period, then ends the rest with finish_reason "abort".
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..engine.async_engine import AsyncEngine
from ..engine.request import RequestOutput
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import BadRequest, ChatCompletionRequest, CompletionRequest

# The engine's reasons, as OpenAI's: a full context is a length limit too. "abort" (vLLM's) is
# sent only when the server ends a request itself, at shutdown; any other abort is an error.
FINISH_REASONS = {"stop": "stop", "length": "length", "capacity": "length", "abort": "abort"}
# How long past the grace period a shutdown waits for responses to end before cancelling them:
# aborted requests end at the next step, but a client that stops reading could hold its own up.
SHUTDOWN_BACKSTOP_S = 5.0


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status, headers=headers)


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class _Choices:
    """The requests of one HTTP request (one per prompt), their outputs merged in arrival order.
    It reads and ends only these requests: no other client's."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str]):
        self.engine, self.request_ids = engine, request_ids
        self.prompt_tokens = 0
        self.completion_tokens = 0

    async def merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) pairs as the steps produce them."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, request_id: str):
            async for output in self.engine.outputs(request_id):
                queue.put_nowait((index, output))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(self.request_ids)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item.finished:
                    remaining -= 1
                    self.prompt_tokens += item.stats.prompt_tokens
                    self.completion_tokens += item.stats.generated_tokens
                    # A live request is aborted by a failed step (an error), or by the server
                    # shutting down (an end: the client gets what was generated, and "abort").
                    if item.finish_reason == "abort" and self.engine.stopping is None:
                        raise RuntimeError(item.message or "the request was aborted")
                yield index, item
        finally:
            for task in tasks:  # cancelling a pump closes its outputs(): an unfinished request is aborted
                task.cancel()

    def close(self):
        """Abort whichever of these requests is unfinished once the response ends. merged()
        does so too, but only once started: a client gone before its response began would
        otherwise leave its requests running, unread."""
        for request_id in self.request_ids:
            self.engine.discard(request_id)

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


class _Stream(StreamingResponse):
    """Server-sent events whose requests are given up however the response ends (its body may
    never be iterated: a disconnect cancels it before the first chunk)."""

    def __init__(self, events: AsyncIterator[str], choices: _Choices):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.choices = choices

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.choices.close()


def _json_error_message(error: dict, body) -> str:
    """FastAPI's report of a body json.loads refused (its position as a character offset), in
    json's own words: "Expecting value: line 1 column 29 (char 28)"."""
    pos = error.get("loc", (None, None))[-1]
    reason = (error.get("ctx") or {}).get("error", "invalid JSON")
    if isinstance(body, str) and isinstance(pos, int):
        reason = str(json.JSONDecodeError(reason, body, pos))
    elif isinstance(pos, int):
        reason = f"{reason} (char {pos})"
    return f"the request body is not valid JSON: {reason}"


class Server(uvicorn.Server):
    """uvicorn's server, whose shutdown (SIGTERM, Ctrl-C) is bounded: it stops accepting, lets
    open requests run for `grace` seconds, then aborts those left. Their streams end with
    finish_reason "abort" (and [DONE]), non-streamed answers likewise, and the server exits;
    responses still open SHUTDOWN_BACKSTOP_S later are cancelled. on_started() runs once it listens."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace: float, on_started=None):
        config.timeout_graceful_shutdown = grace + SHUTDOWN_BACKSTOP_S
        super().__init__(config)
        self.engine, self.grace, self.on_started = engine, grace, on_started

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    async def shutdown(self, sockets=None):
        ending = asyncio.create_task(self._end_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()

    async def _end_after_grace(self):
        await asyncio.sleep(self.grace)
        ended = self.engine.abort_all(f"the server is shutting down (its {self.grace:g} s grace period ran out)")
        if ended:
            logging.getLogger("specengine").warning(
                "shutting down: %d request(s) still open after %g s were ended (finish_reason \"abort\")",
                ended, self.grace)


def create_app(engine: AsyncEngine, model_name: str) -> FastAPI:
    metrics = ServerMetrics(engine.engine)
    engine.listeners.append(metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        try:
            yield
            await engine.close()  # at shutdown: stop the driver, abort what is left (counted too)
        finally:
            engine.listeners.remove(metrics)

    app = FastAPI(title="specengine", summary="speculative decoding behind an OpenAI-compatible API",
                  lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    max_seq_len = engine.engine.max_seq_len

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # its loc is ("body", a character offset), no parameter
            return _error(400, _json_error_message(first, exc.body))
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "extra_forbidden":
            return _error(400, f"unrecognized request argument: {param}", param)
        return _error(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param)

    @app.exception_handler(BadRequest)
    async def bad_request(_, exc: BadRequest):
        return _error(400, str(exc), exc.param)

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        # An unknown path, a wrong method, a body that is not UTF-8: the OpenAI error shape too.
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error(exc.status_code, str(exc.detail), kind=kind, headers=getattr(exc, "headers", None))

    @app.get("/health")
    async def health():
        inner = engine.engine
        return {"status": "ok", "running": inner.num_running, "waiting": inner.num_waiting,
                "cache_rows_in_use": inner.cache_rows_in_use, "steps": engine.steps}

    @app.get("/metrics")
    async def scrape():
        # async: served on the loop's thread, the engine's, whose running and waiting it reads
        return Response(metrics.scrape(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "specengine", "max_model_len": max_seq_len}]}

    def check_model(name: str | None):
        if name is not None and name != model_name:
            raise BadRequest(f"the model `{name}` does not exist; this server serves `{model_name}`", "model")

    def add_all(prompts: list, params, param: str) -> _Choices:
        """Add every prompt's request, or none: a bad prompt aborts those added before it."""
        ids: list[str] = []
        try:
            for prompt in prompts:
                ids.append(engine.add_request(prompt, params))
        except ValueError as exc:
            for request_id in ids:
                engine.abort(request_id)
            raise BadRequest(str(exc), param) from None
        return _Choices(engine, ids)

    async def until_disconnect(request: Request):
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def respond(request: Request, choices: _Choices, collect) -> JSONResponse | None:
        """Run collect() unless the client goes away first (then its requests are aborted)."""
        try:
            work, gone = asyncio.create_task(collect()), asyncio.create_task(until_disconnect(request))
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if work not in done:
                work.cancel()
                return None
            try:
                return JSONResponse(work.result())
            except RuntimeError as exc:
                return _error(500, str(exc), kind="server_error")
        finally:
            choices.close()

    def streamed(events: AsyncIterator[str], choices: _Choices) -> StreamingResponse:
        async def with_errors():
            try:
                async for event in events:
                    yield event
            except RuntimeError as exc:
                yield _sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
            yield _sse("[DONE]")
        return _Stream(with_errors(), choices)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        params = body.sampling_params(body.max_tokens if body.max_tokens is not None else 16)
        prompts = body.prompts()
        choices = add_all(prompts, params, "prompt")
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}

        if body.stream:
            async def events():
                async for index, out in choices.merged():
                    if out.new_text or out.finished:
                        yield _sse({**head, "choices": [{"index": index, "text": out.new_text or "", "logprobs": None,
                                                         "finish_reason": FINISH_REASONS.get(out.finish_reason)}]})
                if body.include_usage:
                    yield _sse({**head, "choices": [], "usage": choices.usage()})
            return streamed(events(), choices)

        async def collect():
            texts, reasons = [""] * len(prompts), [None] * len(prompts)
            async for index, out in choices.merged():
                texts[index] += out.new_text or ""
                reasons[index] = FINISH_REASONS.get(out.finish_reason)
            return {**head, "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
                                        for i, (t, r) in enumerate(zip(texts, reasons))], "usage": choices.usage()}
        return await respond(request, choices, collect)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        try:
            prompt = engine.engine.chat_prompt(body.chat_messages())
        except ValueError as exc:
            raise BadRequest(str(exc), "messages") from None
        # Without max_tokens a chat answer may run to the end of the context.
        max_tokens = body.requested_max_tokens() or max(1, max_seq_len - len(prompt))
        choices = add_all([prompt], body.sampling_params(max_tokens), "messages")
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model_name}

        if body.stream:
            async def events():
                yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
                async for index, out in choices.merged():
                    if out.new_text:
                        yield _sse({**head, "choices": [{"index": index, "delta": {"content": out.new_text},
                                                         "logprobs": None, "finish_reason": None}]})
                    if out.finished:
                        yield _sse({**head, "choices": [{"index": index, "delta": {}, "logprobs": None,
                                                         "finish_reason": FINISH_REASONS.get(out.finish_reason)}]})
                if body.include_usage:
                    yield _sse({**head, "choices": [], "usage": choices.usage()})
            return streamed(events(), choices)

        async def collect():
            text, reason = "", None
            async for _, out in choices.merged():
                text += out.new_text or ""
                reason = FINISH_REASONS.get(out.finish_reason)
            return {**head, "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                 "finish_reason": reason}], "usage": choices.usage()}
        return await respond(request, choices, collect)

    return app
