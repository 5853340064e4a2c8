"""Choosing gamma: the paper's analysis (Section 3) turned into a per-round decision.

With per-token acceptance rate alpha, a round that drafts g tokens emits on average
(1 - alpha^(g+1)) / (1 - alpha) tokens (Equation 1) and costs g draft steps plus one target
call on g + 1 tokens. A batch shares its rounds: the draft model steps g times for every row
and the target verifies g + 1 positions of every row, so one g serves the whole batch.
gamma="auto" picks, each round, the g that maximises the batch's expected tokens per second,
from costs measured on this machine at that batch size (verifying k tokens is not free on a
CPU) and a smoothed estimate of alpha per request. g = 0 is plain target-only decoding, so a
useless draft costs only the occasional probe that keeps the estimates of alpha alive, and the
decision itself.

This module is the policy only; engine/costs.py measures the step costs it decides from (CostTable
asks it for a batch size's costs when they are first needed). What the policy's parts were measured
to gain or cost is in bench/results/gamma-policy-2026-11-29-to-12-01.md.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np


def expected_tokens(alpha: float, gamma: int) -> float:
    """Mean tokens per round, (1 - alpha^(gamma+1)) / (1 - alpha) (paper Equation 1)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, gamma: int, c: float) -> float:
    """Theorem 3.8: walltime improvement over target-only decoding when a draft step costs c target steps."""
    return expected_tokens(alpha, gamma) / (gamma * c + 1.0)


def expected_ops_ratio(alpha: float, gamma: int, c_hat: float) -> float:
    """Paper Table 1 "ops": total arithmetic relative to target-only decoding, where c_hat is the
    draft's arithmetic per token relative to the target's (about their parameter ratio)."""
    return (gamma * c_hat + gamma + 1.0) / expected_tokens(alpha, gamma)


@dataclass(frozen=True)
class CostModel:
    draft_step_s: float            # one draft-model step (0 for free drafters such as n-gram)
    verify_s: tuple[float, ...]    # verify_s[k - 1]: one target call on k tokens, k = 1..max_gamma + 1

    def __post_init__(self):
        if self.draft_step_s < 0 or not self.verify_s or min(self.verify_s) <= 0:
            raise ValueError(f"costs must be positive, got {self}")

    @property
    def max_gamma(self) -> int:
        return len(self.verify_s) - 1

    @cached_property
    def steps_s(self) -> tuple[float, ...]:
        """steps_s[g]: the g draft steps and the target call of a round drafting g tokens."""
        return tuple(g * self.draft_step_s + verify_s for g, verify_s in enumerate(self.verify_s))

    def round_seconds(self, gamma: int, overhead_s: float = 0.0) -> float:
        """A round drafting gamma tokens; overhead_s: what a round costs beyond its draft steps and
        target call (the verify step, the loop's bookkeeping), see GammaController.observe_round."""
        return self.steps_s[gamma] + overhead_s

    def tokens_per_second(self, alphas: float | Sequence[float], gamma: int, overhead_s: float = 0.0) -> float:
        """Expected tokens per second of rounds drafting gamma tokens for rows with these alphas."""
        alphas = (alphas,) if isinstance(alphas, (int, float)) else alphas
        return sum(expected_tokens(a, gamma) for a in alphas) / self.round_seconds(gamma, overhead_s)

    def rates(self, alphas: float | Sequence[float], overhead_s: float = 0.0,
              drafting_overhead_s: float | None = None) -> list[float]:
        """tokens_per_second at every gamma 0..max_gamma in one pass (gamma="auto" asks every
        round): a row's expected tokens at gamma g are 1 + alpha + ... + alpha^g, so they add up
        power by power. drafting_overhead_s: the overhead of rounds that draft, where it differs
        from target-only rounds' (default: the same)."""
        alphas = (alphas,) if isinstance(alphas, (int, float)) else alphas
        drafting_overhead_s = overhead_s if drafting_overhead_s is None else drafting_overhead_s
        tokens = [0.0] * len(self.verify_s)  # tokens[g]: the rows' expected tokens at gamma g
        for alpha in alphas:
            row_tokens, power = 0.0, 1.0
            for g in range(len(tokens)):
                row_tokens += power
                power *= alpha
                tokens[g] += row_tokens
        return [tokens[0] / (self.steps_s[0] + overhead_s)] + [
            n / (steps_s + drafting_overhead_s) for n, steps_s in zip(tokens[1:], self.steps_s[1:])]

    def best_gamma(self, alphas: float | Sequence[float], overhead_s: float = 0.0,
                   drafting_overhead_s: float | None = None) -> int:
        """The gamma of most tokens per second (the smallest on ties); overheads as in rates."""
        rates = self.rates(alphas, overhead_s, drafting_overhead_s)
        return rates.index(max(rates))


class CostTable(Mapping[int, CostModel]):
    """CostModels by batch size, for the batch sizes it plans: given, or obtained from
    measure(batch_size) the first time a size is looked up. Measuring takes seconds on a CPU, most
    of them at the larger batch size, which a request decoding alone never needs; so a size is
    measured when a batch first needs it (see cover)."""

    def __init__(self, max_gamma: int, batch_sizes: Sequence[int],
                 measure: Callable[[int], CostModel] | None = None, given: Mapping[int, CostModel] | None = None):
        given = dict(given or {})
        self.max_gamma = max_gamma
        self.batch_sizes = tuple(sorted(set(batch_sizes) | set(given)))
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"a cost table needs batch sizes >= 1, got {self.batch_sizes}")
        if measure is None and set(given) != set(self.batch_sizes):
            raise ValueError("a cost table without a way to measure needs the costs of every batch size")
        self._measure = measure
        self._costs: dict[int, CostModel] = {}
        self.seconds: dict[int, float] = {}  # by batch size: the time it took to obtain its costs
        for batch_size, costs in given.items():
            self._keep(batch_size, costs)

    @classmethod
    def of(cls, costs: CostModel | Mapping[int, CostModel]) -> "CostTable":
        """A table of given costs (one CostModel: batch size 1's)."""
        given = costs if isinstance(costs, Mapping) else {1: costs}
        if not given:
            raise ValueError("a cost table needs the costs of at least one batch size")
        return cls(next(iter(given.values())).max_gamma, list(given), given=given)

    def _keep(self, batch_size: int, costs: CostModel):
        if costs.max_gamma != self.max_gamma:
            raise ValueError(f"cost models must cover the same gammas: batch size {batch_size}'s cover gamma up to "
                             f"{costs.max_gamma}, not {self.max_gamma}")
        self._costs[batch_size] = costs

    def __getitem__(self, batch_size: int) -> CostModel:
        if batch_size not in self._costs:
            if batch_size not in self.batch_sizes:
                raise KeyError(batch_size)
            start = time.perf_counter()
            self._keep(batch_size, self._measure(batch_size))
            self.seconds[batch_size] = time.perf_counter() - start
        return self._costs[batch_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.batch_sizes)

    def __len__(self) -> int:
        return len(self.batch_sizes)

    @property
    def measured(self) -> tuple[int, ...]:
        """The batch sizes whose costs it holds so far."""
        return tuple(sorted(self._costs))

    def cover(self, batch_size: int):
        """Obtain now the costs that pricing a batch of up to batch_size rows needs: every planned size
        up to it and the next above (GammaController.costs_for interpolates between the two around a size)."""
        above = [b for b in self.batch_sizes if b >= batch_size]
        for b in self.batch_sizes:
            if b <= batch_size or (above and b == above[0]):
                self[b]


@dataclass
class AcceptanceEstimate:
    """A request's alpha: its accepted / tested drafts with exponential forgetting, shrunk towards
    its prior (the finished requests' alpha, moved by all of the request's own tests: see prior) by
    prior_weight tests that are never forgotten, so that through rounds at gamma 0 it drifts back
    to the prior. Its own window (the last ~10 rounds) holds too few tests to tell nearby alphas
    apart, and alone their noise chooses too short a gamma; the prior steadies it."""

    accepted: float = 0.0
    rejected: float = 0.0
    prior_alpha: float = 0.5  # before any evidence: the finished requests' alpha
    prior_weight: float = 2.0
    prior_tests: float = math.inf  # the tests prior_alpha stands for (inf: a fixed prior)
    own_accepted: float = 0.0   # the request's tested drafts, never forgotten: accepted ...
    own_tested: float = 0.0     # ... and in all
    decay: float = 0.9      # per round (update): the last ~10 rounds dominate
    rounds_without_drafts: int = 0
    last_gamma: int = 0     # the gamma of this request's last round
    unanswered_probes: int = 0  # probes since this request last drafted (each doubles its wait)
    probing: bool = False       # its last round was a probe
    batch_key: int = 1          # the measured batch size of its last round: the wait it leaves
    greedy: bool = False        # its request decodes at temperature 0 (its kind's prior and wait)

    def __post_init__(self):
        if not 0.0 <= self.prior_alpha <= 1.0:
            raise ValueError(f"prior_alpha must be in [0, 1], got {self.prior_alpha}")
        counts = (self.prior_weight, self.accepted, self.rejected, self.own_accepted)
        if min(counts) < 0 or self.own_tested < self.own_accepted:
            raise ValueError(f"prior_weight and the counts must be non-negative, got {self}")
        if not self.prior_tests > 0:
            raise ValueError(f"prior_tests must be positive (inf: a fixed prior), got {self.prior_tests}")
        if self.prior_weight + self.accepted + self.rejected == 0:
            raise ValueError("an estimate needs a prior_weight or some tested drafts")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if self.batch_key < 1:
            raise ValueError(f"batch_key must be a batch size >= 1, got {self.batch_key}")

    @property
    def prior(self) -> float:
        """What the estimate drifts back to at gamma 0: prior_alpha, and the request's own tests
        weighed against the prior_tests it stands for. Behind a fresh engine's first request stand
        only two pseudo-tests (alpha 0.5); were they the whole prior, each stretch at gamma 0 would
        bring a useless draft's estimate back to 0.5 within ~20 rounds, and the request would draft
        again every few rounds (not a probe, so never backing off) for as long as it ran: every
        request of the command line is a first one. Its own rejections outweigh two tests; behind a
        request of an engine that has run a while stand ~100, which a stretch of its own moves less."""
        if math.isinf(self.prior_tests):
            return self.prior_alpha
        return (self.prior_alpha * self.prior_tests + self.own_accepted) / (self.prior_tests + self.own_tested)

    @property
    def alpha(self) -> float:
        return (self.accepted + self.prior_weight * self.prior) / (self.accepted + self.rejected + self.prior_weight)

    def update(self, accepted: int, rejected: int):
        """A round's tested drafts, after forgetting a share 1 - decay of the earlier ones."""
        self.fade(self.decay)
        self.accepted += accepted
        self.rejected += rejected
        self.own_accepted += accepted
        self.own_tested += accepted + rejected

    def fade(self, keep: float):
        self.accepted *= keep
        self.rejected *= keep


class GammaController:
    """Each round's gamma from CostModels (by batch size) and the rows' AcceptanceEstimates."""

    PROBE_EVERY = 16  # rounds at gamma 0 before drafting one token again to re-measure alpha ...
    PROBE_SHARE = 0.02  # ... or more, so that probes cost at most about this share of the time
    # A probe that finds the draft still useless doubles the wait for the next one: a draft that
    # never pays costs a request of n rounds about log2(n / PROBE_EVERY) probes, not n / 16
    # (each probe also feeds the draft model what it missed since it last drafted).
    MAX_BACKOFF = 4  # waits of at most 16x: the draft is re-tested at least every 256 rounds

    PRIOR_WEIGHT = 5.0  # draft tests' worth of the finished requests' alpha in every request's estimate
    FINISHED_KEEP = 0.99  # per finished test: the finished requests' last ~100 tests make their alpha

    RAMP_STEP = 2  # the most gamma grows from one round to the next

    DRAFT_MARGIN = 0.05  # draft only where the model promises 5% more tokens per second

    def __init__(self, costs: CostModel | Mapping[int, CostModel]):
        """costs: by batch size (one CostModel: batch size 1's); a CostTable measures them as needed."""
        self.costs_by_batch = costs if isinstance(costs, CostTable) else CostTable.of(costs)
        # Acceptance over the finished requests' tests (the last ~100 dominate: FINISHED_KEEP per
        # test): what every request's estimate is shrunk towards, so a new one does not spend its
        # first rounds drafting for alpha = 0.5. Weighed by tests, not requests, so that rows that
        # only probed (two tests each) do not outweigh a request that drafted a hundred times.
        # Before any request: alpha 0.5, worth one accepted and one rejected test.
        # Kept apart for greedy and sampled requests: their alphas differ (the paper's Table 3), and
        # one shared prior, pulled down by sampled requests, keeps greedy ones from drafting.
        self.finished = {greedy: AcceptanceEstimate(accepted=1.0, rejected=1.0, prior_weight=0.0, decay=1.0)
                         for greedy in (False, True)}
        # Per (measured batch size (see _batch_key), greedy): the last finished request's
        # unanswered probes and rounds since it drafted, where the next such requests take up the wait.
        self.finished_wait: dict[tuple[int, bool], tuple[int, int]] = {}
        # Per (cost model, drafting or not): the smoothed time a round took beyond its modelled
        # draft steps and target call. The fused verify step and the loop's bookkeeping cost the
        # same at any gamma, which favours drafting more per round. Rounds that draft also pay the
        # drafter's own host work, which can far exceed a target-only round's (a GPU, with CUDA
        # graphs): one shared estimate would keep drafting where target-only decoding is faster.
        # The first drafting round after rounds at gamma 0 also feeds the drafter what it missed;
        # it is left out (learning from it would price drafting as if every round paid a catch-up).
        self.overhead_s: dict[tuple[int, bool], float] = {}  # (measured batch size, drafting): seconds
        self._costs_at: dict[int, CostModel] = {}  # see costs_for
        self._key_at: dict[int, int] = {}  # see _batch_key

    def new_estimate(self, batch_size: int = 1, greedy: bool = False) -> AcceptanceEstimate:
        """The estimate of a request that starts in a batch of this many rows (greedy: at temperature 0)."""
        key = self._batch_key(batch_size)
        unanswered, rounds = self.finished_wait.get((key, greedy), (0, 0))
        finished = self.finished[greedy]
        return AcceptanceEstimate(prior_alpha=finished.alpha, prior_tests=finished.accepted + finished.rejected,
                                  prior_weight=self.PRIOR_WEIGHT,
                                  unanswered_probes=unanswered, rounds_without_drafts=rounds, batch_key=key,
                                  greedy=greedy)

    def observe_finished(self, estimate: AcceptanceEstimate, accepted: int, rejections: int):
        """Fold a finished request into the start of the next ones: its accepted drafts and
        rejections into their prior alpha, and its unanswered probes and rounds since it drafted
        into the wait for the next probe of requests in batches of its size. A draft useless for
        the last requests is re-tested after up to 256 rounds, not 16, since each probe and its
        catch-up cost a round's worth of drafting; the wait runs on across requests, so requests
        shorter than it still reach the next probe (started afresh, short requests would never
        probe again, and a draft that paid again would never be used). Waits are kept per batch
        size, the one of the request's last round: where drafting pays at one batch size and not at
        another, requests that drafted at the one must not restart the wait of requests at the
        other, whose probes would then come far more often, each feeding the draft what all their
        rows had missed."""
        finished = self.finished[estimate.greedy]
        finished.fade(self.FINISHED_KEEP ** (accepted + rejections))
        finished.update(accepted, rejections)
        self.finished_wait[estimate.batch_key, estimate.greedy] = (estimate.unanswered_probes,
                                                                    estimate.rounds_without_drafts)

    @property
    def max_gamma(self) -> int:
        return self.costs_by_batch.max_gamma

    def costs_for(self, batch_size: int) -> CostModel:
        """The model measured at this batch size. Between measured sizes (the rows left when others
        finish), a target call costs what the measured calls on as many tokens in all cost
        (interpolated over batch * tokens: a matrix product's cost follows its rows), and a draft
        step is interpolated over the batch size (taking the smaller size's costs would price
        verifying several tokens of a few rows as cheap as at batch 1, where on a CPU it is not).
        Outside the measured sizes, the nearest. (Sizes not measured yet are measured now: see
        CostTable.)"""
        if batch_size not in self._costs_at:  # asked up to three times a round: built once per size
            self._costs_at[batch_size] = self._costs_between(batch_size)
        return self._costs_at[batch_size]

    def _costs_between(self, batch_size: int) -> CostModel:
        sizes = self.costs_by_batch.batch_sizes
        if batch_size in sizes or batch_size < sizes[0] or batch_size > sizes[-1]:
            return self.costs_by_batch[min(sizes, key=lambda b: abs(b - batch_size))]
        lo = max(b for b in sizes if b < batch_size)
        hi = min(b for b in sizes if b > batch_size)
        tokens, seconds = zip(*sorted((b * k, t) for b in (lo, hi)
                                      for k, t in enumerate(self.costs_by_batch[b].verify_s, start=1)))
        w = (batch_size - lo) / (hi - lo)
        draft = (1 - w) * self.costs_by_batch[lo].draft_step_s + w * self.costs_by_batch[hi].draft_step_s
        return CostModel(draft, tuple(float(np.interp(batch_size * k, tokens, seconds))
                                      for k in range(1, self.max_gamma + 2)))

    def _batch_key(self, batch_size: int) -> int:
        """The measured batch size whose round overheads this one shares: the largest not above it."""
        if batch_size not in self._key_at:
            self._key_at[batch_size] = max((b for b in self.costs_by_batch if b <= batch_size),
                                           default=min(self.costs_by_batch))
        return self._key_at[batch_size]

    OVERHEAD_DECAY = 0.9  # per round: the last ~10 rounds dominate

    def observe_round(self, batch_size: int, gamma: int, seconds: float, after_gap: bool = False):
        """Fold a round's measured wall time into the overhead its cost model does not cover.
        after_gap: the round drafted right after rounds at gamma 0 (its catch-up was longer)."""
        if gamma > 0 and after_gap:
            return
        key = self._batch_key(batch_size)
        costs = self.costs_for(batch_size)
        # Floored so that a round never looks cheaper than half a target call.
        residual = max(seconds - costs.round_seconds(gamma), -0.5 * costs.verify_s[0])
        slot = (key, gamma > 0)
        self.overhead_s[slot] = self.OVERHEAD_DECAY * self.overhead_s.get(slot, 0.0) + (1 - self.OVERHEAD_DECAY) * residual

    def round_overheads(self, batch_size: int) -> tuple[float, float]:
        """(target-only, drafting) overhead per round at this batch size. Until one kind of round
        has been seen it takes the other's estimate; a drafting round is never taken to cost less
        beyond its model than a target-only round (the residuals are noisy, and a negative
        difference would make a useless draft look free)."""
        key = self._batch_key(batch_size)
        plain, drafting = self.overhead_s.get((key, False)), self.overhead_s.get((key, True))
        plain = plain if plain is not None else (drafting if drafting is not None else 0.0)
        drafting = drafting if drafting is not None else plain
        return plain, max(plain, drafting)

    def choose(self, estimates: Sequence[AcceptanceEstimate]) -> int:
        """One gamma for a round of these rows (the batch)."""
        alphas = [e.alpha for e in estimates]
        # A long draft bets on a long run of acceptances: gamma grows by at most RAMP_STEP a round,
        # so a few lucky probes after rounds at gamma 0 do not buy rounds of 8 drafts for the batch.
        gamma = self._paying_gamma(alphas, limit=max(e.last_gamma for e in estimates) + self.RAMP_STEP)
        probe = False
        if gamma == 0:
            for e in estimates:
                e.unanswered_probes += e.probing  # its last round probed, and gamma is back to 0
                e.rounds_without_drafts += 1
            # The interval is at least PROBE_EVERY: most rounds need not compute it.
            probe = (self._probe_due(estimates, self.PROBE_EVERY)
                     and self._probe_due(estimates, self.probe_interval(len(estimates))))
            gamma = int(probe)
        key = self._batch_key(len(estimates))
        for e in estimates:
            if gamma > 0:  # a probe or a paying draft
                e.rounds_without_drafts = 0
                if not probe:
                    e.unanswered_probes = 0
            e.probing = probe
            e.last_gamma = gamma
            e.batch_key = key
        return gamma

    def _probe_due(self, estimates: Sequence[AcceptanceEstimate], interval: int) -> bool:
        """Whether a row has waited `interval` rounds at gamma 0, doubled per unanswered probe."""
        return any(e.rounds_without_drafts >= interval << min(e.unanswered_probes, self.MAX_BACKOFF)
                   for e in estimates)

    def probe_interval(self, batch_size: int) -> int:
        """Rounds at gamma 0 between probes (one-draft rounds that re-measure alpha): PROBE_EVERY,
        or more where a probe costs more than PROBE_SHARE of the rounds between probes (at larger
        batches on a CPU, verifying 2 tokens costs far more than one, and so does a probe). Each
        probe after which a row went back to gamma 0 doubles that row's wait (see choose), up to
        2^MAX_BACKOFF times this."""
        costs = self.costs_for(batch_size)
        plain, drafting = self.round_overheads(batch_size)
        extra = costs.round_seconds(1, drafting) - costs.round_seconds(0, plain)
        return max(self.PROBE_EVERY, math.ceil(extra / (self.PROBE_SHARE * costs.round_seconds(0, plain))))

    def _paying_gamma(self, alphas: list[float], limit: int) -> int:
        """The best gamma (at most limit) for rows with these alphas, or 0 where its predicted
        tokens per second beat target-only decoding's by less than DRAFT_MARGIN: step costs and
        alpha estimates are noisy (a few per cent), and a near-tie bet loses as often as it wins."""
        rates = self.costs_for(len(alphas)).rates(alphas, *self.round_overheads(len(alphas)))
        gamma = min(rates.index(max(rates)), limit)
        return gamma if rates[gamma] >= (1 + self.DRAFT_MARGIN) * rates[0] else 0
