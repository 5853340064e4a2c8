"""The requests decoding now: one row each in the target's cache and the drafter's, in order.

Requests join at round boundaries (admit: their rows are appended and prefilled) and leave when
they finish or are aborted (keep: the other rows move to the front). A row's cache holds its
sequence but the last token, which the next round feeds.
"""
from __future__ import annotations

from ..drafters.base import Drafter
from ..layers.kv_cache import StaticKVCache
from ..sampling.batch import SamplingBatch
from ..steps.graphs import FixedShapeSteps
from .request import Request
from ..steps.feed import append_prompts


class RunningBatch:
    def __init__(self, target, drafter: Drafter | None, target_steps: FixedShapeSteps | None,
                 max_seq_len: int):
        """target_steps: the persistent cache of fixed-shape steps (rows and capacity fixed), or None
        for a cache that grows as requests join."""
        self.target, self.drafter, self.max_seq_len = target, drafter, max_seq_len
        self.requests: list[Request] = []
        self.cache: StaticKVCache | None = target_steps.new_batch(0) if target_steps is not None else None
        self.sampling: SamplingBatch | None = None  # the rows' sampling parameters, None without rows

    def __len__(self) -> int:
        return len(self.requests)

    def admit(self, requests: list[Request], prefill_draft: bool = True):
        """Append a row per request and prefill it. prefill_draft=False leaves the draft model's
        prefill to the request's first drafting round (gamma="auto" may never draft for it)."""
        rows = len(self.requests) + len(requests)
        need = max(len(r.sequence_start) for r in requests) + self.HEADROOM
        if self.cache is None:
            self.cache = self.target.new_cache(rows, min(need, self.max_seq_len))
            self.cache.reset(0)
        else:  # one reallocation at most, for rows and positions both
            self.cache.reserve(rows, self._grown_capacity(need))
        # Rows are appended by prompt length, for prefill (and encoder) calls over prompts of
        # similar length (row order does not matter: seeded rows sample alike anywhere).
        requests = sorted(requests, key=lambda r: len(r.prompt_token_ids))
        prompts = [r.sequence_start for r in requests]
        sources = [r.source for r in requests] if self.target.is_encoder_decoder else None
        append_prompts(self.target, self.cache, prompts, sources)
        if self.drafter is not None:
            self.drafter.add_rows(prompts, self.cache.capacity, prefill=prefill_draft, sources=sources)
        for r in requests:
            r.stats.target_calls += len(r.sequence_start) > 1 or sources is not None
        self.requests += requests
        self._sampling()

    # Positions a row gets beyond its prompt when it joins; more come as it grows (make_room).
    HEADROOM = 64

    def make_room(self, positions: int):
        """Let every row reach `positions` positions (within the context). A growable cache grows
        with the sequences themselves, not with what they may reach: at least twofold each time, so
        a row copies it a logarithmic number of times, and a chat request allowed the whole context
        (SmolLM2's 8,192 positions cost 0.38 GB a row) holds only what it uses."""
        capacity = self._grown_capacity(positions)
        if capacity == self.cache.capacity:
            return
        self.cache.reserve(self.cache.allocated_rows, capacity)
        if self.drafter is not None:
            self.drafter.reserve(capacity)

    def _grown_capacity(self, positions: int) -> int:
        if positions <= self.cache.capacity:
            return self.cache.capacity
        return min(self.max_seq_len, max(positions, 2 * self.cache.capacity))

    def keep(self, rows: list[int]):
        """Keep these rows (in this order); the others' requests have left."""
        self.requests = [self.requests[i] for i in rows]
        self.cache.keep_rows(rows)
        if self.drafter is not None:
            self.drafter.keep_rows(rows)
        self._sampling()

    def clear(self):
        """Drop every row, whatever state the caches are in (after a failure)."""
        self.requests = []
        if self.cache is not None:
            self.cache.clear()
        if self.drafter is not None:
            self.drafter.keep_rows([])
        self.sampling = None

    def _sampling(self):
        device = self.target.device
        self.sampling = SamplingBatch.from_params([r.params for r in self.requests],
                                                  [r.seed for r in self.requests], device) if self.requests else None

