"""Requests in flight, what each step reports of them, their results and their statistics."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..sampling.logprobs import TokenLogprob
from ..sampling.params import SamplingParams
from .gamma import AcceptanceEstimate


@dataclass
class DecodeStats:
    """Counters of one request, or summed over a run (then wall time is the run's)."""

    gamma: int
    requests: int = 1
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of the prompt tokens, those whose KV came from the prefix cache
    generated_tokens: int = 0
    rounds: int = 0          # target verification calls (each emits 1..gamma+1 tokens)
    target_calls: int = 0    # rounds plus the prefill calls (one a chunk; none for a prompt all cached)
    draft_calls: int = 0     # draft-model forward passes
    drafted: int = 0         # draft tokens proposed
    accepted: int = 0        # draft tokens accepted
    rejections: int = 0      # rounds that ended by rejecting a draft
    accepted_histogram: list[int] = field(default_factory=list)  # [gamma+1]: rounds by drafts accepted
    # Per draft position i (0-based, [gamma]): rounds that proposed at least i + 1 drafts; it sums to
    # drafted. Its accepted counterpart, accepted_by_position, follows from accepted_histogram.
    drafted_by_position: list[int] = field(default_factory=list)
    # Per number of drafts k a round proposed (k >= 1; rounds without drafts are not here): those
    # rounds by drafts accepted, [k + 1]. The joint counts of the two: vLLM's per-request
    # acceptance_histogram_by_draft_length, from which its acceptance_histogram follows.
    accepted_histogram_by_draft_length: dict[int, list[int]] = field(default_factory=dict)
    wall_time_s: float = 0.0

    def __post_init__(self):
        if not self.accepted_histogram:
            self.accepted_histogram = [0] * (self.gamma + 1)
        if not self.drafted_by_position:
            self.drafted_by_position = [0] * self.gamma

    @property
    def accepted_by_position(self) -> list[int]:
        """Per draft position i (0-based, [gamma]): rounds that accepted at least i + 1 drafts. It
        sums to accepted."""
        h = self.accepted_histogram
        return [sum(h[i + 1:]) for i in range(len(h) - 1)]

    @property
    def acceptance_rate(self) -> float | None:
        """Measured alpha: accepted / (accepted + rejected) draft tests.

        Drafts after a rejection are never tested, so they count for neither (the
        maximum-likelihood estimate of a per-token acceptance probability).
        """
        tests = self.accepted + self.rejections
        return self.accepted / tests if tests else None

    @property
    def acceptance_by_position(self) -> list[float | None]:
        """Per draft position: the share of the drafts made there that were accepted (None where
        none was made). A draft is made at position i only if the round drafts that far, and
        tested only if every draft before it was accepted, so the figures tend to fall with i."""
        return [a / d if d else None for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def tokens_per_round(self) -> float | None:
        """Mean tokens emitted per target verification call."""
        return self.generated_tokens / self.rounds if self.rounds else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.generated_tokens / self.wall_time_s if self.wall_time_s > 0 else None

    @classmethod
    def combine(cls, parts: list["DecodeStats"], wall_time_s: float) -> "DecodeStats":
        total = cls(gamma=max(p.gamma for p in parts), requests=0)
        for p in parts:
            for name in ("requests", "prompt_tokens", "cached_prompt_tokens", "generated_tokens", "rounds",
                         "target_calls", "draft_calls", "drafted", "accepted", "rejections"):
                setattr(total, name, getattr(total, name) + getattr(p, name))
            for i, count in enumerate(p.accepted_histogram):
                total.accepted_histogram[i] += count
            for i, drafted in enumerate(p.drafted_by_position):
                total.drafted_by_position[i] += drafted
            for k, counts in p.accepted_histogram_by_draft_length.items():
                row = total.accepted_histogram_by_draft_length.setdefault(k, [0] * (k + 1))
                for j, count in enumerate(counts):
                    row[j] += count
        total.wall_time_s = wall_time_s
        return total

    def to_dict(self) -> dict:
        out = {k: list(v) if isinstance(v, list) else v for k, v in self.__dict__.items()}
        out["accepted_histogram_by_draft_length"] = {k: list(row) for k, row in
                                                     sorted(self.accepted_histogram_by_draft_length.items())}
        out.update(accepted_by_position=self.accepted_by_position, acceptance_rate=self.acceptance_rate,
                   acceptance_by_position=self.acceptance_by_position, tokens_per_round=self.tokens_per_round,
                   tokens_per_s=self.tokens_per_s)
        return out

    def summary(self) -> str:
        def fmt(x, spec):
            return "n/a" if x is None else format(x, spec)
        by_position = ", ".join(fmt(a, ".2f") for a in self.acceptance_by_position) or "n/a"
        return (f"{self.generated_tokens} tokens in {self.wall_time_s:.2f}s ({fmt(self.tokens_per_s, '.1f')} tok/s), "
                f"{self.rounds} rounds, {fmt(self.tokens_per_round, '.2f')} tokens/target call, "
                f"alpha {fmt(self.acceptance_rate, '.3f')}, acceptance by position [{by_position}], "
                f"accepted-length histogram {self.accepted_histogram}, "
                f"{self.target_calls} target calls, {self.draft_calls} draft calls")


FINISH_REASONS = ("stop", "length", "capacity", "abort")


@dataclass
class Result:
    prompt_token_ids: list[int]
    token_ids: list[int]         # generated tokens (an EOS that ended the request included)
    text: str | None             # generated text (None without a tokenizer)
    finish_reason: str           # "stop" (EOS or stop string), "length" (max_new_tokens), "capacity" (context
                                 # full), "abort" (Engine.abort, or a failed round)
    stats: DecodeStats
    message: str = ""            # why a request ended early, in words
    # With SamplingParams.logprobs: one per generated token (token_ids), else None.
    logprobs: list[TokenLogprob] | None = None
    # With SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing
    # precedes it), else None.
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class RequestOutput:
    """What one Engine.step() did for one request: the tokens it added, and the text they complete."""
    request_id: str
    new_token_ids: list[int]
    new_text: str | None         # None without a tokenizer; holds back an unfinished UTF-8 sequence and
                                 # a tail that may still become a stop string until the request ends
    finished: bool
    finish_reason: str | None    # one of FINISH_REASONS once finished
    stats: DecodeStats
    message: str = ""
    # With SamplingParams.logprobs: one per token of new_token_ids, else None.
    new_logprobs: list[TokenLogprob] | None = None
    # With SamplingParams.prompt_logprobs: the prompt's (as Result.prompt_logprobs), in every output.
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(eq=False)  # a request in flight is itself, not its fields
class Request:
    request_id: str
    prompt_token_ids: list[int]   # the prompt (with an encoder-decoder target: the encoder's input)
    params: SamplingParams
    seed: int
    stats: DecodeStats
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    message: str = ""
    stop_text: str | None = None  # the text cut before a stop string, when one ended the request
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # for gamma="auto"
    added_at: float = 0.0         # perf_counter() when it was added (its wall time runs from there)
    sent_tokens: int = 0          # generated tokens already reported by a RequestOutput
    sent_chars: int = 0           # characters of its text already reported
    # With an encoder-decoder target the decoded sequence starts here ([decoder_start_token_id]),
    # not at the prompt, which the encoder reads.
    decoder_start: list[int] | None = None
    # What SamplingParams.logprobs and prompt_logprobs ask for (None when they do not): one per
    # generated token, and one per prompt token (None for the first; filled as it is prefilled).
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def __post_init__(self):
        if self.logprobs is None and self.params.logprobs is not None:
            self.logprobs = []
        if self.prompt_logprobs is None and self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def sequence_start(self) -> list[int]:
        """What the decoded sequence holds before the first generated token."""
        return self.prompt_token_ids if self.decoder_start is None else self.decoder_start

    @property
    def source(self) -> list[int] | None:
        """The encoder's input (None for a decoder-only target)."""
        return None if self.decoder_start is None else self.prompt_token_ids

    @property
    def tokens(self) -> list[int]:
        return self.sequence_start + self.generated
