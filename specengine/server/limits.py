"""What the server refuses before a request reaches the engine, and how (ServerLimits):

  401  an endpoint other than /health (and /metrics, unless protect_metrics) without
       `Authorization: Bearer <api_key>`, when the server has a key
  413  a body past max_body_bytes: decided from Content-Length before any of it is read; a body
       streamed without one is counted as it arrives
  400  more prompts than max_prompts_per_request, more stop strings than max_stop_strings, or a
       prompt whose max_tokens cannot fit in the context (unless clamp_max_tokens shortens it)
  503  a request whose prompts would make more than max_waiting requests wait for a row, with
       Retry-After

Every refusal has OpenAI's error shape and is counted in the metrics' requests_refused, by reason.
Only the key and the body's size are the gate's (an ASGI middleware in front of the app): they
are decided before a request is routed or its body parsed. The others need the parsed request and
are raised as Refused from the endpoints.
"""
from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass, field

# Why a request was refused: the `reason` label of specengine:requests_refused_total.
REFUSAL_REASONS = ("unauthorized", "body_too_large", "too_many_prompts", "too_many_stop_strings",
                   "context_length", "queue_full")
# The seconds a 503 asks a client to wait (Retry-After, which the openai client honours when it
# retries): the queue moves as running requests finish, and the default pair on 2 CPU cores decodes
# about 150 tokens a second.
RETRY_AFTER_S = 1
# Paths served without the key: a load balancer's or an orchestrator's probe carries none.
OPEN_PATHS = frozenset({"/health"})


@dataclass(frozen=True)
class ServerLimits:
    """The server's refusals (see the module's docstring); the defaults are `specengine serve`'s.

    api_key: the key every endpoint but /health (and /metrics) needs; None: no key. Never shown in
        a repr, a log line or a response.
    protect_metrics: /metrics needs the key too.
    max_waiting: the most requests (a prompt each) that may wait for a row of the running batch;
        None: no limit. An engine without max_batch_size gives every request a row at the next
        step, so none waits and no limit applies.
    max_body_bytes: the largest request body. The default, 1 MiB, holds a prompt of about
        130,000 token ids as JSON (at most 8 bytes each), and more as text.
    max_prompts_per_request: the most prompts of one completions request.
    max_stop_strings: the most stop strings of one request (OpenAI takes 4; each costs a search
        of the text every round).
    clamp_max_tokens: a max_tokens past the context is shortened to what fits (llama-server's
        way) rather than refused (vLLM's and OpenAI's).
    """

    api_key: str | None = field(default=None, repr=False)
    protect_metrics: bool = False
    max_waiting: int | None = None
    max_body_bytes: int = 1 << 20
    max_prompts_per_request: int = 64
    max_stop_strings: int = 16
    clamp_max_tokens: bool = False

    def __post_init__(self):
        if self.api_key is not None:
            # A header carries it: printable ASCII, and no spaces (they separate the scheme from it).
            if not isinstance(self.api_key, str) or not self.api_key or not all("!" <= c <= "~" for c in self.api_key):
                raise ValueError("api_key must be a non-empty string of printable ASCII characters without spaces "
                                 "(it is sent in an HTTP header)")
        if self.protect_metrics and self.api_key is None:
            raise ValueError("protect_metrics needs an api_key")
        for name, least in (("max_waiting", 0), ("max_body_bytes", 1), ("max_prompts_per_request", 1),
                            ("max_stop_strings", 0)):
            value = getattr(self, name)
            if value is None and name == "max_waiting":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")

    def needs_key(self, path: str) -> bool:
        if self.api_key is None or path in OPEN_PATHS:
            return False
        return path != "/metrics" or self.protect_metrics

    def authorized(self, authorization: bytes | None) -> bool:
        """Whether an Authorization header's value is `Bearer <api_key>` (the scheme in any case)."""
        scheme, _, token = (authorization or b"").partition(b" ")
        # Compared in constant time: how long a wrong key takes to refuse tells nothing of the key.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key.encode("ascii"))


class Refused(Exception):
    """A request a limit refuses: the HTTP status, the message and parameter of OpenAI's error body,
    and the reason it is counted under (one of REFUSAL_REASONS)."""

    def __init__(self, status: int, reason: str, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        if reason not in REFUSAL_REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}; known: {', '.join(REFUSAL_REASONS)}")
        super().__init__(message)
        self.status, self.reason, self.param, self.code, self.headers = status, reason, param, code, headers


class Gate:
    """ASGI middleware in front of the app: the API key, then the body's size. `refuse` turns a
    Refused into the response (and counts it)."""

    def __init__(self, app, limits: ServerLimits, refuse: Callable[[Refused], object]):
        self.app, self.limits, self.refuse = app, limits, refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # names are lower case (ASGI); a repeated header: its last value
        refusal = None
        if self.limits.needs_key(scope["path"]) and not self.limits.authorized(headers.get(b"authorization")):
            refusal = Refused(401, "unauthorized", "missing or incorrect API key: send it as `Authorization: Bearer "
                              "<key>`", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        elif (length := _content_length(headers)) is not None:
            if length > self.limits.max_body_bytes:
                refusal = self._too_large(f"the request body is {length} bytes")
        elif b"transfer-encoding" in headers:
            # Streamed without a length: read it here, up to the limit, and hand it on whole.
            receive, refusal = await self._read_at_most(receive)
            if receive is None:  # the client went away
                return
        if refusal is not None:
            await self.refuse(refusal)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _too_large(self, what: str) -> Refused:
        limit = self.limits.max_body_bytes
        return Refused(413, "body_too_large", f"{what}; this server takes at most {limit} bytes")

    async def _read_at_most(self, receive):
        """(a receive that replays the body, then the client's receive; None if the client went away),
        or the refusal of a body past the limit, which is not read further."""
        messages, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, None
            size += len(message.get("body", b""))
            if size > self.limits.max_body_bytes:
                return receive, self._too_large(f"the request body is over {self.limits.max_body_bytes} bytes")
            messages.append(message)
            more = message.get("more_body", False)

        async def replay():
            return messages.pop(0) if messages else await receive()
        return replay, None


def _content_length(headers: dict[bytes, bytes]) -> int | None:
    try:
        return int(headers[b"content-length"])
    except (KeyError, ValueError):  # none (an invalid one never gets here: uvicorn's parsers answer it with 400)
        return None
