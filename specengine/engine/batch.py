"""The rows the engine holds, as state: the requests decoding (one row each in the target's cache
and the draft model's, in order) and, after them, those whose prompts are being prefilled
(Prefilling: a request in a staged row of each cache), with the caches themselves and the moves
that keep rows and requests in step (a row joins, leaves, or every row is dropped).

What fills the rows (staging, prefill forwards, the prefix cache's copies, the encoders) is the
model runner's (engine.runner); which rows are prefilled how far each step is the scheduler's
(engine.scheduler). A row's cache holds its sequence but the last token, which the next round
feeds. Requests leave when they finish or are aborted (keep: the other rows move to the front;
drop_prefilling for requests still being prefilled).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import torch

from ..drafters.base import Drafter
from ..layers.kv_cache import StaticKVCache
from ..sampling.batch import SamplingBatch
from ..steps.feed import PrefillCall
from .request import Request


@dataclass(eq=False)
class Prefilling:
    """A request in a staged row: its prompt being prefilled. Its prefill is `units` of work, cut
    into a step's chunks by the scheduler: prompt tokens, or for an encoder-decoder target its
    encoder's blocks (engine.runner.ModelRunner.staged_row says which)."""
    request: Request
    prefill: list[int]          # what its rows are to hold: the sequence's start but its last token
    units: int                  # its prefill's work in all
    unit_tokens: Fraction = Fraction(1)  # what a unit counts of a step's budget, in prompt tokens
    cut: int = 1                # a chunk ends at a multiple of this many units, or at the end
    done: int = 0               # units done (tokens: those its rows hold, from the prefix cache, then prefilled)
    keys: list[bytes] = field(default_factory=list)  # prefix cache keys of its full blocks
    stored: int = 0             # of those blocks, how many the prefix cache has had from it
    encoders: list | None = None  # encoder-decoder: each model's encoder run (models.t5.EncoderRun)
    # With a feature drafter: the target's features of its first `done` positions (LlamaForCausalLM.
    # capture_features), [n, F] pieces in order, handed to the drafter when it joins.
    features: list = field(default_factory=list)

    def __post_init__(self):
        if not (0 <= self.done <= self.units and self.cut >= 1 and self.unit_tokens > 0):
            raise ValueError(f"a prefill needs 0 <= done <= units, cut >= 1 and unit_tokens > 0, got done "
                             f"{self.done}, units {self.units}, cut {self.cut}, unit_tokens {self.unit_tokens}")

    @property
    def finished(self) -> bool:
        return self.done == self.units


@dataclass(frozen=True)
class PrefillChunk:
    """One row's share of a step's prefill."""
    row: Prefilling
    units: int      # of its prefill's units (Prefilling.units)
    tokens: int     # what it counts of the step's budget (prompt tokens)

    def __post_init__(self):
        if not 1 <= self.units <= self.row.units - self.row.done:
            raise ValueError(f"a chunk of {self.units} units, with {self.row.units - self.row.done} left to prefill")
        if self.tokens < 0:
            raise ValueError(f"a chunk counts tokens >= 0 of the budget, got {self.tokens}")


@dataclass(eq=False)
class PendingChunks:
    """A step's chunks whose target forward runs a few layers a step (PrefillCall.run). Their
    staged rows keep their places meanwhile: the rows before them are requests whose chunks came
    first, which cannot finish while these are pending, and a row dropped forgets them."""
    chunks: list[PrefillChunk]
    calls: list[PrefillCall]          # the target's forwards over them

    @property
    def layers_done(self) -> int:
        return self.calls[0].run.layers_done


class RunningBatch:
    def __init__(self, drafter: Drafter | None, max_seq_len: int, device: torch.device,
                 cache: StaticKVCache | None = None):
        """device: the target's (the rows' sampling parameters go there). cache: the persistent cache of fixed-shape steps (rows and capacity fixed), or None for
        a cache that grows as requests join (made when rows are first staged)."""
        self.drafter, self.max_seq_len, self.device = drafter, max_seq_len, device
        self.requests: list[Request] = []    # decoding, by row
        self.prefilling: list[Prefilling] = []     # prefilling, by staged row
        self.cache: StaticKVCache | None = cache
        self.draft_cache: StaticKVCache | None = None  # the drafter's staged_cache, once rows were staged
        self.sampling: SamplingBatch | None = None  # the rows' sampling parameters, None without rows
        self.pending: PendingChunks | None = None  # chunks whose target layers are not all run yet

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def rows_held(self) -> int:
        return len(self.requests) + len(self.prefilling)

    def caches(self) -> list[StaticKVCache]:
        """The caches that hold staged rows: the target's, the draft model's."""
        return [c for c in (self.cache, self.draft_cache) if c is not None]

    # ---- staged rows ----------------------------------------------------------------------------

    def promote(self) -> list[Prefilling]:
        """Move the staged rows whose prefill is done into the rows in use (their caches' rows
        after those decoding, their lengths as prefilled); returns them. Their requests decode
        once add_decoding has them."""
        finished = [i for i, j in enumerate(self.prefilling) if j.finished]
        joined = [self.prefilling[i] for i in finished]
        for cache in self.caches():  # their lengths as prefilled (see steps.feed.prefill_chunks)
            for i, j in zip(finished, joined):
                cache.staged_view(i, 1).lengths.fill_(len(j.prefill))
            cache.promote(finished)
        self.prefilling = [j for j in self.prefilling if not j.finished]
        return joined

    def add_decoding(self, requests: list[Request]):
        """The requests of promoted rows, in their order: they decode from the next round."""
        self.requests += requests
        self._sampling()

    def drop_prefilling(self, leaving: list[Prefilling]):
        """Forget the staged rows of these requests being prefilled (aborted, or their prefill failed)."""
        staged = [i for i, j in enumerate(self.prefilling) if j in leaving]
        if not staged:
            return
        self.prefilling = [j for j in self.prefilling if j not in leaving]
        self.pending = None  # the rows it was for moved: those left start their chunks again
        for cache in self.caches():
            cache.drop_staged(staged)

    def drop_all_prefilling(self):
        """Forget every staged row (after a failed prefill: nothing on the device is touched)."""
        self.prefilling, self.pending = [], None
        for cache in self.caches():
            cache.staged = 0

    # ---- rows in use --------------------------------------------------------------------------

    # Positions a row gets beyond its prompt when it joins; more come as it grows (make_room).
    HEADROOM = 64

    def make_room(self, positions: int):
        """Let every row reach `positions` positions (within the context). A growable cache grows
        with the sequences themselves, not with what they may reach: to twice the positions asked
        for, so a row copies it a logarithmic number of times (a long prompt that joins too), and a
        chat request allowed the whole context (SmolLM2's 8,192 positions cost 0.38 GB a row) holds
        at most twice what it uses."""
        capacity = self.grown_capacity(positions)
        if capacity == self.cache.capacity:
            return
        for cache in self.caches():
            cache.reserve(cache.allocated_rows, capacity)

    def grown_capacity(self, positions: int) -> int:
        if positions <= self.cache.capacity:
            return self.cache.capacity
        return min(self.max_seq_len, 2 * positions)

    def keep(self, rows: list[int]):
        """Keep these rows (in this order); the others' requests have left. Staged rows stay."""
        self.requests = [self.requests[i] for i in rows]
        self.cache.keep_rows(rows)
        if self.drafter is not None:
            self.drafter.keep_rows(rows)
        self._sampling()

    def clear(self):
        """Drop every row, staged ones too, whatever state the caches are in (after a failure)."""
        self.requests, self.prefilling, self.pending = [], [], None
        for cache in self.caches():
            cache.clear()
        if self.drafter is not None:
            self.drafter.keep_rows([])
        self.sampling = None

    def _sampling(self):
        requests = self.requests
        self.sampling = (SamplingBatch.from_params([r.params for r in requests], [r.seed for r in requests],
                                                   self.device) if requests else None)
