"""The requests decoding now: one row each in the target's cache and the drafter's, in order.

Requests join at round boundaries (admit: their rows are appended and prefilled) and leave when
they finish or are aborted (keep: the other rows move to the front). A row's cache holds its
sequence but the last token, which the next round feeds.
"""
from __future__ import annotations

from ..drafters.base import Drafter
from ..layers.kv_cache import StaticKVCache
from ..models.llama import LlamaForCausalLM
from ..sampling.batch import SamplingBatch
from .graphs import StepGraphs
from .request import Request
from .runner import feed


class RunningBatch:
    def __init__(self, target: LlamaForCausalLM, drafter: Drafter | None, target_steps: StepGraphs | None,
                 max_seq_len: int):
        """target_steps: the persistent cache of fixed-shape steps (rows and capacity fixed), or None
        for a cache that grows as requests join."""
        self.target, self.drafter, self.max_seq_len = target, drafter, max_seq_len
        self.requests: list[Request] = []
        self.cache: StaticKVCache | None = target_steps.new_batch(0) if target_steps is not None else None
        self.sampling: SamplingBatch | None = None  # the rows' sampling parameters, None without rows

    def __len__(self) -> int:
        return len(self.requests)

    def row_capacity(self, request: Request) -> int:
        """Positions the request can reach: its prompt and max_new_tokens, within the context."""
        return min(self.max_seq_len, len(request.prompt_token_ids) + request.params.max_new_tokens)

    def admit(self, requests: list[Request], prefill_draft: bool = True):
        """Append a row per request and prefill it. prefill_draft=False leaves the draft model's
        prefill to the request's first drafting round (gamma="auto" may never draft for it)."""
        rows, need = len(self.requests) + len(requests), max(self.row_capacity(r) for r in requests)
        if self.cache is None:
            self.cache = self.target.new_cache(rows, need)
            self.cache.reset(0)
        elif rows > self.cache.allocated_rows or need > self.cache.capacity:
            # Capacity grows at least twofold (within the context), as rows do: few copies as requests join.
            capacity = max(need, min(self.max_seq_len, 2 * self.cache.capacity)) if need > self.cache.capacity \
                else self.cache.capacity
            self.cache.reserve(rows, capacity)
        # Rows are appended by prompt length, a group of similar lengths per prefill call: a call
        # pads every row to its longest (row order does not matter; seeded rows sample alike anywhere).
        requests = sorted(requests, key=lambda r: len(r.prompt_token_ids))
        for group in _similar_lengths([len(r.prompt_token_ids) - 1 for r in requests]):
            chunks = [requests[i].prompt_token_ids[:-1] for i in group]
            feed(self.target, self.cache.add_rows(len(group)), chunks, cached=[0] * len(group))
        prompts = [r.prompt_token_ids for r in requests]
        if self.drafter is not None:
            self.drafter.add_rows(prompts, self.cache.capacity, prefill=prefill_draft)
        for r in requests:
            r.stats.target_calls += len(r.prompt_token_ids) > 1
        self.requests += requests
        self._sampling()

    def keep(self, rows: list[int]):
        """Keep these rows (in this order); the others' requests have left."""
        self.requests = [self.requests[i] for i in rows]
        self.cache.keep_rows(rows)
        if self.drafter is not None:
            self.drafter.keep_rows(rows)
        self._sampling()

    def _sampling(self):
        device = self.target.device
        self.sampling = SamplingBatch.from_params([r.params for r in self.requests],
                                                  [r.seed for r in self.requests], device) if self.requests else None


def _similar_lengths(lengths: list[int]) -> list[list[int]]:
    """Consecutive groups of indices into ascending lengths, each padded to its longest with at most
    a quarter (or 64 tokens) of padding over its real tokens."""
    groups: list[list[int]] = []
    real = 0
    for i, n in enumerate(lengths):
        if groups and (len(groups[-1]) + 1) * n <= real + n + max((real + n) // 4, 64):
            groups[-1].append(i)
            real += n
        else:
            groups.append([i])
            real = n
    return groups
