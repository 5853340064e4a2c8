"""Adaptive gamma: the cost model's choice, and the engine falling back to target-only decoding."""
import math
from types import SimpleNamespace

import pytest
import torch

from specengine import Engine, SamplingParams
from specengine.drafters.model import ModelDrafter
from specengine.engine import costs as costs_module
from specengine.engine.config import MAX_GAMMA, EngineConfig
from specengine.engine.costs import measure_costs, timed_widths
from specengine.engine.gamma import (AcceptanceEstimate, CostModel, GammaController, expected_ops_ratio,
                                     expected_tokens, predicted_speedup)

from engine_util import tiny_model


def test_expected_tokens_and_theorem_3_8():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    # Paper Table 2 style check: alpha 0.75, gamma 7, c 0 gives (1 - 0.75^8) / 0.25.
    assert predicted_speedup(0.75, 7, 0.0) == pytest.approx((1 - 0.75 ** 8) / 0.25)
    assert predicted_speedup(0.0, 3, 0.1) == pytest.approx(1 / 1.3)
    # Paper Table 1: alpha 0.9, gamma 10, c = c_hat = 0 gives speed 6.86x at 1.60x the arithmetic.
    assert predicted_speedup(0.9, 10, 0.0) == pytest.approx(6.86, abs=0.005)
    assert expected_ops_ratio(0.9, 10, 0.0) == pytest.approx(1.60, abs=0.005)


def at_alpha(alpha: float, tests: float = 10.0, **fields) -> AcceptanceEstimate:
    """A request's estimate of exactly this alpha: `tests` drafts tested, its prior at the same alpha."""
    return AcceptanceEstimate(accepted=alpha * tests, rejected=(1 - alpha) * tests, prior_alpha=alpha, **fields)


def brute_force_best(costs: CostModel, alpha: float) -> int:
    rates = [expected_tokens(alpha, g) / (g * costs.draft_step_s + costs.verify_s[g]) for g in range(len(costs.verify_s))]
    return rates.index(max(rates))


@pytest.mark.parametrize("alpha", [0.0, 0.05, 0.3, 0.6, 0.8, 0.95, 1.0])
@pytest.mark.parametrize("draft_cost, verify_slope", [(0.0, 0.0), (0.05, 0.0), (0.05, 0.2), (0.5, 0.1), (2.0, 0.0)])
def test_best_gamma_maximises_tokens_per_second(alpha, draft_cost, verify_slope):
    costs = CostModel(draft_cost, tuple(1.0 + verify_slope * k for k in range(9)))
    assert costs.best_gamma(alpha) == brute_force_best(costs, alpha)


def test_useless_or_expensive_draft_gives_gamma_zero_and_good_draft_gives_many():
    costs = CostModel(0.1, tuple(1.0 + 0.05 * k for k in range(9)))
    assert costs.best_gamma(0.0) == 0 and costs.best_gamma(0.05) == 0
    assert costs.best_gamma(0.95) >= 6
    assert CostModel(1.5, (1.0,) * 9).best_gamma(0.9) == 0  # a draft slower than the target never pays


def probe_rounds(choices: list[int]) -> list[int]:
    return [i for i, g in enumerate(choices) if g]


def test_controller_probes_ever_more_rarely_while_the_draft_stays_useless():
    """Rounds at gamma 0 probe (draft one token) after PROBE_EVERY rounds; every probe after which
    gamma is back at 0 doubles the wait, up to 2^MAX_BACKOFF times (a useless draft cost ~4% of
    decoding at batch 1 on a 2-core CPU with a probe every 16 rounds)."""
    controller = GammaController(CostModel(0.1, (1.0,) * 5))  # a probe costs 10% of a round: every 16
    estimate = at_alpha(0.0, 50)
    choices = [controller.choose([estimate]) for _ in range(1200)]
    assert set(choices) == {0, 1}
    waits = [16, 32, 64, 128, 256, 256, 256]
    assert probe_rounds(choices) == [sum(waits[: i + 1]) - 1 for i in range(len(waits))]


def test_a_probe_that_pays_ends_the_backoff():
    costs = CostModel(0.1, (1.0,) * 5)
    controller = GammaController(costs)
    estimate = at_alpha(0.0, 50)
    choices = [controller.choose([estimate]) for _ in range(16 + 32 + 64)]
    assert probe_rounds(choices) == [15, 47, 111] and estimate.unanswered_probes == 2 and estimate.probing
    estimate.accepted, estimate.rejected = 50.0, 0.0  # the last probe found the draft good again
    assert controller.choose([estimate]) > 0 and estimate.unanswered_probes == 0
    estimate.accepted, estimate.rejected = 0.0, 50.0  # and useless again: back to probing every 16
    choices = [controller.choose([estimate]) for _ in range(40)]
    assert probe_rounds(choices) == [15]


def test_probes_are_rarer_where_they_cost_more():
    """Batch 8 on a 2-core CPU (measured costs): verifying 2 tokens took 1.8x one, so a probe (a
    round drafting one token) costs almost a round more, and probes every 16 rounds cost 5-6% of
    decoding. Probes then come only every ceil(extra / (2% of a round)) rounds. At batch 1, where
    the target verifies 2 tokens as fast as one, they stay every 16 rounds."""
    batch1 = CostModel(0.00129, (0.00575, 0.00567, 0.00762))
    batch8 = CostModel(0.00198, (0.01323, 0.02381, 0.03319))
    controller = GammaController({1: batch1, 8: batch8})
    extra = batch8.round_seconds(1) - batch8.round_seconds(0)
    interval = controller.probe_interval(8)
    assert interval == math.ceil(extra / (GammaController.PROBE_SHARE * batch8.round_seconds(0))) > 40
    assert controller.probe_interval(1) == GammaController.PROBE_EVERY
    rows = [at_alpha(0.0, 50) for _ in range(8)]
    choices = [controller.choose(rows) for _ in range(7 * interval)]
    assert probe_rounds(choices) == [interval - 1, 3 * interval - 1, 7 * interval - 1]
    # rows finish: at batch 1 the round after 16 without drafts is a probe
    useless = at_alpha(0.0, 50, rounds_without_drafts=GammaController.PROBE_EVERY)
    assert controller.choose([useless]) == 1


def brute_force_batch_best(costs: CostModel, alphas: list[float]) -> int:
    rates = [sum(expected_tokens(a, g) for a in alphas) / (g * costs.draft_step_s + costs.verify_s[g])
             for g in range(len(costs.verify_s))]
    return rates.index(max(rates))


def test_one_gamma_for_the_batch_maximises_its_tokens_per_second():
    """Rows share draft steps and the padded verification, so the batch's choice is not any row's
    own: one row with a good draft among useless ones must not make the batch draft 8 tokens."""
    costs = CostModel(0.1, tuple(1.0 + 0.15 * k for k in range(9)))
    controller = GammaController({1: CostModel(0.01, (1.0,) * 9), 8: costs})
    for alphas in ([0.95] + [0.05] * 7, [0.9] * 8, [0.0] * 8, [0.3, 0.6, 0.8, 0.2, 0.9, 0.5, 0.7, 0.4]):
        # last_gamma 8: rows already drafting long rounds (no ramp limit, see test_gamma_ramps_up)
        estimates = [at_alpha(a, 100, last_gamma=8) for a in alphas]
        assert controller.choose(estimates) == brute_force_batch_best(costs, alphas)
    mixed = [0.95] + [0.05] * 7
    assert brute_force_batch_best(costs, mixed) < costs.best_gamma(0.95)
    # A batch of one uses the batch-1 costs.
    assert controller.choose([at_alpha(0.95, 100, last_gamma=8)]) == 8


def test_acceptance_estimate_tracks_recent_rounds_shrunk_towards_its_prior():
    d = 0.9  # kept per round
    e = AcceptanceEstimate(prior_alpha=0.5, prior_weight=5.0, decay=d)
    for _ in range(40):
        e.update(accepted=3, rejected=1)
    window = (1 - d ** 40) / (1 - d)
    accepted, rejected = 3 * window, window
    assert e.alpha == pytest.approx((accepted + 2.5) / (accepted + rejected + 5.0))
    assert 0.7 < e.alpha < 0.75  # the window's 0.75, pulled towards 0.5 by five tests
    for _ in range(40):
        e.update(accepted=0, rejected=1)
    accepted, rejected = accepted * d ** 40, rejected * d ** 40 + window
    assert e.alpha == pytest.approx((accepted + 2.5) / (accepted + rejected + 5.0))
    assert 0.15 < e.alpha < 0.2  # the early acceptances forgotten, the prior's pull kept
    # Rounds that test nothing (gamma 0): the request's evidence fades, its estimate returns to the prior.
    for _ in range(100):
        e.update(accepted=0, rejected=0)
    accepted, rejected = accepted * d ** 100, rejected * d ** 100
    assert e.alpha == pytest.approx((accepted + 2.5) / (accepted + rejected + 5.0))
    assert e.alpha == pytest.approx(0.5, abs=0.01)


def test_finished_requests_weigh_by_their_tests_not_their_number():
    """At batch 8 a useful draft may only be probed: eight finished rows with two tests each must
    not outweigh a batch-1 request's hundred (halved per request, the last row's one rejection
    set the next requests' alpha to 0.39 where it was 0.8, and they stopped drafting)."""
    controller = GammaController(CostModel(0.001, (0.005,) * 9))
    controller.observe_finished(AcceptanceEstimate(), 80, 20)
    assert controller.new_estimate().alpha == pytest.approx(0.8, abs=0.02)
    for accepted, rejected in [(2, 0)] * 7 + [(0, 2)]:
        controller.observe_finished(AcceptanceEstimate(), accepted, rejected)
    assert 0.75 < controller.new_estimate().alpha < 0.85


def test_the_wait_for_a_probe_runs_on_per_batch_size():
    """Batch-1 requests for which drafting pays must not restart the wait of the batch-8
    requests for which it does not (one shared wait had a batch of 8 probe, and feed the draft
    model what its 8 rows had missed, in every batch between batch-1 requests), nor must a batch's
    last rows running alone; the finished requests' alpha stays shared (the pair's, whatever the
    batch)."""
    cheap, dear = CostModel(0.001, (0.005,) * 9), CostModel(0.002, tuple(0.013 * k for k in range(1, 10)))
    controller = GammaController({1: cheap, 8: dear})
    assert controller.new_estimate(8).batch_key == 8 and controller.new_estimate(5).batch_key == 1
    row = controller.new_estimate(8)
    row.unanswered_probes, row.rounds_without_drafts = 3, 40
    controller.observe_finished(row, 2, 0)
    single = controller.new_estimate(1)
    assert (single.unanswered_probes, single.rounds_without_drafts) == (0, 0)
    controller.observe_finished(single, 60, 20)  # it drafted: no unanswered probes
    after = controller.new_estimate(8)
    assert (after.unanswered_probes, after.rounds_without_drafts) == (3, 40)
    assert controller.new_estimate(8).prior_alpha == controller.new_estimate(1).prior_alpha < 1
    # A row of a batch of 8 that runs its last rounds alone (the others finished first) leaves
    # the wait of batch 1, where it drafted: not a restart of batch 8's.
    straggler = controller.new_estimate(8)
    straggler.accepted, straggler.unanswered_probes = 50.0, 3
    assert controller.choose([straggler]) > 0 and straggler.batch_key == 1
    controller.observe_finished(straggler, 50, 0)
    assert controller.finished_wait[8, False] == (3, 40) and controller.finished_wait[1, False] == (0, 0)
    with pytest.raises(ValueError, match="batch_key must be"):
        AcceptanceEstimate(batch_key=0)


def test_a_requests_own_tests_move_its_prior():
    """prior_tests: how many tests the prior alpha stands for; the request's own tests, never
    forgotten, join them. Its window still fades through rounds at gamma 0, to that prior."""
    fixed = AcceptanceEstimate(prior_alpha=0.8)
    fixed.update(0, 10)
    assert fixed.prior == 0.8  # prior_tests inf: a fixed prior
    moving = AcceptanceEstimate(prior_alpha=0.8, prior_tests=90, prior_weight=5.0)
    moving.update(2, 8)
    assert (moving.own_accepted, moving.own_tested) == (2, 10)
    assert moving.prior == pytest.approx((0.8 * 90 + 2) / 100)
    for _ in range(300):  # rounds at gamma 0 test nothing
        moving.update(0, 0)
    assert moving.alpha == pytest.approx(moving.prior, abs=1e-6) and moving.own_tested == 10
    assert GammaController(CostModel(0.001, (0.005,) * 9)).new_estimate().prior_tests == 2.0  # alpha 0.5 of two tests


def test_a_fresh_engines_first_request_backs_off_a_useless_draft():
    """Behind a fresh engine's first request stand two pseudo-tests (alpha 0.5). With a prior fixed
    there, each stretch at gamma 0 fades a useless draft's estimate back to 0.5, and the request
    drafts again every ~8 rounds, never reaching the probes' back-off (every run of the command
    line is a first request). Its own rejections outweigh the two tests: it probes, ever more
    rarely. (Costs: the default pair's at batch 1 on a 2-core CPU.)"""
    costs = CostModel(0.00085, (0.0100, 0.0127, 0.0140, 0.0170, 0.0237, 0.0250, 0.0270, 0.0290, 0.0330))

    def drafting_rounds(estimate):
        controller = GammaController(costs)
        choices = []
        for _ in range(600):
            choices.append(controller.choose([estimate]))
            estimate.update(0, int(choices[-1] > 0))  # every draft rejected
        return probe_rounds(choices)

    first = GammaController(costs).new_estimate(greedy=True)
    assert first.prior_alpha == 0.5 and first.prior_tests == 2.0
    interval = GammaController(costs).probe_interval(1)  # 18 rounds: a probe costs 0.36 of a round
    assert interval == 18
    # after its first round, rounds at gamma 0 but for probes, every wait for one twice the last
    assert drafting_rounds(first) == [0] + [interval * ((2 << i) - 1) for i in range(5)]
    fixed_prior = AcceptanceEstimate(prior_alpha=0.5, prior_weight=GammaController.PRIOR_WEIGHT)
    assert len(drafting_rounds(fixed_prior)) > 60  # every 8 rounds


def test_acceptance_estimate_rejects_bad_fields():
    with pytest.raises(ValueError, match="prior_alpha must be in"):
        AcceptanceEstimate(prior_alpha=1.5)
    with pytest.raises(ValueError, match="decay must be in"):
        AcceptanceEstimate(decay=0.0)
    with pytest.raises(ValueError, match="non-negative"):
        AcceptanceEstimate(accepted=-1.0)
    with pytest.raises(ValueError, match="needs a prior_weight or some tested drafts"):
        AcceptanceEstimate(prior_weight=0.0)
    with pytest.raises(ValueError, match="prior_tests must be positive"):
        AcceptanceEstimate(prior_tests=0.0)
    with pytest.raises(ValueError, match="non-negative"):
        AcceptanceEstimate(own_accepted=3.0, own_tested=2.0)
    assert AcceptanceEstimate(accepted=3.0, rejected=1.0, prior_weight=0.0).alpha == 0.75


def test_auto_gamma_with_useless_draft_decodes_like_target_only():
    V = 48
    target = tiny_model(V, seed=0, logit_scale=3.0)
    useless = ModelDrafter(tiny_model(V, seed=7, num_layers=1, hidden_size=16), V, V)
    params = SamplingParams(max_new_tokens=60, temperature=0)
    baseline = Engine(target).generate([[1, 2, 3]], params)[0]
    costs = CostModel(0.2, tuple(1.0 + 0.1 * k for k in range(9)))
    engine = Engine(target, drafter=useless, gamma="auto", costs=costs)
    (result,) = engine.generate([[1, 2, 3]], params)
    assert result.token_ids == baseline.token_ids
    hist = result.stats.accepted_histogram
    # After a few rounds alpha's estimate collapses and rounds run without drafts (0 accepted).
    assert result.stats.drafted < 20 and hist[0] == result.stats.rounds - sum(hist[1:])
    assert len(hist) == 9


def test_engine_flags_drafting_rounds_after_rounds_without_drafts(monkeypatch):
    """The probes of a useless draft follow rounds at gamma 0: the engine says so, and the
    controller does not learn their (longer) catch-up as drafting overhead; nor the first
    round's, a request's first with the draft model."""
    V = 48
    target = tiny_model(V, seed=0, logit_scale=3.0)
    useless = ModelDrafter(tiny_model(V, seed=7, num_layers=1, hidden_size=16), V, V)
    # a probe costs little (every 16 rounds), so 60 tokens see rounds at 0 and then one
    costs = CostModel(0.05, tuple(1.0 + 0.01 * k for k in range(9)))
    engine = Engine(target, drafter=useless, gamma="auto", costs=costs)
    seen = []
    real = engine.gamma_controller.observe_round
    monkeypatch.setattr(engine.gamma_controller, "observe_round",
                        lambda b, g, seconds, after_gap=False: (seen.append((g, after_gap)), real(b, g, seconds, after_gap)))
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=60, temperature=0))
    gammas = [g for g, _ in seen]
    assert 0 in gammas and any(g > 0 for g in gammas[gammas.index(0):])  # rounds at 0, then a probe
    # (the first round counts as one: the request has just joined)
    assert [gap for _, gap in seen] == [previous == 0 for previous in [0] + gammas[:-1]]


def test_a_draft_useless_for_earlier_requests_is_never_run_for_a_short_one(monkeypatch):
    """The first requests find the draft useless; later ones start from their alpha and their
    wait for the next probe, so a request that ends before it never drafts (the draft model's
    prefill runs with the prompt's, in the same chunks)."""
    V = 48
    target = tiny_model(V, seed=0, logit_scale=3.0)
    draft = tiny_model(V, seed=7, num_layers=1, hidden_size=16)
    costs = CostModel(0.2, tuple(1.0 + 0.1 * k for k in range(9)))
    engine = Engine(target, drafter=ModelDrafter(draft, V, V), gamma="auto", costs=costs)
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=120, temperature=0))
    controller = engine.gamma_controller
    start = controller.new_estimate(greedy=True)
    assert start.alpha < 0.2 and start.unanswered_probes >= 1
    first_probe = controller.probe_interval(1) << start.unanswered_probes  # rounds at gamma 0 before it
    assert first_probe >= 2 * GammaController.PROBE_EVERY
    calls = []
    real = engine.drafter.propose
    monkeypatch.setattr(engine.drafter, "propose", lambda *args, **kw: (calls.append(1), real(*args, **kw))[1])
    # The wait runs on from the last request: a request that ends before it never drafts.
    assert 0 < start.rounds_without_drafts < first_probe - 1
    short = SamplingParams(max_new_tokens=first_probe - start.rounds_without_drafts - 1, temperature=0)
    (result,) = engine.generate([[7, 8, 9]], short)
    assert calls == [] and result.stats.drafted == 0
    assert result.token_ids == Engine(target).generate([[7, 8, 9]], short)[0].token_ids
    # The next request probes in its first rounds: however short requests are, the draft is
    # re-tested after the wait (started afresh each request, 128-token requests never probed again).
    (probed,) = engine.generate([[7, 8, 9]], SamplingParams(max_new_tokens=4, temperature=0))
    assert calls and probed.stats.drafted == 1
    # A useful draft answers its probes: the next request probes after PROBE_EVERY rounds again.
    controller.observe_finished(AcceptanceEstimate(unanswered_probes=0, greedy=True), 30, 2)
    assert controller.new_estimate(greedy=True).unanswered_probes == 0


def test_auto_gamma_with_perfect_draft_drafts_many_tokens():
    V = 48
    target = tiny_model(V, seed=0, logit_scale=3.0)
    costs = CostModel(0.05, tuple(1.0 + 0.02 * k for k in range(9)))
    engine = Engine(target, drafter=ModelDrafter(target, V, V), gamma="auto", costs=costs)
    (result,) = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=60, temperature=0))
    assert result.stats.tokens_per_round > 4
    assert result.token_ids == Engine(target).generate([[1, 2, 3]], SamplingParams(max_new_tokens=60, temperature=0))[0].token_ids


def test_new_requests_start_from_the_acceptance_of_finished_ones():
    V = 48
    target = tiny_model(V, seed=0, logit_scale=3.0)
    costs = CostModel(0.05, tuple(1.0 + 0.02 * k for k in range(9)))
    engine = Engine(target, drafter=ModelDrafter(target, V, V), gamma="auto", costs=costs)
    assert engine.gamma_controller.new_estimate(greedy=True).alpha == pytest.approx(0.5)
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=40, temperature=0))
    # A perfect draft: every test accepted, so the next request starts near alpha 1, not 0.5.
    assert engine.gamma_controller.new_estimate(greedy=True).alpha > 0.9
    useless = Engine(target, drafter=ModelDrafter(tiny_model(V, seed=7, num_layers=1, hidden_size=16), V, V),
                     gamma="auto", costs=costs)
    useless.generate([[1, 2, 3]], SamplingParams(max_new_tokens=40, temperature=0))
    assert useless.gamma_controller.new_estimate(greedy=True).alpha < 0.5


def test_greedy_and_sampled_requests_keep_their_own_prior_and_wait():
    """A draft accepted at T=0 and rejected at T=1 (random T5-shaped models: alpha 1.0 against
    0.17): a prior shared by both kinds, pulled down by the sampled requests, had the greedy ones
    of a mixed run never draft where drafting paid 1.63x."""
    controller = GammaController(CostModel(0.001, (0.005,) * 9))
    sampled = controller.new_estimate(greedy=False)
    sampled.unanswered_probes, sampled.rounds_without_drafts = 3, 40
    controller.observe_finished(sampled, 17, 83)
    controller.observe_finished(controller.new_estimate(greedy=True), 100, 0)
    greedy = controller.new_estimate(greedy=True)
    assert greedy.greedy and greedy.alpha > 0.9 and (greedy.unanswered_probes, greedy.rounds_without_drafts) == (0, 0)
    assert controller.new_estimate().alpha < 0.25 and controller.new_estimate().unanswered_probes == 3
    assert controller.choose([greedy]) > 0 and controller.choose([controller.new_estimate()]) == 0


def test_auto_gamma_measures_costs_when_none_are_given():
    """Each batch size's costs when first needed (tests/test_auto_gamma_defaults.py: when a batch
    first needs them): batch 1's for a request alone, batch 8's for more rows."""
    target = tiny_model(32, seed=0)
    engine = Engine(target, drafter=ModelDrafter(tiny_model(32, seed=1, num_layers=1), 32, 32), gamma="auto",
                    max_gamma=3)
    controller = engine.gamma_controller
    assert sorted(controller.costs_by_batch) == [1, 8] and controller.max_gamma == 3
    assert controller.costs_by_batch.measured == ()
    assert controller.costs_for(1) is controller.costs_by_batch[1] and controller.costs_by_batch.measured == (1,)
    assert controller.costs_for(64) is controller.costs_by_batch[8]
    for costs in controller.costs_by_batch.values():
        assert costs.draft_step_s > 0 and all(t > 0 for t in costs.verify_s)


class _ClockedModel:
    """Stands in for a model in measure_costs: each call advances a fake clock by its cost, and
    by `cold_s` more when the clock's last call was another model's (weights to reload)."""

    def __init__(self, clock, name: str, token_s: float, cold_s: float = 0.0, vocab: int = 5):
        self.clock, self.name, self.token_s, self.cold_s, self.vocab = clock, name, token_s, cold_s, vocab
        self.device = torch.device("cpu")

    def new_cache(self, batch_size, capacity):
        lengths = torch.zeros(batch_size, dtype=torch.int64)
        return SimpleNamespace(lengths=lengths, pretend_filled=lengths.fill_)

    def __call__(self, x, lengths, cache, kv_len):
        self.clock.spend(self.token_s * x.shape[1] + (self.cold_s if self.clock.last != self.name else 0.0))
        self.clock.last = self.name
        return torch.zeros(x.shape[0], x.shape[1], 1)

    def logits(self, hidden):
        return torch.zeros(*hidden.shape[:2], self.vocab)


class _FakeClock:
    """perf_counter for measure_costs; calls number slow_calls run 3x slower (a slow stretch)."""

    def __init__(self, slow_calls: range):
        self.now, self.calls, self.slow_calls, self.last = 0.0, 0, slow_calls, None

    def spend(self, seconds: float):
        self.now += seconds * (3.0 if self.calls in self.slow_calls else 1.0)
        self.calls += 1


@pytest.mark.parametrize("slow_from", [0, 40, 70, 100])
def test_measured_costs_are_steps_back_to_back_and_survive_a_slow_stretch(monkeypatch, slow_from):
    """measure_costs interleaves its calls, one of each per round: a slow stretch of the machine
    (here 12 calls at 3x, wherever it falls) spoils a round or two, not the median of one cost.
    A draft step is timed right after another (as a round's draft steps run), not after a target
    call, whose first draft step also reloads the draft's weights."""
    clock = _FakeClock(range(slow_from, slow_from + 12))
    monkeypatch.setattr(costs_module.time, "perf_counter", lambda: clock.now)
    target = _ClockedModel(clock, "target", token_s=0.004)
    draft = _ClockedModel(clock, "draft", token_s=0.001, cold_s=0.002)
    costs = measure_costs(target, draft, max_gamma=3)
    assert costs.verify_s == pytest.approx((0.004, 0.008, 0.012, 0.016))
    assert costs.draft_step_s == pytest.approx(0.001)


class _WidthsModel(_ClockedModel):
    """A _ClockedModel that notes the widths (tokens per row) it is called on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.widths = set()

    def __call__(self, x, lengths, cache, kv_len):
        self.widths.add(x.shape[1])
        return super().__call__(x, lengths, cache, kv_len)


def test_measured_costs_time_a_few_widths_and_interpolate_the_others(monkeypatch):
    """A target call's cost on a CPU grows with its tokens (here exactly 4 ms a token): the widths
    timed give the others by interpolation, and the others are never called."""
    clock = _FakeClock(range(0))
    monkeypatch.setattr(costs_module.time, "perf_counter", lambda: clock.now)
    target = _WidthsModel(clock, "target", token_s=0.004)
    costs = measure_costs(target, _ClockedModel(clock, "draft", token_s=0.001), max_gamma=8, widths=timed_widths(8))
    assert target.widths == set(timed_widths(8)) == {1, 2, 3, 4, 5, 9}
    assert costs.verify_s == pytest.approx(tuple(0.004 * k for k in range(1, 10)))
    everything = _WidthsModel(clock, "target", token_s=0.004)
    assert measure_costs(everything, None, max_gamma=8).verify_s == pytest.approx(costs.verify_s)
    assert everything.widths == set(range(1, 10))  # by default every width
    for widths in ((2, 9), (1, 2, 8), (1, 10)):
        with pytest.raises(ValueError, match="widths must run from 1 to max_gamma"):
            measure_costs(target, None, max_gamma=8, widths=widths)


@pytest.mark.parametrize("max_gamma", [1, 2, 3, 4, 5, 8, 9, 16, 64])
def test_timed_widths_span_every_verification(max_gamma):
    widths = timed_widths(max_gamma)
    assert widths == tuple(sorted(set(widths))) and widths[0] == 1 and widths[-1] == max_gamma + 1
    assert set(widths) >= set(range(1, min(6, max_gamma + 2)))
    assert max(b - a for a, b in zip(widths, widths[1:])) <= 4  # no long stretch interpolated


def test_costs_between_measured_batch_sizes_are_interpolated():
    """Rows finish at different times, so a batch of 8 ends as 7, 5, 2 rows: their costs lie
    between batch 1's and batch 8's. Batch 1's costs for 4 rows (where verifying 2 tokens cost
    1.8x one at batch 8 on a CPU) made auto draft there, at a loss."""
    batch1 = CostModel(0.0013, (0.0058, 0.0057, 0.0076))
    batch8 = CostModel(0.0022, (0.0144, 0.0253, 0.0346))
    controller = GammaController({1: batch1, 8: batch8})
    four = controller.costs_for(4)
    assert four.draft_step_s == pytest.approx(0.0013 + 3 / 7 * 0.0009)
    # 4 rows of 1, 2, 3 tokens: 4, 8, 12 tokens in all, between batch 1's 3 tokens (7.6 ms) and batch
    # 8's 8 (14.4 ms) and 16 (25.3 ms)
    assert four.verify_s == pytest.approx((0.0076 + 1 / 5 * (0.0144 - 0.0076), 0.0144, (0.0144 + 0.0253) / 2))
    assert controller.costs_for(1) is batch1 and controller.costs_for(8) is batch8
    assert controller.costs_for(16) is batch8
    rows = [at_alpha(0.8) for _ in range(4)]
    assert batch1.best_gamma([0.8] * 4) > 0 and controller.choose(rows) == 0


def test_invalid_gamma():
    target = tiny_model(32, seed=0)
    with pytest.raises(ValueError, match=f"gamma must be an integer in \\[1, {MAX_GAMMA}\\]"):
        Engine(target, drafter=ModelDrafter(target, 32, 32), gamma="fast")
    with pytest.raises(ValueError, match="costs cover gamma up to 2"):
        Engine(target, drafter=ModelDrafter(target, 32, 32), gamma="auto", costs=CostModel(0.1, (1.0, 1.0, 1.0)))


def test_gamma_is_capped_below_the_gemm_threshold():
    """A verification (gamma + 1 tokens per row) takes the decode path at every allowed gamma, so
    its logits are target-only decoding's bits; one more draft would take the GEMM path."""
    from specengine.ops.product import gemm_sized

    assert not gemm_sized(MAX_GAMMA + 1) and gemm_sized(MAX_GAMMA + 2)
    assert EngineConfig(gamma=MAX_GAMMA, max_gamma=MAX_GAMMA).gamma == MAX_GAMMA
    for name in ("gamma", "max_gamma"):
        with pytest.raises(ValueError, match=f"{name} must be an integer in \\[1, {MAX_GAMMA}\\] \\(MAX_GAMMA"):
            EngineConfig(**{name: MAX_GAMMA + 1})


def test_round_overhead_is_learned_and_favours_longer_rounds():
    """Rounds that take longer than their modelled draft steps and target call teach the
    controller a per-round overhead; a fixed cost per round makes drafting more pay."""
    costs = CostModel(0.2, tuple(1.0 + 0.1 * k for k in range(9)))
    controller = GammaController(costs)
    estimate = at_alpha(0.6)
    assert controller.choose([estimate]) == costs.best_gamma(0.6) == 1
    for _ in range(60):  # every round took 1.5 s more than modelled
        controller.observe_round(1, 1, costs.round_seconds(1) + 1.5)
    assert controller.overhead_s[(1, True)] == pytest.approx(1.5, rel=0.01)
    assert costs.best_gamma(0.6, overhead_s=1.5) == 3
    assert controller.choose([estimate]) == 3
    # Rounds faster than modelled lower it, but never below minus half a target call.
    for _ in range(200):
        controller.observe_round(1, 1, 0.0)
    assert controller.overhead_s[(1, True)] == pytest.approx(-0.5, rel=0.01)


def test_auto_drafts_only_for_a_clear_predicted_gain():
    """A predicted gain under DRAFT_MARGIN over target-only decoding is a near-tie that noisy costs
    and estimates turn into a loss as often as a win: auto stays at gamma 0 (probes aside)."""
    estimate = lambda: at_alpha(0.7)  # noqa: E731
    near_tie = CostModel(0.05, tuple(1.0 + 0.6 * k for k in range(9)))  # g=1: 1.7 tokens in 1.65 s
    assert near_tie.best_gamma(0.7) == 1
    gain = near_tie.tokens_per_second(0.7, 1) / near_tie.tokens_per_second(0.7, 0)
    assert 1.0 < gain < 1 + GammaController.DRAFT_MARGIN
    assert GammaController(near_tie).choose([estimate()]) == 0
    clear = CostModel(0.05, tuple(1.0 + 0.1 * k for k in range(9)))
    assert GammaController(clear).choose([at_alpha(0.7, last_gamma=8)]) == clear.best_gamma(0.7) > 0


def test_gamma_ramps_up():
    """A long draft is a bet on a long run of acceptances: from rounds at gamma 0 (or a new
    request) gamma grows by at most RAMP_STEP a round, up to the model's best; it falls at once."""
    costs = CostModel(0.05, tuple(1.0 + 0.02 * k for k in range(9)))
    controller = GammaController(costs)
    estimate = at_alpha(0.95, 100)
    assert costs.best_gamma(0.95) == 8
    assert [controller.choose([estimate]) for _ in range(5)] == [2, 4, 6, 8, 8]
    estimate.accepted, estimate.rejected = 5.0, 95.0  # the draft turns useless
    assert controller.choose([estimate]) == costs.best_gamma(0.05) == 0


def test_drafting_rounds_learn_their_own_overhead():
    """Rounds that draft pay the drafter's host work besides the modelled draft steps (on a GPU
    with graphs ~10x a target-only round's). Learned apart from target-only rounds, that extra
    cost tips the choice back to gamma 0, where a shared estimate would keep drafting."""
    costs = CostModel(0.2, tuple(1.0 + 0.4 * k for k in range(9)))
    estimate = at_alpha(0.7)
    assert costs.best_gamma(0.7) == 1  # 1.7 tokens in 1.6 s beats 1 token in 1 s
    controller = GammaController(costs)
    for _ in range(60):
        controller.observe_round(1, 0, costs.round_seconds(0) + 0.05)  # target-only: 0.05 s extra
        controller.observe_round(1, 1, costs.round_seconds(1) + 0.4)   # drafting: 0.4 s extra
    assert controller.round_overheads(1) == pytest.approx((0.05, 0.4), rel=0.01)
    assert controller.choose([estimate]) == 0
    pooled = 0.5 * (0.05 + 0.4)  # one shared estimate would have kept drafting
    assert costs.best_gamma(0.7, overhead_s=pooled) >= 1


def test_round_overheads_fall_back_never_make_drafting_cheaper_and_skip_gap_rounds():
    costs = CostModel(0.2, tuple(1.0 + 0.1 * k for k in range(9)))
    controller = GammaController(costs)
    assert controller.round_overheads(1) == (0.0, 0.0)
    for _ in range(60):
        controller.observe_round(1, 2, costs.round_seconds(2) + 0.3)
    assert controller.round_overheads(1) == pytest.approx((0.3, 0.3), rel=0.01)  # one kind seen: shared
    # The first drafting round after rounds at gamma 0 feeds the drafter what it missed: not learned.
    controller.observe_round(1, 2, costs.round_seconds(2) + 50.0, after_gap=True)
    assert controller.round_overheads(1) == pytest.approx((0.3, 0.3), rel=0.01)
    for _ in range(60):
        controller.observe_round(1, 0, costs.round_seconds(0) + 0.6)
    plain, drafting = controller.round_overheads(1)
    assert plain == pytest.approx(0.6, rel=0.01) and drafting == plain  # not 0.3: never cheaper
