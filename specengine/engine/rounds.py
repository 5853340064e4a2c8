"""Rounds: how the engine turns the running batch into what each row emitted.

A round, for every row of the batch:
  1. draft: the drafter proposes up to gamma tokens (fewer near the row's limits);
  2. verify: the target scores [last token, drafts] in one forward, and Algorithm 1's accept /
     resample / bonus step (ops.verify) keeps a prefix of the drafts and one token more, setting
     both caches' lengths to what the sequence then holds (that is the whole rollback);
  3. record: the round's entry (its tokens, how many, the drafts proposed, whether the draft's
     and the target's logits were finite) goes into the rounds' log.

The rounds between two reads from the device share one log, an int64 tensor [rows, columns] laid
out by RoundLog: it goes to the device in one copy and comes back in one read, which gives each
row a RoundResult. How many rounds per read: the step's plan says how many at most
(engine.scheduler, from EngineConfig.rounds_per_read and the rows' room), and the round runner
runs one where its drafter cannot draft from device state now:
  - one, a host round: drafted from the host's sequences (any drafter), the target's forward run
    eagerly on a growing cache or as a fixed-shape step (steps.graphs), read at once;
  - a block of several, on the fixed-shape steps: each round also writes the next round's inputs
    (each row's last two tokens and length) into the log, so that a whole round is device ops,
    one graph per (batch bucket, gamma) replayed back to back on a GPU. The scheduler chooses the
    block so that every round in it drafts exactly what a host round would (full budgets for every
    row), so the tokens are the same; rows that stop inside a block (EOS, a stop string) are trimmed when
    it is read (the rounds computed past their end count in their statistics).

A row whose logits broke (NaN, +inf) keeps nothing of the rounds read: rows are independent, so
the others' tokens stand. A row that asks for log-probabilities has them from its round's
verification logits (no forward more), so while such a row runs every round is a host round.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..drafters.base import Drafter, Proposal
from ..ops.verify import verify
from ..sampling.batch import SamplingBatch, fill_sampling_buffers, rows_valid, sampling_buffers
from ..sampling.logprobs import TokenLogprob, token_logprobs
from ..steps.feed import to_device
from ..steps.graphs import FixedShapeSteps
from .phases import Phases
from .request import Request

if TYPE_CHECKING:  # annotations only: the batch's module reaches this one through outputs
    from .batch import RunningBatch


@dataclass
class RoundResult:
    """What one row got from the rounds of one read."""
    tokens: list[int]           # emitted, in order (before stop conditions are applied)
    emitted: list[int]          # per round: tokens emitted (1 + drafts accepted)
    drafted: list[int]          # per round: drafts proposed
    draft_calls: int            # draft-model forward passes
    failure: str | None = None  # why the row keeps nothing of these rounds (its logits broke)
    logprobs: list[TokenLogprob] | None = None  # one per token, for a row that asks (SamplingParams.logprobs)

    def __post_init__(self):
        if not self.emitted or len(self.emitted) != len(self.drafted):
            raise ValueError(f"a result needs one count per round, got emitted {self.emitted}, drafted {self.drafted}")
        if self.failure is None and sum(self.emitted) != len(self.tokens):
            raise ValueError(f"{len(self.tokens)} tokens, but rounds emitting {self.emitted}")

    @property
    def rounds(self) -> int:
        return len(self.emitted)

    @property
    def accepted(self) -> int:
        return sum(self.emitted) - self.rounds

    @property
    def rejections(self) -> int:
        """Rounds that ended by rejecting a draft."""
        return sum(e - 1 < d for e, d in zip(self.emitted, self.drafted))


@dataclass(frozen=True)
class RoundLog:
    """The layout of the rounds' log, an int64 tensor [rows, columns], one row per batch row: its
    last two tokens and its length (the next round's inputs), the column where the next round's
    entry starts (advanced by `width` each round, so that one graph serves every round of a block),
    then an entry per round: [count, drafts, draft logits finite, target logits finite, then the
    gamma + 1 tokens emitted, the first `count` of them valid]."""
    gamma: int   # the drafts a round proposes at most
    rounds: int  # the most rounds between two reads

    INPUTS = 4  # columns before the entries: last two tokens, length, where the next entry starts
    FIELDS = 4  # columns of an entry before its tokens: count, drafts, the two checks

    def __post_init__(self):
        if not (isinstance(self.gamma, int) and self.gamma >= 0 and isinstance(self.rounds, int) and self.rounds >= 1):
            raise ValueError(f"a log needs gamma >= 0 and rounds >= 1, got {self.gamma} and {self.rounds}")

    @property
    def width(self) -> int:
        return self.FIELDS + self.gamma + 1

    @property
    def columns(self) -> int:
        return self.entry(self.rounds)

    def entry(self, r: int) -> int:
        """The column where round r's entry starts."""
        return self.INPUTS + self.width * r

    def start(self, sequences: list[list[int]], padding: int = 0, capacity: int = 0) -> list[list[int]]:
        """The log before the first round (host lists: it goes to the device in one copy), for
        sequences and `padding` rows more at the spill slot (length `capacity`). A one-token
        sequence's first "last token" is 0 (only a block reads it, and a block needs two)."""
        entries = [0] * (self.width * self.rounds)
        first = self.entry(0)
        return ([[s[-2] if len(s) > 1 else 0, s[-1], len(s), first] + entries for s in sequences]
                + [[0, 0, capacity, first] + entries] * padding)

    # Views of the log [rows, columns] (narrow and select: one op each, where indexing takes two).
    @staticmethod
    def last_two(log: torch.Tensor) -> torch.Tensor:
        return log.narrow(1, 0, 2)  # [rows, 2]

    @staticmethod
    def last_token(log: torch.Tensor) -> torch.Tensor:
        return log.narrow(1, 1, 1)  # [rows, 1]

    @staticmethod
    def lengths(log: torch.Tensor) -> torch.Tensor:
        return log.select(1, 2)  # [rows]

    def record(self, log: torch.Tensor, emitted: torch.Tensor, counts: torch.Tensor, drafts: torch.Tensor,
               draft_finite: torch.Tensor, target_finite: torch.Tensor):
        """Write a round's entry. emitted [rows, gamma + 1] int64; counts, drafts [rows] int64;
        draft_finite, target_finite [rows] bool."""
        start = log.narrow(1, 3, 1)  # [rows, 1]
        entry = torch.cat([torch.stack([counts, drafts, draft_finite, target_finite], dim=1), emitted], dim=1)
        log.scatter_(1, start + torch.arange(self.width, device=log.device), entry)
        start += self.width

    def results(self, rows: list[list[int]], rounds: int, draft_calls: int) -> list[RoundResult]:
        """Each row's result from the log read back (host lists) after `rounds` rounds, a row whose
        logits were not finite failing with what broke first."""
        results = []
        for row in rows:
            tokens, emitted, drafted, broken = [], [], [], None
            for r in range(rounds):
                start = self.entry(r) + self.FIELDS
                count, drafts, *finite = row[start - self.FIELDS:start]
                tokens += row[start:start + count]
                emitted.append(count)
                drafted.append(drafts)
                name = next((name for name, ok in zip(("draft", "target"), finite) if not ok), None)
                if broken is None and name is not None:
                    broken = (f"{name} logits contain NaN or infinite entries (round {r + 1} of {rounds} read "
                              "together); nothing of those rounds was kept")
            results.append(RoundResult(tokens, emitted, drafted, draft_calls, broken))
        return results


def rooms(requests: list[Request], max_seq_len: int) -> list[int]:
    """Tokens each request may still emit: within its max_new_tokens and the context."""
    return [min(r.params.max_new_tokens - len(r.generated), max_seq_len - len(r.tokens)) for r in requests]


def rounds_that_fit(rooms: list[int], gamma: int) -> int:
    """How many rounds every row can run with a full budget of gamma drafts, for rows with `rooms`
    tokens left (the fewer of max_new_tokens - generated and capacity - length): a round emits at
    most gamma + 1 tokens and drafts gamma only while gamma + 1 tokens remain."""
    return max(0, min((room - 1 - gamma) // (gamma + 1) + 1 for room in rooms))


_UNMARKED = Phases()  # the parts of a round inside a block: the block marks each whole round


@dataclass(frozen=True)
class _ReadSetup:
    """The rounds before one read, set up (a host round's or a block's): the batch rows' log [rows,
    layout.columns] on the device (of a block, a view of its bucket's), the draft model's calls in
    all, and the call that runs the next round."""
    layout: RoundLog
    log: torch.Tensor
    draft_calls: int
    run_round: Callable[[], torch.Tensor | None]


class RoundRunner:
    """Runs the running batch's rounds, up to the plan's rounds per read before each read (see the
    module's docstring); the model runner's (engine.runner). rounds_per_read: the setting, the
    most a block's log holds."""

    def __init__(self, target, drafter: Drafter | None, target_steps: FixedShapeSteps | None, verify_impl: str,
                 phases: Phases, max_seq_len: int, rounds_per_read: int = 1):
        if rounds_per_read > 1 and target_steps is None:
            raise ValueError("blocks of rounds from device state run on the fixed-shape steps (cuda_graphs)")
        self.target, self.drafter, self.target_steps = target, drafter, target_steps
        self.verify_impl, self.phases, self.max_seq_len = verify_impl, phases, max_seq_len
        self.rounds_per_read = rounds_per_read
        self.rounds_run = 0  # rounds of the running batch so far
        self._empty_proposals: dict[tuple[int, str], Proposal] = {}  # see _no_drafts

    def run(self, batch: RunningBatch, gamma: int, rounds_per_read: int) -> tuple[list[RoundResult], int]:
        """The next rounds of every row of the batch, drafting up to gamma tokens per row and round,
        up to the next read (up to rounds_per_read rounds, the plan's: engine.scheduler): each row's
        result, and the drafts a round made per row at most (fewer than gamma near the rows' limits)."""
        sequences = [r.tokens for r in batch.requests]
        rounds = self._rounds_before_read(sequences, gamma, rounds_per_read)
        # A round writes each row's last token and up to gamma drafts.
        batch.make_room(max(len(s) for s in sequences) + rounds * (gamma + 1))
        setup = self._host_round(batch, sequences, gamma) if rounds == 1 else \
            self._block(batch.sampling, sequences, gamma, rounds)
        for _ in range(rounds):
            logits = setup.run_round()
        layout = setup.layout
        results = layout.results(_read_back(setup.log), rounds, setup.draft_calls)
        if layout.gamma > 0:
            # Where each row's last round started, and where verification left it.
            self.drafter.verified([len(s) + sum(r.emitted[:-1]) for s, r in zip(sequences, results)], layout.gamma,
                                  [len(s) + sum(r.emitted) for s, r in zip(sequences, results)])
        if rounds == 1:  # what only a host round's verification (its logits and features, not overwritten) gives
            self._after_host_round(batch, sequences, results, logits)
        self.rounds_run += rounds
        return results, layout.gamma

    def _rounds_before_read(self, sequences: list[list[int]], gamma: int, most: int) -> int:
        """The plan's rounds per read, or one (a host round) where the drafter cannot draft from
        device state now: what the scheduler cannot see."""
        if most > 1 and gamma == 0 and self.drafter is not None and self.drafter.feature_layers:
            return 1  # a feature drafter takes every verification's features: a round without drafts hands them over
        if most > 1 and gamma > 0 and not self.drafter.runs_in_device_rounds(sequences, gamma):
            return 1  # a host round first: its catch-up feeds the draft model what rounds at gamma 0 skipped
        return most

    def _round(self, layout: RoundLog, log: torch.Tensor, proposal: Proposal, sampling: SamplingBatch,
               forward: Callable[[torch.Tensor], torch.Tensor], target_lengths: torch.Tensor,
               draft_lengths: torch.Tensor | None, phases: Phases) -> tuple[torch.Tensor, ...]:
        """One round from its proposal, recorded in log [rows, layout.columns]: the target's forward
        (inputs [rows, G+1] -> logits [rows, G+1, V]), verification, which sets the caches' lengths
        (target_lengths [rows] int64, draft_lengths [rows] int64 or None: no draft cache) to what
        the sequences then hold, and the round's entry. Returns logits, emitted [rows, G+1] and
        counts [rows]."""
        lengths = layout.lengths(log).contiguous()  # [rows]: where the round's first token lands (its uniforms' key)
        with phases("verify"):
            logits = forward(torch.cat([layout.last_token(log), proposal.tokens], dim=1))
        with phases("accept"):
            emitted, counts = verify(logits, proposal.logits, proposal.tokens, proposal.num_drafts,
                                     sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p,
                                     sampling.seeds, lengths, target_lengths=target_lengths,
                                     draft_lengths=draft_lengths, impl=self.verify_impl, filters=sampling.filters)
            # Checked now, read with the log: a broken row's tokens are never kept.
            draft_finite = (rows_valid(proposal.logits) if proposal.logits is not None
                            else torch.ones_like(counts, dtype=torch.bool))
            layout.record(log, emitted, counts, proposal.num_drafts, draft_finite, rows_valid(logits))
        return logits, emitted, counts

    # ---- a host round: drafted from the host's sequences, read at once ------------------------

    def _host_round(self, batch: RunningBatch, sequences: list[list[int]], gamma: int) -> _ReadSetup:
        """A host round, drafted now from the host's sequences by any drafter (up to gamma drafts a
        row, fewer near its limits); its round runs the target's forward eagerly on the batch's
        cache or as a fixed-shape step, and returns its logits."""
        cache = batch.cache
        budgets = [min(gamma, room - 1) for room in rooms(batch.requests, self.max_seq_len)]
        with self.phases("draft"):
            proposal = self._propose(sequences, budgets, batch)
        G = proposal.tokens.shape[1]
        layout = RoundLog(G, 1)
        log = to_device(layout.start(sequences), torch.int64, self.target.device)  # [B, layout.columns]
        kv_len = max(len(s) for s in sequences) + G

        def forward(inputs):  # [B, G+1] -> [B, G+1, V], at each row's cache length
            if self.target_steps is not None:
                return self.target_steps(inputs, cache.lengths)
            return self.target.logits(self.target(inputs, cache.lengths.clone(), cache, kv_len=kv_len))

        # The draft model's staged cache holds the target's positions: the drafts it fed past a
        # rejection are forgotten with the target's (a round without drafts leaves it shorter).
        draft_lengths = batch.draft_cache.lengths if G > 0 and batch.draft_cache is not None else None

        def run_round() -> torch.Tensor:
            return self._round(layout, log, proposal, batch.sampling, forward, cache.lengths, draft_lengths,
                               self.phases)[0]
        return _ReadSetup(layout, log, proposal.draft_calls, run_round)

    def _after_host_round(self, batch: RunningBatch, sequences: list[list[int]], results: list[RoundResult],
                          logits: torch.Tensor):
        """What a host round's read hands on from its verification (logits [B, G+1, V]): a feature
        drafter's features of the tokens kept, and the log-probabilities of rows that ask for them."""
        if self.drafter is not None and self.drafter.feature_layers:
            # The verification forward's features (LlamaForCausalLM.capture_features) of the tokens it
            # kept: each row's last token and its accepted drafts; those of rejected drafts are dropped.
            kept = [len(r.tokens) if r.failure is None else 0 for r in results]
            self.drafter.take_features(list(range(len(sequences))), [len(s) - 1 for s in sequences],
                                       self.target.features, kept)
        active = batch.requests
        scored = [i for i, r in enumerate(active) if r.logprobs is not None and results[i].failure is None]
        if scored:
            self._score(results, scored, active, logits, batch.sampling)

    def _propose(self, sequences: list[list[int]], budgets: list[int], batch: RunningBatch) -> Proposal:
        if self.drafter is None or max(budgets) == 0:
            return self._no_drafts(len(sequences), self.target.device)
        return self.drafter.propose(sequences, budgets, batch.sampling)

    def _no_drafts(self, rows: int, device) -> Proposal:
        """The proposal of a round without drafts, built once per batch size (nothing writes to
        it): not two new tensors a round (measured: bench/results/host-overheads-2026-11-29-to-12-03.md)."""
        key = (rows, str(device))
        if key not in self._empty_proposals:
            self._empty_proposals[key] = Proposal(torch.zeros(rows, 0, dtype=torch.int64, device=device),
                                                  torch.zeros(rows, dtype=torch.int64, device=device), None, 0)
        return self._empty_proposals[key]

    @staticmethod
    def _score(results: list[RoundResult], scored: list[int], active: list[Request], logits: torch.Tensor,
               sampling: SamplingBatch):
        """The log-probabilities of the tokens the scored rows emitted, from the round's
        verification logits [B, G+1, V]: a row's token i (an accepted draft, then the resampled or
        bonus token) was decided at position i, under the target's distribution there. Only rows
        that ask for them pay for them."""
        rows = [i for i in scored for _ in results[i].tokens]
        positions = [n for i in scored for n in range(len(results[i].tokens))]
        tokens = [t for i in scored for t in results[i].tokens]
        device = logits.device
        index = to_device(rows, torch.int64, device)
        found = iter(token_logprobs(logits[index, to_device(positions, torch.int64, device)],
                                    to_device(tokens, torch.int64, device), sampling.temperature[index],
                                    sampling.top_k[index], sampling.top_p[index], sampling.min_p[index],
                                    [active[i].params.logprobs for i in rows]))
        for i in scored:
            results[i].logprobs = [next(found) for _ in results[i].tokens]

    # ---- a block: rounds from device state, read once -----------------------------------------

    @torch.inference_mode()
    def _block(self, sampling: SamplingBatch, sequences: list[list[int]], gamma: int, rounds: int) -> _ReadSetup:
        """A block of `rounds` rounds of gamma drafts for every row (sequences of at least two
        tokens, each with room for them: see rounds_that_fit), on the batch's bucket. Each round is
        one call of _device_round: on a GPU one graph replay, with nothing between replays on the
        host; it returns None (its logits are the next round's buffers)."""
        steps, drafter, B = self.target_steps, self.drafter, len(sequences)
        device, bucket, capacity = steps.model.device, steps.bucket(B), steps.cache.capacity
        layout = RoundLog(gamma, self.rounds_per_read)
        key = ("round", bucket, layout, sampling.filters, self.verify_impl)
        buffers = steps.graphs.buffers(key, lambda: dict(
            log=torch.zeros(bucket, layout.columns, dtype=torch.int64, device=device),
            **sampling_buffers(bucket, device)))
        buffers["log"].copy_(to_device(layout.start(sequences, bucket - B, capacity), torch.int64, device))
        fill_sampling_buffers(buffers, sampling)
        # A round advances its own log, the target cache's lengths and the drafter's state: a
        # capture's warm-ups are undone on them.
        state = (steps.cache.row_lengths(bucket),) + (drafter.device_round_state(sequences, bucket, gamma)
                                                       if gamma > 0 else ())
        # Verification clips a draft model's staged cache to the target's (a feature drafter has none).
        draft_cache = drafter.staged_cache(capacity) if gamma > 0 else None
        draft_lengths = draft_cache.row_lengths(bucket) if draft_cache is not None else None
        round_fn = lambda **b: self._device_round(layout, sampling.filters, draft_lengths, **b)  # noqa: E731

        @torch.inference_mode()
        def run_round() -> None:
            with self.phases("round"):
                steps.graphs.run(key, round_fn, state=state)
        return _ReadSetup(layout, buffers["log"][:B], rounds * gamma, run_round)

    def _device_round(self, layout: RoundLog, filters: bool, draft_lengths: torch.Tensor | None, log: torch.Tensor,
                      temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                      seeds: torch.Tensor) -> tuple:
        """One round of the whole bucket from log [bucket, layout.columns] (the sampling parameters
        [bucket] each), written back into it with the next round's last two tokens and lengths.
        draft_lengths [bucket] int64: the draft model's cache lengths, which verification sets (None:
        no draft cache). Only device ops: a CUDA graph captures it whole."""
        steps, G = self.target_steps, layout.gamma
        capacity, last_two, lengths = steps.cache.capacity, layout.last_two(log), layout.lengths(log)
        real = lengths < capacity  # padding rows sit at the spill slot
        bucket = real.shape[0]
        sampling = SamplingBatch(temperature, top_k, top_p, min_p, seeds, filters)
        num_drafts = torch.where(real, G, 0)
        if G > 0:
            drafts, draft_logits = self.drafter.draft_phase_in_round(last_two, lengths, real, sampling, G)
            proposal = Proposal(drafts.contiguous(), num_drafts, draft_logits, G)
        else:
            proposal = Proposal(last_two[:, :0], num_drafts, None, 0)
        positions = torch.where(real, lengths - 1, capacity)  # [bucket]: each row's cache length

        captured: list[torch.Tensor] = []  # the verification's features [bucket, G+1, F], when the target captures some

        def forward(inputs):  # [bucket, G+1] -> [bucket, G+1, V]
            logits, *features = steps.forward(inputs, positions)
            captured.extend(features)
            return logits

        _, emitted, counts = self._round(layout, log, proposal, sampling, forward, steps.cache.row_lengths(bucket),
                                         draft_lengths, _UNMARKED)
        if G > 0 and self.drafter.feature_layers:  # the next round's catch-up: what this one verified
            self.drafter.take_features_in_round(captured[0], emitted, counts, lengths, real)
        # The next round's last two tokens: positions counts and counts + 1 of [last two, emitted].
        next_two = torch.stack([counts, counts + 1], dim=1)
        last_two.copy_(torch.cat([last_two, emitted.clamp(min=0)], dim=1).gather(1, next_two))
        lengths.copy_(torch.where(real, lengths + counts, capacity))
        return ()


def _read_back(log: torch.Tensor) -> list[list[int]]:
    """The rounds' one read from the device: on CUDA one copy into pinned memory, queued behind the
    rounds, and one wait for it."""
    if log.device.type == "cuda":
        host = torch.empty(log.shape, dtype=log.dtype, pin_memory=True)
        host.copy_(log, non_blocking=True)
        torch.cuda.current_stream(log.device).synchronize()
        log = host
    return log.tolist()
