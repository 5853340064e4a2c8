"""An OpenAI-compatible HTTP server over an AsyncEngine (FastAPI; run it with uvicorn, or
`specengine serve`).

  POST /v1/completions, /v1/chat/completions   JSON, or server-sent events with "stream": true
  GET  /v1/models, /health

Every request is its own engine request, joining the running batch at the next round. A bad
request gets HTTP 400 with an OpenAI error body naming the parameter; a client that disconnects
(streaming or not) aborts its requests.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from ..engine.async_engine import AsyncEngine
from ..engine.request import RequestOutput
from .protocol import BadRequest, ChatCompletionRequest, CompletionRequest

# The engine's reasons, as OpenAI's: a full context is a length limit too.
FINISH_REASONS = {"stop": "stop", "length": "length", "capacity": "length"}


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status)


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class _Choices:
    """The requests of one HTTP request (one per prompt), their outputs merged in arrival order."""

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
                    if item.finish_reason == "abort":  # only a failed step aborts a live request
                        raise RuntimeError(item.message or "the request was aborted")
                yield index, item
        finally:
            for task in tasks:  # cancelling a pump closes its outputs(): an unfinished request is aborted
                task.cancel()

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def create_app(engine: AsyncEngine, model_name: str) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        await engine.close()  # at shutdown: stop the driver, abort what is left

    app = FastAPI(title="specengine", summary="speculative decoding behind an OpenAI-compatible API",
                  lifespan=lifespan)
    app.state.engine = engine
    max_seq_len = engine.engine.max_seq_len

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "extra_forbidden":
            return _error(400, f"unrecognized request argument: {param}", param)
        return _error(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param)

    @app.exception_handler(BadRequest)
    async def bad_request(_, exc: BadRequest):
        return _error(400, str(exc), exc.param)

    @app.get("/health")
    async def health():
        inner = engine.engine
        return {"status": "ok", "running": inner.num_running, "waiting": inner.num_waiting,
                "cache_rows_in_use": inner.cache_rows_in_use, "steps": engine.steps}

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

    async def respond(request: Request, collect) -> JSONResponse | None:
        """Run collect() unless the client goes away first (then its requests are aborted)."""
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

    def streamed(events: AsyncIterator[str]) -> StreamingResponse:
        async def with_errors():
            try:
                async for event in events:
                    yield event
            except RuntimeError as exc:
                yield _sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
            yield _sse("[DONE]")
        return StreamingResponse(with_errors(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

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
            return streamed(events())

        async def collect():
            texts, reasons = [""] * len(prompts), [None] * len(prompts)
            async for index, out in choices.merged():
                texts[index] += out.new_text or ""
                reasons[index] = FINISH_REASONS.get(out.finish_reason)
            return {**head, "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
                                        for i, (t, r) in enumerate(zip(texts, reasons))], "usage": choices.usage()}
        return await respond(request, collect)

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
            return streamed(events())

        async def collect():
            text, reason = "", None
            async for _, out in choices.merged():
                text += out.new_text or ""
                reason = FINISH_REASONS.get(out.finish_reason)
            return {**head, "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                 "finish_reason": reason}], "usage": choices.usage()}
        return await respond(request, collect)

    return app
