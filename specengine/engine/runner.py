"""The model runner: what carries out a step's plan (engine.scheduler.StepPlan) on the models.
It owns every forward of the engine's loop and the data that moves around them: staging the
admitted requests' rows (with the prefix cache's blocks copied in), the prefill's chunks through
the target and the draft model (steps.feed), the prefix cache's copies out of the rows, handing
a feature drafter the target's features, the requests that join the drafter, and the rounds
(engine.rounds). The scheduler decides; the runner only checks that what it did is what the plan
said (the rows that join).

A decoder-only prompt's prefill is its tokens, fed in chunks; a chunk that costs more than its
share of a round may run its target forward a few layers a step (engine.prefill_budget): it is
then pending until its last layer has run, and no other chunk starts meanwhile (the scheduler
gives its chunks again). The draft model runs each chunk whole, in the step it starts.

An encoder-decoder target (T5) differs here and only here (and in engine.intake, which gives its
requests the decoder's start token): its prefill is the encoders' pass over the prompt, which
attends both ways and so cannot be cut by tokens. It is cut by encoder blocks instead (a
Prefilling's units), the draft's encoder keeping pace; a pass done writes its cross-attention
entries into the request's staged rows. It keeps no prefix cache (an encoder reads its input both
ways: no prefix of it has entries of its own), runs no fixed-shape steps, and its drafter reads
the prompt as its target does.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from fractions import Fraction

import torch

from ..drafters.base import Drafter
from ..layers.kv_cache import StaticKVCache
from ..models.loader import Model
from ..steps.feed import continue_prefill, prefill_chunks, start_prefill
from ..steps.graphs import FixedShapeSteps
from .batch import PendingChunks, PrefillChunk, Prefilling, RunningBatch
from .outputs import score_prompt_chunk
from .phases import Phases
from .prefill_budget import CHUNK
from .prefix_cache import BLOCK, PrefixCache, default_budget
from .request import Request
from .rounds import RoundRunner
from .scheduler import Admission, PrefillDone, RowRelease, StepOutcome, StepPlan

log = logging.getLogger("specengine")


class ModelRunner:
    def __init__(self, target: Model, drafter: Drafter | None, *, max_seq_len: int, cuda_graphs: bool,
                 max_batch_size: int | None, verify_impl: str, rounds_per_read: int,
                 prefix_cache_bytes: int | str, phases: Phases):
        """The options are EngineConfig's (checked there); max_seq_len the context the rows get."""
        draft_model = drafter.model if drafter is not None else None
        encoder_decoder = target.is_encoder_decoder
        if draft_model is not None and draft_model.is_encoder_decoder != encoder_decoder:
            kinds = {True: "an encoder-decoder model", False: "a decoder-only model"}
            raise ValueError(f"the target is {kinds[encoder_decoder]} but the draft is "
                             f"{kinds[draft_model.is_encoder_decoder]}: a draft must read the prompt as its target "
                             "does (pair T5 with T5, or use the ngram drafter)")
        if encoder_decoder and cuda_graphs:
            raise ValueError("cuda_graphs runs decoder-only targets; an encoder-decoder target decodes eagerly "
                             "(drop cuda_graphs)")
        self.target, self.drafter, self.phases = target, drafter, phases
        # A feature drafter reads states of the target's layers, captured in its every forward.
        self.feature_layers = None if encoder_decoder else drafter.feature_layers if drafter is not None else ()
        self._capture_features()
        self.target_steps: FixedShapeSteps | None = None
        if cuda_graphs:
            self.target_steps = FixedShapeSteps(target, max_batch_size, max_seq_len)
            if drafter is not None:
                drafter.use_static_steps(max_batch_size, max_seq_len)
        self.rounds = RoundRunner(target, drafter, self.target_steps, verify_impl, phases, max_seq_len,
                                  rounds_per_read)
        cache_bytes = default_budget(target.device) if prefix_cache_bytes == "auto" else prefix_cache_bytes
        # Prompt prefixes' KV across requests (none for an encoder-decoder: see the module).
        self.prefix_cache = PrefixCache(cache_bytes) if cache_bytes and not encoder_decoder else None
        # A decoder-only target's chunk may run a few layers a step; an encoder's prefill is cut
        # by encoder blocks instead.
        self.chunk_layers = None if encoder_decoder else len(target.model.layers)
        self.batch = RunningBatch(drafter, max_seq_len, target.device,
                                  self.target_steps.new_batch(0) if self.target_steps is not None else None)
        self.part: str | None = None  # the part of a plan being carried out: "prefill" or "rounds"
        # What release calls when moving rows fails (Scheduler.rows_broken, set by the engine once
        # its scheduler, built on this runner's batch, exists): given "prefilling" or "running"
        # and the exception, it ends those rows' requests and returns the rows to drop.
        self.rows_broken: Callable[[str, BaseException], RowRelease] | None = None

    def staged_row(self, request: Request) -> Prefilling:
        """A request's staged row before anything is in it: its prefill in units, as the scheduler
        cuts it into chunks (a decoder-only prompt's tokens, at multiples of CHUNK; an encoder's
        blocks, a block counting its share of the prompt's tokens)."""
        prefill = request.sequence_start[:-1]
        if not self.target.is_encoder_decoder:
            return Prefilling(request, prefill, len(prefill), cut=CHUNK)
        blocks = len(self.target.encoder)
        return Prefilling(request, prefill, blocks, unit_tokens=Fraction(len(request.source), blocks))

    def _models(self) -> list[tuple[Model, StaticKVCache]]:
        """The models whose caches hold staged rows, with those caches: the target, the draft model."""
        batch = self.batch
        pairs = [(self.target, batch.cache)] if batch.cache is not None else []
        if batch.draft_cache is not None:
            pairs.append((self.drafter.model, batch.draft_cache))
        return pairs

    def _capture_features(self):
        """Have the target capture what this engine's drafter reads. Set again each step: another
        engine on the same target (a baseline beside a feature drafter's) sets its own; each step
        hands over its forwards' features before it ends."""
        if self.feature_layers is not None and self.target.feature_layers != self.feature_layers:
            self.target.capture_features(self.feature_layers)

    def run(self, plan: StepPlan) -> StepOutcome:
        """Carry out the plan: its prefill, then its rounds. Should a part fail, `part` says which
        ("prefill" or "rounds") when it raises."""
        self._capture_features()
        prefill = self.prefill(plan)
        if not plan.decoding:
            return StepOutcome(prefill, [], 0)
        self.part = "rounds"
        start = time.perf_counter()
        results, gamma = self.rounds.run(self.batch, plan.gamma, plan.rounds_per_read)
        self.part = None
        return StepOutcome(prefill, results, gamma, time.perf_counter() - start)

    def prefill(self, plan: StepPlan) -> PrefillDone | None:
        """The plan's prefill: stage its admissions, prefill its chunks; the rows it completes join.
        None when no row is admitted or staged."""
        if not (plan.admitted or self.batch.prefilling):
            return None
        self.part = "prefill"
        with self.phases("prefill"):
            start = time.perf_counter()
            tokens, share = self._prefill(plan)
        self.part = None
        return PrefillDone(tokens, share, time.perf_counter() - start)

    def release(self, release: RowRelease):
        """Free the rows the scheduler released. Should a move fail, its rows are in no known
        state: rows_broken("prefilling" or "running", exc) ends their requests and says which rows
        to drop, which are dropped whatever state they are in."""
        if self.rows_broken is None:
            raise RuntimeError("ModelRunner.release needs rows_broken set (the scheduler's) before it frees rows")
        batch = self.batch
        if release.all_rows:
            batch.clear()
            return
        if release.all_prefilling:
            batch.drop_all_prefilling()
        if release.prefilling:
            try:
                batch.drop_prefilling(list(release.prefilling))
            except Exception as exc:  # noqa: BLE001 (contained: the other joiners end with the reason)
                log.exception("freeing the row of a request being prefilled failed; those being prefilled end")
                self.release(self.rows_broken("prefilling", exc))
        if release.keep is not None:
            try:
                batch.keep(list(release.keep))
            except Exception as exc:  # noqa: BLE001 (contained: the survivors end with the reason)
                log.exception("freeing the rows of ended requests failed; the running requests end")
                self.release(self.rows_broken("running", exc))

    # ---- prefill ----------------------------------------------------------------------------------

    def _prefill(self, plan: StepPlan) -> tuple[int, float]:
        """Stage, prefill, join; returns what the chunks count of the budget and the share of
        their target layers run."""
        if plan.admitted:
            self._stage(plan.admitted)
        if self.target.is_encoder_decoder:
            tokens, share = self._encode(plan.chunks), 1.0
        else:
            tokens, share = self._feed(plan.chunks, plan.layers)
        self._join(plan.joins)
        return tokens, share

    def _stage(self, admitted: list[Admission]):
        """Give each request a staged row in every cache, holding what the prefix cache has of its prompt."""
        batch, target = self.batch, self.target
        requests = [a.row.request for a in admitted]
        rows = batch.rows_held + len(admitted)
        need = max(len(r.sequence_start) for r in requests) + batch.HEADROOM
        if batch.cache is None:
            batch.cache = target.new_cache(rows, min(need, batch.max_seq_len))
            batch.cache.reset(0)
        else:  # one reallocation at most, for rows and positions both
            batch.cache.reserve(rows, batch.grown_capacity(need))
        if self.drafter is not None and batch.draft_cache is None:
            batch.draft_cache = self.drafter.staged_cache(batch.cache.capacity)
        for model, cache in self._models():
            # Both caches' rows roll back by length, and a staged row's length is what its prefill
            # (or the prefix cache) gave it: nothing past a row's length matters.
            cache.entries_end_at_lengths = True
            cache.reserve(rows, batch.cache.capacity)
            if target.is_encoder_decoder:
                cache.reserve_source(max(len(r.source) for r in requests))
        for model, cache in self._models():
            cache.stage_rows(len(admitted))
        batch.prefilling += [a.row for a in admitted]
        for a in admitted:
            if target.is_encoder_decoder:
                a.row.encoders = [model.start_encoding([a.row.request.source]) for model, _ in self._models()]
            elif a.blocks:
                self._from_prefix_cache(a)

    def _from_prefix_cache(self, admitted: Admission):
        """Copy the prefix cache's blocks into the admitted row (and their features, for a feature drafter)."""
        j, blocks = admitted.row, admitted.blocks
        if self.target.feature_layers:
            j.features = [b.features for b in blocks]
        staged = self.batch.prefilling.index(j)
        for c, (_, cache) in enumerate(self._models()):
            row = cache.staged_view(staged, 1)
            for i, block in enumerate(blocks):
                k, v = block.kv[c]
                row.k[:, 0, i * BLOCK:(i + 1) * BLOCK] = k
                row.v[:, 0, i * BLOCK:(i + 1) * BLOCK] = v
        for _, cache in self._models():  # what the rows hold (layers.kv_cache's entries_end_at_lengths)
            cache.staged_view(staged, 1).lengths.fill_(j.done)

    def _feed(self, chunks: list[PrefillChunk], layers: int | None) -> tuple[int, float]:
        """Decoder-only prompts' chunks; returns their tokens and the share of their target
        layers run. A chunk's forward starts with the draft model's whole (a fraction of the
        target's cost) and runs `layers` of the target's layers a step."""
        if not chunks:
            return 0, 1.0
        batch = self.batch
        if batch.pending is None:
            staged = [batch.prefilling.index(c.row) for c in chunks]
            done = [c.row.done for c in chunks]
            tokens = [c.row.prefill[c.row.done:c.row.done + c.units] for c in chunks]
            whole = [len(c.row.prefill) for c in chunks]
            if batch.draft_cache is not None:
                prefill_chunks(self.drafter.model, batch.draft_cache, staged, done, tokens, whole)
            batch.pending = PendingChunks(chunks, start_prefill(self.target, batch.cache, staged, done, tokens, whole))
        elif chunks != batch.pending.chunks:
            raise ValueError("chunks are pending (their layers not all run): they come before any other")
        pending = batch.pending
        before = pending.layers_done
        scored = any(c.row.request.prompt_logprobs is not None for c in pending.chunks)
        done = [c.row.done for c in pending.chunks]
        on_hidden = ((lambda i, hidden: score_prompt_chunk(self.target, pending.chunks[i].row.request, done[i], hidden))
                     if scored else None)
        finished = continue_prefill(self.target, batch.cache, pending.calls, layers, on_hidden)
        tokens = sum(c.tokens for c in pending.chunks)
        share = (pending.layers_done - before) / len(self.target.model.layers)
        if not finished:
            return tokens, share
        batch.pending = None
        for call in pending.calls:
            for i in call.chunks:
                pending.chunks[i].row.request.stats.target_calls += 1
        if self.target.feature_layers:
            for call in pending.calls:
                for row, (i, n) in enumerate(zip(call.chunks, call.lengths)):
                    pending.chunks[i].row.features.append(call.run.features[row, :n])
        for c in pending.chunks:
            c.row.done += c.units
        if self.prefix_cache is not None:
            for c in pending.chunks:
                self._to_prefix_cache(batch.prefilling.index(c.row), c.row)
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

    def _encode(self, chunks: list[PrefillChunk]) -> int:
        """Encoder-decoder prompts: for each request, its chunk's encoder blocks of the target
        (the draft's encoder keeping pace); a pass done writes its cross-attention entries into the
        request's staged rows. Returns what the chunks count of the budget."""
        for c in chunks:
            j = c.row
            i = self.batch.prefilling.index(j)
            run, total = j.encoders[0], len(self.target.encoder)
            self.target.encode_blocks(run, c.units)
            if len(j.encoders) > 1:  # the draft's encoder keeps pace
                draft_run, draft_total = j.encoders[1], len(self.drafter.model.encoder)
                self.drafter.model.encode_blocks(
                    draft_run, math.ceil(run.blocks_done * draft_total / total) - draft_run.blocks_done)
            j.done = run.blocks_done
            if j.finished:
                for (model, cache), encoder_run in zip(self._models(), j.encoders):
                    model.finish_encoding(encoder_run, cache.staged_view(i, 1))
                j.encoders = None
                j.request.stats.target_calls += 1
        return sum(c.tokens for c in chunks)

    def _join(self, joins: list[Prefilling]):
        """The rows whose prefill is done decode from now on: into the rows in use, and into the
        drafter (a feature drafter with their prompts' features, from the prefill and the prefix
        cache). They must be the plan's."""
        batch = self.batch
        if [j for j in batch.prefilling if j.finished] != joins:
            raise RuntimeError("the prefill completed other rows than the plan said (a scheduler bug): "
                               f"{[j.request.request_id for j in batch.prefilling if j.finished]} against "
                               f"{[j.request.request_id for j in joins]}")
        if not joins:
            return
        first = len(batch.requests)
        batch.promote()
        requests = [j.request for j in joins]
        if self.drafter is not None:
            sources = [r.source for r in requests] if self.target.is_encoder_decoder else None
            self.drafter.join_rows([r.sequence_start for r in requests], batch.cache.capacity, sources)
            if self.drafter.feature_layers:
                for row, j in enumerate(joins, start=first):
                    if j.features:
                        features = torch.cat(j.features)
                        self.drafter.take_features([row], [0], features[None], [features.shape[0]])
                    j.features = []
        batch.add_decoding(requests)
