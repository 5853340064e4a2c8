"""The requests holding rows and what runs the models over them: those decoding (one row each in
the target's cache and the draft model's, in order) and, after them, those whose prompts are
being prefilled (Prefilling: a request in a staged row of each cache).

A request gets a staged row in each cache (layers.kv_cache) when it is admitted (stage):
the prompt's longest prefix of blocks found in the prefix cache is copied into it. Each step
then prefills the chunks the scheduler chose (engine.scheduler), the draft model in the same
chunks; a request whose prefill is done joins the rows in use, and the next round decodes it. A
chunk that costs more than its share of a round may run its target forward a few layers a step
(engine.prefill_budget): it is then pending until its last layer has run, and no other chunk
starts meanwhile. A row's cache holds its sequence but the last token, which the next round
feeds. Requests leave when they finish or are aborted (keep: the other rows move to the front;
drop_prefilling for requests still being prefilled). A feature drafter (drafters.eagle3) gets the
target's features of each prompt (from its chunks' forwards and the prefix cache's blocks) when
the request joins.

With an encoder-decoder target (T5) the prefill is the encoders' pass over the prompt, which
attends both ways and so cannot be cut by tokens: it is cut by encoder blocks instead, the
draft's encoder keeping pace.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..drafters.base import Drafter
from ..layers.kv_cache import StaticKVCache
from ..sampling.batch import SamplingBatch
from ..steps.feed import PrefillCall, continue_prefill, prefill_chunks, start_prefill
from ..steps.graphs import FixedShapeSteps
from .outputs import score_prompt_chunk
from .prefix_cache import BLOCK, PrefixCache, block_keys
from .request import Request


@dataclass(eq=False)
class Prefilling:
    """A request in a staged row: its prompt being prefilled."""
    request: Request
    prefill: list[int]          # what its rows are to hold: the sequence's start but its last token
    done: int = 0               # tokens of it in its rows (from the prefix cache, then prefilled)
    keys: list[bytes] = field(default_factory=list)  # prefix cache keys of its full blocks
    stored: int = 0             # of those blocks, how many the prefix cache has had from it
    encoders: list | None = None  # encoder-decoder: each model's encoder run (models.t5.EncoderRun)
    encoded: bool = True        # its encoders have run and written the cross-attention entries
    # With a feature drafter: the target's features of its first `done` positions (LlamaForCausalLM.
    # capture_features), [n, F] pieces in order, handed to the drafter when it joins.
    features: list = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.done == len(self.prefill) and self.encoded


@dataclass(eq=False)
class PendingChunks:
    """A step's chunks whose target forward runs a few layers a step (PrefillCall.run). Their
    staged rows keep their places meanwhile: the rows before them are requests whose chunks came
    first, which cannot finish while these are pending, and a row dropped forgets them."""
    work: list[tuple[Prefilling, int]]   # the requests and their chunks' tokens
    calls: list[PrefillCall]          # the target's forwards over them


@dataclass
class PrefillStep:
    """What a step's prefill did."""
    joined: list[Request]   # requests whose prefill is done: they decode from the next round
    tokens: int             # prompt tokens of the chunks it worked on
    share: float            # of those chunks' target layers, the share it ran (1.0: whole chunks)


class RunningBatch:
    def __init__(self, target, drafter: Drafter | None, target_steps: FixedShapeSteps | None,
                 max_seq_len: int, prefix_cache: PrefixCache | None = None):
        """target_steps: the persistent cache of fixed-shape steps (rows and capacity fixed), or None
        for a cache that grows as requests join."""
        self.target, self.drafter, self.max_seq_len = target, drafter, max_seq_len
        self.prefix_cache = prefix_cache
        self.requests: list[Request] = []    # decoding, by row
        self.prefilling: list[Prefilling] = []     # prefilling, by staged row
        self.cache: StaticKVCache | None = target_steps.new_batch(0) if target_steps is not None else None
        self.draft_cache: StaticKVCache | None = None  # the drafter's staged_cache, once rows were staged
        self.sampling: SamplingBatch | None = None  # the rows' sampling parameters, None without rows
        self.pending: PendingChunks | None = None  # chunks whose target layers are not all run yet

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def rows_held(self) -> int:
        return len(self.requests) + len(self.prefilling)

    def _models(self) -> list[tuple[object, StaticKVCache]]:
        """The models whose caches hold staged rows, with those caches: the target, the draft model."""
        pairs = [(self.target, self.cache)] if self.cache is not None else []
        if self.draft_cache is not None:
            pairs.append((self.drafter.model, self.draft_cache))
        return pairs

    # ---- prefilling: staged rows, prefilled a chunk a step -----------------------------------------

    def stage(self, requests: list[Request]):
        """Give each request a staged row in every cache, holding what the prefix cache has of its prompt."""
        rows = self.rows_held + len(requests)
        need = max(len(r.sequence_start) for r in requests) + self.HEADROOM
        if self.cache is None:
            self.cache = self.target.new_cache(rows, min(need, self.max_seq_len))
            self.cache.reset(0)
        else:  # one reallocation at most, for rows and positions both
            self.cache.reserve(rows, self._grown_capacity(need))
        if self.drafter is not None and self.draft_cache is None:
            self.draft_cache = self.drafter.staged_cache(self.cache.capacity)
        encoder_decoder = self.target.is_encoder_decoder
        for model, cache in self._models():
            # Both caches' rows roll back by length, and a staged row's length is what its prefill
            # (or the prefix cache) gave it: nothing past a row's length matters.
            cache.entries_end_at_lengths = True
            cache.reserve(rows, self.cache.capacity)
            if encoder_decoder:
                cache.reserve_source(max(len(r.source) for r in requests))
        # Requests admitted together take rows by prompt length: the shorter join sooner, and
        # chunks of similar length share prefill calls (row order does not matter: seeded rows
        # sample alike anywhere).
        requests = sorted(requests, key=lambda r: len(r.prompt_token_ids))
        admitted = [Prefilling(r, r.sequence_start[:-1]) for r in requests]
        for model, cache in self._models():
            cache.stage_rows(len(requests))
        self.prefilling += admitted
        for j in admitted:
            if encoder_decoder:
                j.encoders = [model.start_encoding([j.request.source]) for model, _ in self._models()]
                j.encoded = False
            elif self.prefix_cache is not None:
                self._from_prefix_cache(j)

    def _from_prefix_cache(self, j: Prefilling):
        j.keys = block_keys(j.prefill)
        if j.request.prompt_logprobs is not None:
            return  # its prompt is scored from its prefill's hidden states: prefilled whole (and cached)
        blocks = self.prefix_cache.match(j.keys, j.prefill)
        if self.target.feature_layers:  # a feature drafter needs the blocks' features too
            blocks = blocks[:next((i for i, b in enumerate(blocks) if b.features is None), len(blocks))]
            j.features = [b.features for b in blocks]
        if not blocks:
            return
        staged = self.prefilling.index(j)
        for c, (_, cache) in enumerate(self._models()):
            row = cache.staged_view(staged, 1)
            for i, block in enumerate(blocks):
                k, v = block.kv[c]
                row.k[:, 0, i * BLOCK:(i + 1) * BLOCK] = k
                row.v[:, 0, i * BLOCK:(i + 1) * BLOCK] = v
        j.stored = len(blocks)
        j.done = j.request.stats.cached_prompt_tokens = len(blocks) * BLOCK
        for _, cache in self._models():  # what the rows hold (layers.kv_cache's entries_end_at_lengths)
            cache.staged_view(staged, 1).lengths.fill_(j.done)

    def prefill(self, chunks: list[tuple[Prefilling, int]], layers: int | None = None) -> PrefillStep:
        """Prefill these chunks (a request and its chunk's tokens: the scheduler's choice), running
        `layers` of their target layers (None: all; the chunks left pending by an earlier step
        must be given again until their last layer has run); requests whose prefill is then done
        join the rows in use."""
        if self.target.is_encoder_decoder:
            tokens, share = self._encode(chunks), 1.0
        else:
            tokens, share = self._feed(chunks, layers)
        finished = [i for i, j in enumerate(self.prefilling) if j.finished]
        if not finished:
            return PrefillStep([], tokens, share)
        joined = [self.prefilling[i] for i in finished]
        for _, cache in self._models():  # their lengths as prefilled (see prefill_chunks)
            for i, j in zip(finished, joined):
                cache.staged_view(i, 1).lengths.fill_(len(j.prefill))
            cache.promote(finished)
        self.prefilling = [j for j in self.prefilling if not j.finished]
        requests = [j.request for j in joined]
        if self.drafter is not None:
            sources = [r.source for r in requests] if self.target.is_encoder_decoder else None
            self.drafter.join_rows([r.sequence_start for r in requests], self.cache.capacity, sources)
            if self.drafter.feature_layers:  # their prompts' features, from the prefill and the prefix cache
                for row, j in enumerate(joined, start=len(self.requests)):
                    if j.features:
                        features = torch.cat(j.features)
                        self.drafter.take_features([row], [0], features[None], [features.shape[0]])
                    j.features = []
        self.requests += requests
        self._sampling()
        return PrefillStep(requests, tokens, share)

    def _feed(self, chunks: list[tuple[Prefilling, int]], layers: int | None) -> tuple[int, float]:
        """Decoder-only prompts' chunks; returns their tokens and the share of their target
        layers run. A chunk's forward starts with the draft model's whole (a fraction of the
        target's cost) and runs `layers` of the target's layers a step."""
        if not chunks:
            return 0, 1.0
        if self.pending is None:
            staged = [self.prefilling.index(j) for j, _ in chunks]
            done = [j.done for j, _ in chunks]
            tokens = [j.prefill[j.done:j.done + n] for j, n in chunks]
            whole = [len(j.prefill) for j, _ in chunks]
            if self.draft_cache is not None:
                prefill_chunks(self.drafter.model, self.draft_cache, staged, done, tokens, whole)
            self.pending = PendingChunks(chunks, start_prefill(self.target, self.cache, staged, done, tokens, whole))
        elif chunks != self.pending.work:
            raise ValueError("chunks are pending (their layers not all run): they come before any other")
        pending = self.pending
        before = pending.calls[0].run.layers_done
        scored = any(j.request.prompt_logprobs is not None for j, _ in pending.work)
        done = [j.done for j, _ in pending.work]
        on_hidden = ((lambda i, hidden: score_prompt_chunk(self.target, pending.work[i][0].request, done[i], hidden))
                     if scored else None)
        finished = continue_prefill(self.target, self.cache, pending.calls, layers, on_hidden)
        tokens = sum(n for _, n in pending.work)
        share = (pending.calls[0].run.layers_done - before) / len(self.target.model.layers)
        if not finished:
            return tokens, share
        self.pending = None
        for call in pending.calls:
            for i in call.chunks:
                pending.work[i][0].request.stats.target_calls += 1
        if self.target.feature_layers:
            for call in pending.calls:
                for row, (i, n) in enumerate(zip(call.chunks, call.lengths)):
                    pending.work[i][0].features.append(call.run.features[row, :n])
        for j, n in pending.work:
            j.done += n
        if self.prefix_cache is not None:
            for j, _ in pending.work:
                self._to_prefix_cache(self.prefilling.index(j), j)
        return tokens, share

    def _to_prefix_cache(self, staged: int, j: Prefilling):
        """Give the prefix cache the blocks of j's prompt that its prefill has now completed."""
        full = j.done // BLOCK
        if full <= j.stored:
            self.prefix_cache.touch(j.keys[:full])
            return
        a, b = j.stored * BLOCK, full * BLOCK
        kv = []
        for _, cache in self._models():
            row = cache.staged_view(staged, 1)
            kv.append((row.k[:, 0, a:b], row.v[:, 0, a:b]))
        features = torch.cat(j.features)[a:b] if self.target.feature_layers else None
        self.prefix_cache.store(j.keys, j.prefill, j.stored, kv, features)
        j.stored = full

    def _encode(self, chunks: list[tuple[Prefilling, int]]) -> int:
        """Encoder-decoder prompts: for each request, `blocks` of the target's encoder blocks (the
        draft's encoder keeping pace); a pass done writes its cross-attention entries into the
        request's staged rows. Returns the budget's tokens spent (a block over S tokens counts as
        S / blocks)."""
        spent = 0
        for j, blocks in chunks:
            i = self.prefilling.index(j)
            run, total = j.encoders[0], len(self.target.encoder)
            self.target.encode_blocks(run, blocks)
            if len(j.encoders) > 1:  # the draft's encoder keeps pace
                draft_run, draft_total = j.encoders[1], len(self.drafter.model.encoder)
                self.drafter.model.encode_blocks(
                    draft_run, math.ceil(run.blocks_done * draft_total / total) - draft_run.blocks_done)
            spent += math.ceil(blocks * len(j.request.source) / total)
            if run.blocks_done == total:
                for (model, cache), encoder_run in zip(self._models(), j.encoders):
                    model.finish_encoding(encoder_run, cache.staged_view(i, 1))
                j.encoders, j.encoded = None, True
                j.request.stats.target_calls += 1
        return spent

    def drop_prefilling(self, leaving: list[Prefilling]):
        """Forget the staged rows of these requests being prefilled (aborted, or their prefill failed)."""
        staged = [i for i, j in enumerate(self.prefilling) if j in leaving]
        if not staged:
            return
        self.prefilling = [j for j in self.prefilling if j not in leaving]
        self.pending = None  # the rows it was for moved: those left start their chunks again
        for _, cache in self._models():
            cache.drop_staged(staged)

    def drop_all_prefilling(self):
        """Forget every staged row (after a failed prefill: nothing on the device is touched)."""
        self.prefilling, self.pending = [], None
        for _, cache in self._models():
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
        capacity = self._grown_capacity(positions)
        if capacity == self.cache.capacity:
            return
        for _, cache in self._models():
            cache.reserve(cache.allocated_rows, capacity)

    def _grown_capacity(self, positions: int) -> int:
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
        for _, cache in self._models():
            cache.clear()
        if self.drafter is not None:
            self.drafter.keep_rows([])
        self.sampling = None

    def _sampling(self):
        device = self.target.device
        self.sampling = SamplingBatch.from_params([r.params for r in self.requests],
                                                  [r.seed for r in self.requests], device) if self.requests else None
