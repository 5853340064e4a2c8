"""Running rounds: how the engine turns the running batch into what each row emitted. Chosen once,
when the engine is built:

  HostRounds    each round read back at its end: the drafter proposes, the target scores
                [last token, drafts] in one forward (eager on a growing cache, or the fixed-shape
                steps replayed from CUDA graphs), verification accepts a prefix of the drafts;
  DeviceBlocks  the same, but where every row has room, up to check_every rounds run from device
                state before one read (engine.device_rounds).

A row that asks for log-probabilities has them from its round's verification logits (HostRounds._score):
no forward more, and a block from device state gives way to host rounds while such a row runs.

A round for rows whose logits broke (NaN, +inf) reports it per row (RowRounds.failure): rows are
independent, so the others' tokens stand.
"""
from __future__ import annotations

import torch

from ..drafters.base import Drafter, Proposal
from ..sampling.batch import SamplingBatch, logits_valid, row_problems
from ..sampling.logprobs import token_logprobs
from .batch import RunningBatch
from .device_rounds import RowRounds, rounds_that_fit, run_block
from ..steps.graphs import FixedShapeSteps
from .phases import Phases
from .request import Request
from ..steps.feed import to_device
from .verification import verify_round


class HostRounds:
    def __init__(self, target, drafter: Drafter | None, target_steps: FixedShapeSteps | None, verify_impl: str,
                 phases: Phases, max_seq_len: int):
        self.target, self.drafter, self.target_steps = target, drafter, target_steps
        self.verify_impl, self.phases, self.max_seq_len = verify_impl, phases, max_seq_len
        self._empty_proposals: dict[tuple[int, str], Proposal] = {}  # see _no_drafts

    def run(self, batch: RunningBatch, gamma: int) -> tuple[list[RowRounds], int]:
        """One round for every row of the batch, drafting up to gamma tokens per row; the outcomes
        (by row) and the drafts actually made per row at most (fewer than gamma near the rows' limits)."""
        active = batch.requests
        sequences = [r.tokens for r in active]
        # A round writes each row's last token and its drafts.
        batch.make_room(max(len(s) for s in sequences) + gamma + 1)
        return self._round(batch, active, sequences, gamma)

    def _round(self, batch: RunningBatch, active: list[Request], sequences: list[list[int]],
               gamma: int) -> tuple[list[RowRounds], int]:
        budgets = [min(gamma, room - 1) for room in self.rooms(active, sequences)]
        with self.phases("draft"):
            proposal = self._propose(sequences, budgets, batch)
        emitted, num_emitted, logit_checks, logits = self._verify(batch, sequences, proposal)

        # The round's one read from the device (on CUDA the first .tolist() waits for it).
        emitted_rows = emitted.tolist()
        counts = num_emitted.tolist()
        drafted = proposal.num_drafts.tolist()
        failures: dict[int, str] = {}  # broken rows keep no token of the round
        for name, logits, finite in logit_checks:
            if not finite:
                for row, problem in row_problems(name, logits).items():
                    failures.setdefault(row, problem)
        G = proposal.tokens.shape[1]
        outcomes = []
        for i, (row, count, n_drafts) in enumerate(zip(emitted_rows, counts, drafted)):
            histogram = [0] * (G + 1)
            histogram[count - 1] = 1
            outcomes.append(RowRounds(tokens=row[:count], rounds=1, draft_calls=proposal.draft_calls, drafted=n_drafts,
                                      accepted=count - 1, rejections=int(count - 1 < n_drafts), histogram=histogram,
                                      failure=failures.get(i)))
        scored = [i for i, r in enumerate(active) if r.logprobs is not None and i not in failures]
        if scored:
            self._score(outcomes, scored, active, logits, batch.sampling)
        return outcomes, G

    @staticmethod
    def _score(outcomes: list[RowRounds], scored: list[int], active: list[Request], logits: torch.Tensor,
               sampling: SamplingBatch):
        """The log-probabilities of the tokens the scored rows emitted, from the round's
        verification logits [B, G+1, V]: a row's token i (an accepted draft, then the resampled or
        bonus token) was decided at position i, under the target's distribution there. Only rows
        that ask for them pay for them."""
        rows = [i for i in scored for _ in outcomes[i].tokens]
        positions = [n for i in scored for n in range(len(outcomes[i].tokens))]
        tokens = [t for i in scored for t in outcomes[i].tokens]
        device = logits.device
        index = to_device(rows, torch.int64, device)
        found = iter(token_logprobs(logits[index, to_device(positions, torch.int64, device)],
                                    to_device(tokens, torch.int64, device), sampling.temperature[index],
                                    sampling.top_k[index], sampling.top_p[index], sampling.min_p[index],
                                    [active[i].params.logprobs for i in rows]))
        for i in scored:
            outcomes[i].logprobs = [next(found) for _ in outcomes[i].tokens]

    def rooms(self, active: list[Request], sequences: list[list[int]]) -> list[int]:
        """Tokens each row may still emit: within its max_new_tokens and the context."""
        return [min(r.params.max_new_tokens - len(r.generated), self.max_seq_len - len(s))
                for r, s in zip(active, sequences)]

    def _propose(self, sequences: list[list[int]], budgets: list[int], batch: RunningBatch) -> Proposal:
        if self.drafter is None or max(budgets) == 0:
            return self._no_drafts(len(sequences), self.target.device)
        return self.drafter.propose(sequences, budgets, batch.sampling)

    def _no_drafts(self, rows: int, device) -> Proposal:
        """The proposal of a round without drafts, built once per batch size (nothing writes to
        it): making its two tensors every round cost ~30 us of a ~6 ms target-only round."""
        key = (rows, str(device))
        if key not in self._empty_proposals:
            self._empty_proposals[key] = Proposal(torch.zeros(rows, 0, dtype=torch.int64, device=device),
                                                  torch.zeros(rows, dtype=torch.int64, device=device), None, 0)
        return self._empty_proposals[key]

    def _verify(self, batch: RunningBatch, sequences: list[list[int]], proposal: Proposal):
        device, cache = self.target.device, batch.cache
        last = to_device([s[-1] for s in sequences], torch.int64, device)
        inputs = torch.cat([last[:, None], proposal.tokens], dim=1)  # [B, G+1]
        lengths = [len(s) for s in sequences]
        with self.phases("verify"):
            if self.target_steps is not None:
                logits = self.target_steps(inputs, cache.lengths)  # [B, G+1, V]
            else:
                hidden = self.target(inputs, cache.lengths.clone(), cache, kv_len=max(lengths) - 1 + inputs.shape[1])
                logits = self.target.logits(hidden)  # [B, G+1, V]
        # Checked when the round's results are read, not now (a check is a synchronisation on
        # CUDA); a broken row's tokens are never kept.
        logit_checks = [(name, t, logits_valid(t)) for name, t in (("draft", proposal.logits), ("target", logits))
                        if t is not None]
        # The draft model's staged cache holds the target's positions: the drafts it fed past a
        # rejection are forgotten with the target's (a round without drafts leaves it shorter).
        draft_cache = batch.draft_cache if proposal.tokens.shape[1] > 0 else None
        draft_lengths = draft_cache.lengths if draft_cache is not None else None
        with self.phases("accept"):
            emitted, num_emitted = verify_round(logits, proposal.logits, proposal.tokens, proposal.num_drafts,
                                                batch.sampling, to_device(lengths, torch.int64, device),
                                                target_lengths=cache.lengths, draft_lengths=draft_lengths,
                                                impl=self.verify_impl)
        return emitted, num_emitted, logit_checks, logits


class DeviceBlocks(HostRounds):
    def __init__(self, target, drafter: Drafter | None, target_steps: FixedShapeSteps, verify_impl: str, phases: Phases,
                 max_seq_len: int, check_every: int):
        super().__init__(target, drafter, target_steps, verify_impl, phases, max_seq_len)
        self.check_every = check_every

    def run(self, batch: RunningBatch, gamma: int) -> tuple[list[RowRounds], int]:
        active = batch.requests
        sequences = [r.tokens for r in active]
        block = self._block_rounds(active, sequences, gamma)
        # A block writes up to gamma + 1 tokens per round and row.
        batch.make_room(max(len(s) for s in sequences) + block * (gamma + 1))
        if block == 1:
            return self._round(batch, active, sequences, gamma)
        return run_block(self.target_steps, self.drafter, batch.sampling, sequences, gamma, block, self.check_every,
                         self.verify_impl, self.phases), gamma

    def _block_rounds(self, active: list[Request], sequences: list[list[int]], gamma: int) -> int:
        """Rounds to run from device state before reading back (1: a host round)."""
        if min(len(s) for s in sequences) < 2:
            return 1
        if any(r.logprobs is not None for r in active):
            return 1  # log-probabilities come from each round's verification logits, which a block overwrites
        if gamma > 0 and not self.drafter.runs_in_device_rounds(sequences):
            return 1  # a host round first: its catch-up feeds the draft model what rounds at gamma 0 skipped
        return max(1, min(self.check_every, rounds_that_fit(self.rooms(active, sequences), gamma)))
