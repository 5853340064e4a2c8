"""The OpenAI request bodies the server accepts, and their sampling parameters.

Field names and defaults are OpenAI's (max_tokens 16 for completions; chat runs to the end of the
context). top_k, min_p and ignore_eos are extra fields, as in vLLM (the openai client sends them
with extra_body). Log-probabilities are asked as OpenAI asks them: completions' logprobs (how many
alternatives) and echo, chat's logprobs and top_logprobs; at most MAX_LOGPROBS alternatives, as
vLLM's default. A field OpenAI defines that this engine cannot honour (penalties, n > 1, tools,
...) is refused by name rather than ignored; an unknown field is refused too.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..sampling.params import MAX_LOGPROBS, MAX_SEED, SamplingParams


class BadRequest(ValueError):
    """A request the server answers with HTTP 400, naming the parameter at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    # Extra sampling fields (vLLM's names); top_k -1 also means off, as there.
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    ignore_eos: bool = False
    # OpenAI fields accepted and ignored: they do not change what is generated.
    user: str | None = None
    metadata: dict | None = None
    # OpenAI fields refused unless left at their default (see refuse_unsupported).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None

    def refuse_unsupported(self):
        if self.n != 1:
            raise BadRequest("n must be 1: one choice per prompt", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise BadRequest(f"{name} is not supported (it would change the target's distribution)", name)
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported", "logit_bias")
        if any(not s for s in self.stop_strings):
            raise BadRequest("stop strings must be non-empty", "stop")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        self.refuse_unsupported()
        return SamplingParams(max_new_tokens=max_tokens, temperature=self.temperature, top_k=max(self.top_k, 0),
                              top_p=self.top_p, min_p=self.min_p, seed=self.seed, stop=self.stop_strings,
                              ignore_eos=self.ignore_eos, **self.logprob_params())

    def logprob_params(self) -> dict:
        """SamplingParams' logprobs and prompt_logprobs, as the request asks for them."""
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _check_alternatives(value: int | None, param: str):
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise BadRequest(f"{param} must be an integer in [0, {MAX_LOGPROBS}] (the alternatives reported per token), "
                         f"got {value}", param)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    # The log-probability of each token and this many alternatives (OpenAI's legacy format).
    logprobs: int | None = Field(None, strict=True)
    echo: bool = False  # the prompt goes before the completion: its text, and with logprobs its tokens'
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """One prompt per choice: a string, token ids, or a list of either."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        if not self.prompt:
            raise BadRequest("prompt is empty", "prompt")
        return list(self.prompt)

    def refuse_unsupported(self):
        super().refuse_unsupported()
        _check_alternatives(self.logprobs, "logprobs")
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise BadRequest("best_of must be 1", "best_of")

    def logprob_params(self) -> dict:
        return dict(logprobs=self.logprobs, prompt_logprobs=self.logprobs if self.echo else None)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. a client's "name"
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None  # each token's log-probability ...
    top_logprobs: int | None = Field(None, strict=True)  # ... and this many alternatives
    tools: list | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None

    def chat_messages(self) -> list[dict]:
        # "developer" is the newer name of "system"; chat templates know only the latter.
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def refuse_unsupported(self):
        super().refuse_unsupported()
        _check_alternatives(self.top_logprobs, "top_logprobs")
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        if self.tools or self.tool_choice not in (None, "none"):
            raise BadRequest("tools are not supported", "tools")
        if self.response_format not in (None, {"type": "text"}):
            raise BadRequest("response_format is not supported", "response_format")

    def logprob_params(self) -> dict:
        return dict(logprobs=(self.top_logprobs or 0) if self.logprobs else None)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
