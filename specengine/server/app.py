"""An OpenAI-compatible HTTP server over an AsyncEngine (FastAPI; run it with uvicorn, or
`specengine serve`).

  POST /v1/completions, /v1/chat/completions   JSON, or server-sent events with "stream": true
  GET  /v1/models, /health
  GET  /metrics                                Prometheus' text format (see server/metrics.py)

Every request is its own engine request, admitted to the running batch at the next step. A bad
request gets HTTP 400 with an OpenAI error body naming the parameter (a body that is not JSON
names none); a client that disconnects (streaming or not) aborts its requests, and only its own.
ServerLimits (server/limits.py) adds the API key (401), the body's size (413), prompts, stop
strings and the context per request (400), and the waiting queue's length (503).
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
from dataclasses import replace

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..engine.async_engine import AsyncEngine
from ..engine.request import DecodeStats, RequestOutput
from ..sampling.logprobs import TokenLogprob
from ..sampling.params import SamplingParams
from .limits import RETRY_AFTER_S, Gate, Refused, ServerLimits
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import BadRequest, ChatCompletionRequest, CompletionRequest
from .spec_metrics import speculative_decoding

# The engine's reasons, as OpenAI's: a full context is a length limit too. "abort" (vLLM's) is
# sent only when the server ends a request itself, at shutdown; any other abort is an error.
FINISH_REASONS = {"stop": "stop", "length": "length", "capacity": "length", "abort": "abort"}
# How long past the grace period a shutdown waits for responses to end before cancelling them:
# aborted requests end at the next step, but a client that stops reading could hold its own up.
SHUTDOWN_BACKSTOP_S = 5.0


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


# The log-probability JSON gets for a token the request's warps drop (-inf, which JSON cannot
# hold): vLLM's.
DROPPED_LOGPROB = -9999.0


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character standing for each byte in a token's piece."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in chars)})
    return {c: b for b, c in chars.items()}


class _TokenPieces:
    """How the logprobs formats show a token: its text (the tokenizer's decoding of it alone) and
    its bytes (with a byte-level BPE tokenizer the token's own, which may be part of a character's;
    otherwise its text's UTF-8)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # None: tokens show as "token_id:N", as vLLM's return_tokens_as_token_ids
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self.alphabet = _byte_level_alphabet() if type(decoder).__name__ == "ByteLevel" else None
        self.pieces: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        piece = self.pieces.get(token_id)
        if piece is None and self.tokenizer is None:
            piece = self.pieces[token_id] = (f"token_id:{token_id}", list(f"token_id:{token_id}".encode()))
        if piece is None:
            text = self.tokenizer.decode([token_id])
            raw = text.encode("utf-8")
            if self.alphabet is not None:
                chars = self.tokenizer.convert_ids_to_tokens(token_id)
                if all(c in self.alphabet for c in chars):
                    raw = bytes(self.alphabet[c] for c in chars)
            piece = self.pieces[token_id] = (text, list(raw))
        return piece


def _json_logprob(logprob: float) -> float:
    return max(logprob, DROPPED_LOGPROB)


def _completion_logprobs(token_ids: list[int], entries: list[TokenLogprob | None], pieces: _TokenPieces,
                         offset: int) -> tuple[dict, int]:
    """OpenAI's legacy (completions) logprobs of these tokens: their texts, log-probabilities (None
    where there is none: a prompt's first token), alternatives as {text: logprob} and offsets in
    the choice's text, the first at `offset`, each after the texts of the tokens before it (as
    vLLM counts them); and the offset of the token after them."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        text = pieces(token_id)[0]
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        out["token_logprobs"].append(None if entry is None else _json_logprob(entry.logprob))
        out["top_logprobs"].append(None if entry is None else
                                   {pieces(t)[0]: _json_logprob(logprob) for t, logprob in entry.top})
    return out, offset


def _joined(parts: list[dict]) -> dict:
    """Legacy logprobs of consecutive runs of tokens as one."""
    return {key: [x for part in parts for x in part[key]] for key in parts[0]}


def _chat_logprobs(entries: list[TokenLogprob], pieces: _TokenPieces) -> dict:
    """OpenAI's chat logprobs of these tokens: each one's text, log-probability, bytes and alternatives."""
    def token(token_id: int, logprob: float) -> dict:
        text, raw = pieces(token_id)
        return {"token": text, "logprob": _json_logprob(logprob), "bytes": raw}
    return {"content": [{**token(e.token_id, e.logprob), "top_logprobs": [token(t, lp) for t, lp in e.top]}
                        for e in entries]}


class _Choices:
    """The requests of one HTTP request (one per prompt), their outputs merged in arrival order.
    It reads and ends only these requests: no other client's."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str]):
        self.engine, self.request_ids = engine, request_ids
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.stats: list[DecodeStats | None] = [None] * len(request_ids)  # each choice's, once finished

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
                    self.stats[index] = item.stats
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

    def metrics(self) -> dict:
        """What a response adds beside its usage when the engine drafts: vLLM's per-request
        `metrics` object, whose `speculative_decoding` describes one generation (null, as vLLM's
        for n > 1, when the response holds several)."""
        if self.engine.engine.drafter is None:
            return {}
        stats = self.stats[0] if len(self.stats) == 1 else None
        return {"metrics": {"speculative_decoding": None if stats is None else speculative_decoding(stats)}}


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


def create_app(engine: AsyncEngine, model_name: str, limits: ServerLimits | None = None) -> FastAPI:
    """The app serving `engine` as `model_name`, refusing what `limits` (default ServerLimits()) refuse."""
    limits = limits if limits is not None else ServerLimits()
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
    app.state.limits = limits
    max_seq_len = engine.engine.max_seq_len
    pieces = _TokenPieces(engine.engine.tokenizer)
    # An encoder-decoder's prompt goes to its encoder: the decoded sequence starts with one token.
    encoder_decoder = engine.engine.target.is_encoder_decoder

    def refusal(exc: Refused) -> JSONResponse:
        metrics.refused(exc.reason)
        return _error(exc.status, str(exc), exc.param, kind="invalid_request_error" if exc.status < 500
                      else "server_error", code=exc.code, headers=exc.headers)

    app.add_middleware(Gate, limits=limits, refuse=refusal)

    @app.exception_handler(Refused)
    async def refused(_, exc: Refused):
        return refusal(exc)

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

    def sampling_params(body, max_tokens: int) -> SamplingParams:
        stops = len(body.stop_strings)
        if stops > limits.max_stop_strings:
            raise Refused(400, "too_many_stop_strings", f"stop holds {stops} strings; this server takes at most "
                          f"{limits.max_stop_strings} per request", "stop")
        return body.sampling_params(max_tokens)

    def encoded(prompt, param: str) -> list[int]:
        """The prompt's token ids; a prompt the engine would refuse is refused here, naming `param`."""
        try:
            return engine.engine.intake.encode(prompt)
        except ValueError as exc:
            raise BadRequest(str(exc), param) from None

    def room(prompt_ids: list[int]) -> int:
        """The tokens that fit in the context after the prompt (at least 1: encoded() saw to it)."""
        return max_seq_len - (1 if encoder_decoder else len(prompt_ids))

    def fitted(prompt_ids: list[int], params: SamplingParams, param: str) -> SamplingParams:
        """params, whose max_tokens fits in the context after the prompt: shortened to fit with
        clamp_max_tokens, else refused, in the words of vLLM and OpenAI."""
        asked, fits = params.max_new_tokens, room(prompt_ids)
        if asked <= fits:
            return params
        if limits.clamp_max_tokens:
            return replace(params, max_new_tokens=fits)
        if encoder_decoder:
            raise Refused(400, "context_length", f"This model's decoder holds at most {max_seq_len} tokens, its "
                          f"start token included. However, you requested {asked} tokens in the completion. Please "
                          f"reduce max_tokens.", "max_tokens", code="context_length_exceeded")
        held = len(prompt_ids)
        raise Refused(400, "context_length", f"This model's maximum context length is {max_seq_len} tokens. However, "
                      f"you requested {held + asked} tokens ({held} in the {param}, {asked} in the completion). "
                      f"Please reduce the length of the {param} or completion.", param, code="context_length_exceeded")

    def check_queue(count: int):
        """Refuse a request whose `count` prompts would leave more than max_waiting requests waiting
        for a row once the next step has filled the free ones: with 503 while others run (a retry
        may find room), with 400 if it could never be queued."""
        inner = engine.engine
        if limits.max_waiting is None or inner.max_batch_size is None:  # no batch limit: none waits past a step
            return
        if count > inner.max_batch_size + limits.max_waiting:
            raise Refused(400, "too_many_prompts", f"prompt holds {count} prompts, more than this server ever holds "
                          f"at once ({inner.max_batch_size} running and {limits.max_waiting} waiting)", "prompt")
        free_rows = max(0, inner.max_batch_size - inner.num_running)
        if inner.num_waiting + count - free_rows > limits.max_waiting:
            raise Refused(503, "queue_full", f"the server is busy: its queue of {limits.max_waiting} waiting requests "
                          f"is full; retry after {RETRY_AFTER_S} s", headers={"Retry-After": str(RETRY_AFTER_S)})

    def add_all(prompts: list[list[int]], params: list[SamplingParams], param: str) -> _Choices:
        """Add every prompt's request (token ids, with their params), or none: a bad prompt aborts
        those added before it."""
        check_queue(len(prompts))
        ids: list[str] = []
        try:
            for prompt, prompt_params in zip(prompts, params):
                ids.append(engine.add_request(prompt, prompt_params))
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
        params = sampling_params(body, body.max_tokens if body.max_tokens is not None else 16)
        prompts = body.prompts()
        if len(prompts) > limits.max_prompts_per_request:
            raise Refused(400, "too_many_prompts", f"prompt holds {len(prompts)} prompts; this server takes at most "
                          f"{limits.max_prompts_per_request} per request", "prompt")
        sent = prompts
        prompts = [encoded(prompt, "prompt") for prompt in prompts]
        # What echo puts before each completion: the prompt as sent, or its token ids' text.
        tokenizer = engine.engine.tokenizer
        echoes = [(prompt if isinstance(prompt, str) else tokenizer.decode(ids, skip_special_tokens=True)
                   if tokenizer is not None else "") if body.echo else "" for prompt, ids in zip(sent, prompts)]
        choices = add_all(prompts, [fitted(prompt, params, "prompt") for prompt in prompts], "prompt")
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}
        scored = params.logprobs is not None

        def echoed(index: int, out: RequestOutput) -> list[dict]:
            """The legacy logprobs of an echoed prompt (none without echo and logprobs)."""
            if not (body.echo and scored):
                return []
            return [_completion_logprobs(prompts[index], out.prompt_logprobs, pieces, 0)[0]]

        if body.stream:
            async def events():
                started = [False] * len(prompts)
                offsets = [len(echo) for echo in echoes]  # of each choice's next token in its text
                async for index, out in choices.merged():
                    text, parts = out.new_text or "", []
                    if not started[index]:  # the first chunk of a choice carries its echo
                        started[index] = True
                        text, parts = echoes[index] + text, echoed(index, out)
                    if scored and out.new_token_ids:
                        part, offsets[index] = _completion_logprobs(out.new_token_ids, out.new_logprobs, pieces,
                                                                    offsets[index])
                        parts.append(part)
                    if text or parts or out.finished:
                        yield _sse({**head, "choices": [{"index": index, "text": text,
                                                         "logprobs": _joined(parts) if parts else None,
                                                         "finish_reason": FINISH_REASONS.get(out.finish_reason)}]})
                if body.include_usage:  # the last chunk; vLLM's per-request metrics ride it
                    yield _sse({**head, "choices": [], "usage": choices.usage(), **choices.metrics()})
            return streamed(events(), choices)

        async def collect():
            texts, reasons = list(echoes), [None] * len(prompts)
            token_ids: list[list[int]] = [[] for _ in prompts]
            entries: list[list[TokenLogprob]] = [[] for _ in prompts]
            prompt_parts: list[list[dict]] = [[] for _ in prompts]
            async for index, out in choices.merged():
                texts[index] += out.new_text or ""
                reasons[index] = FINISH_REASONS.get(out.finish_reason)
                token_ids[index] += out.new_token_ids
                entries[index] += out.new_logprobs or []
                prompt_parts[index] = prompt_parts[index] or echoed(index, out)
            logprobs = [_joined(prompt_parts[i] + [_completion_logprobs(token_ids[i], entries[i], pieces,
                                                                        len(echoes[i]))[0]])
                        if scored else None for i in range(len(prompts))]
            return {**head, "choices": [{"index": i, "text": t, "logprobs": lp, "finish_reason": r}
                                        for i, (t, lp, r) in enumerate(zip(texts, logprobs, reasons))],
                    "usage": choices.usage(), **choices.metrics()}
        return await respond(request, choices, collect)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        try:
            prompt = engine.engine.chat_prompt(body.chat_messages())
        except ValueError as exc:
            raise BadRequest(str(exc), "messages") from None
        prompt = encoded(prompt, "messages")
        # Without max_tokens a chat answer may run to the end of the context.
        params = sampling_params(body, body.requested_max_tokens() or room(prompt))
        choices = add_all([prompt], [fitted(prompt, params, "messages")], "messages")
        scored = params.logprobs is not None
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model_name}

        if body.stream:
            async def events():
                yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
                async for index, out in choices.merged():
                    if out.new_text or (scored and out.new_token_ids):
                        yield _sse({**head, "choices": [{"index": index, "delta": {"content": out.new_text or ""},
                                                         "logprobs": _chat_logprobs(out.new_logprobs, pieces)
                                                         if scored else None, "finish_reason": None}]})
                    if out.finished:
                        yield _sse({**head, "choices": [{"index": index, "delta": {}, "logprobs": None,
                                                         "finish_reason": FINISH_REASONS.get(out.finish_reason)}]})
                if body.include_usage:  # the last chunk; vLLM's per-request metrics ride it
                    yield _sse({**head, "choices": [], "usage": choices.usage(), **choices.metrics()})
            return streamed(events(), choices)

        async def collect():
            text, reason, entries = "", None, []
            async for _, out in choices.merged():
                text += out.new_text or ""
                reason = FINISH_REASONS.get(out.finish_reason)
                entries += out.new_logprobs or []
            return {**head, "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": _chat_logprobs(entries, pieces) if scored else None,
                                 "finish_reason": reason}], "usage": choices.usage(), **choices.metrics()}
        return await respond(request, choices, collect)

    return app
