"""What requests gain: a round's tokens applied under the stop conditions (EOS, max_new_tokens,
stop strings, a full context), the statistics they count, and the outputs and results reported;
and the log-probabilities of a prompt's tokens, from its prefill (score_prompt_chunk)."""
from __future__ import annotations

import logging
import time
from collections.abc import Collection

import torch

from ..sampling.logprobs import request_logprobs
from .request import Request, RequestOutput, Result
from .rounds import RoundResult
from .text import settled_length

log = logging.getLogger("specengine")


class Outputs:
    def __init__(self, tokenizer, eos_token_ids: Collection[int], max_seq_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_seq_len = max_seq_len

    def apply(self, r: Request, outcome: RoundResult):
        """Count a row's rounds in its statistics and append its tokens."""
        s = r.stats
        s.rounds += outcome.rounds
        s.target_calls += outcome.rounds
        s.draft_calls += outcome.draft_calls
        s.accepted += outcome.accepted
        s.rejections += outcome.rejections
        for emitted, drafted in zip(outcome.emitted, outcome.drafted):
            s.drafted += drafted
            s.accepted_histogram[emitted - 1] += 1
            for position in range(drafted):
                s.drafted_by_position[position] += 1
            if drafted:
                s.accepted_histogram_by_draft_length.setdefault(drafted, [0] * (drafted + 1))[emitted - 1] += 1
        if r.logprobs is not None:
            r.logprobs += outcome.logprobs
        self._append(r, outcome.tokens)
        if r.finish_reason is not None:
            r.stats.wall_time_s = time.perf_counter() - r.added_at

    def _append(self, r: Request, new_tokens: list[int]):
        """Append a round's tokens, ending the request exactly at EOS, max_new_tokens or a stop string."""
        before = len(r.generated)
        for token in new_tokens:
            r.generated.append(token)
            if token in self.eos_token_ids and not r.params.ignore_eos:
                r.finish_reason = "stop"
                break
            if len(r.generated) == r.params.max_new_tokens:
                r.finish_reason = "length"
                break
        if r.params.stop and self.tokenizer is not None:
            self._check_stop_strings(r, before)
        if r.finish_reason is None and len(r.sequence_start) + len(r.generated) >= self.max_seq_len:
            r.finish_reason = "capacity"
            r.message = (f"stopped after {len(r.generated)} tokens: the context of {self.max_seq_len} tokens is full "
                         f"(it began with {len(r.sequence_start)}); the partial output is kept")
            log.warning(r.message)
        r.stats.generated_tokens = len(r.generated)
        if r.logprobs is not None:  # those of tokens past the request's end go with them
            del r.logprobs[len(r.generated):]

    def _check_stop_strings(self, r: Request, before: int):
        decode = self.tokenizer.decode
        text = decode(r.generated, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in r.params.stop) if i >= 0]
        if not hits:
            return
        cut = min(hits)
        # Keep tokens up to the one that completed the stop string; the text ends before it.
        for n in range(before + 1, len(r.generated) + 1):
            if any(s in decode(r.generated[:n], skip_special_tokens=True) for s in r.params.stop):
                del r.generated[n:]
                break
        r.stop_text = text[:cut]
        r.finish_reason = "stop"

    def text(self, r: Request) -> str | None:
        if r.stop_text is not None:
            return r.stop_text
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(r.generated, skip_special_tokens=True)

    def output(self, r: Request) -> RequestOutput:
        """The tokens and text r gained since its last output."""
        new_tokens = r.generated[r.sent_tokens:]
        new_logprobs = r.logprobs[r.sent_tokens:] if r.logprobs is not None else None
        r.sent_tokens = len(r.generated)
        new_text = None
        if self.tokenizer is not None:
            text = self.text(r)
            end = len(text) if r.finish_reason is not None else settled_length(text, r.params.stop)
            new_text = text[r.sent_chars:end] if end > r.sent_chars else ""
            r.sent_chars = max(r.sent_chars, end)
        return RequestOutput(r.request_id, new_tokens, new_text, r.finish_reason is not None, r.finish_reason,
                             r.stats, r.message, new_logprobs, r.prompt_logprobs)

    def result(self, r: Request) -> Result:
        return Result(r.prompt_token_ids, list(r.generated), self.text(r), r.finish_reason, r.stats, r.message,
                      None if r.logprobs is None else list(r.logprobs), r.prompt_logprobs)


# Prompt positions scored at a time: their logits [n, V] float32 (0.2 GB at SmolLM2's vocabulary).
SCORED_POSITIONS = 1024


def score_prompt_chunk(target, r: Request, start: int, hidden: torch.Tensor):
    """Append the log-probabilities of r's prompt tokens start + 1 ... start + n to
    r.prompt_logprobs (when it asks for them), from the target's hidden states [n, D] of its
    prefill at positions start ... start + n - 1 (each predicts the token after it)."""
    if r.prompt_logprobs is None:
        return
    if len(r.prompt_logprobs) != start + 1:
        raise RuntimeError(f"request {r.request_id}: prompt positions from {start} scored after "
                           f"{len(r.prompt_logprobs) - 1} (a prompt scored in order, without the prefix cache)")
    for a in range(0, hidden.shape[0], SCORED_POSITIONS):
        part = hidden[a:a + SCORED_POSITIONS]
        tokens = r.prompt_token_ids[start + a + 1:start + a + 1 + part.shape[0]]
        r.prompt_logprobs += request_logprobs(target.logits(part), tokens, r.params, r.params.prompt_logprobs)
