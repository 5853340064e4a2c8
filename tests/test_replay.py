"""specengine.devtools.replay: gamma policies decoded again on acceptance traces (no timing involved)."""
import random

import pytest
import torch

from specengine.engine.gamma import CostModel, expected_tokens
from specengine.devtools.replay import acceptance_along, replay, replay_mean

from engine_util import tiny_model

# Batch-1 costs measured on the shipped pair (2-core VM, 2026-11-30): a draft step and the target
# on 1..9 tokens; and the round overheads gamma="auto" learned there (target-only, drafting).
SHIPPED_COSTS = CostModel(0.00097, (0.00555, 0.00544, 0.00756, 0.00819, 0.00974, 0.01107, 0.01191, 0.01326, 0.01515))
SHIPPED_OVERHEADS = (0.0009, 0.0020)


def bernoulli_traces(alphas, length=128, seed=0):
    """One greedy-like trace per alpha: each position's draft accepted or not (1 or 0) at that rate."""
    rng = random.Random(seed)
    return [[float(rng.random() < a) for _ in range(length)] for a in alphas]


@pytest.mark.parametrize("gamma", [0, 1, 4, 8])
def test_certain_acceptance_emits_gamma_plus_one_tokens_per_round(gamma):
    costs = CostModel(0.5, tuple(1.0 + k for k in range(9)))
    trace = [1.0] * 90  # 90 = 10 rounds of 9, 18 of 5, 45 of 2, 90 of 1
    result = replay([trace], costs, gamma, seed=0, overheads_s=(0.25, 0.75))
    rounds = 90 // (gamma + 1)
    assert result.tokens_per_s == pytest.approx(90 / (rounds * costs.round_seconds(gamma, 0.75 if gamma else 0.25)))
    assert result.drafts_per_token == pytest.approx(rounds * gamma / 90)


def test_certain_rejection_emits_one_token_per_round():
    costs = CostModel(0.5, tuple(1.0 + k for k in range(9)))
    result = replay([[0.0] * 50], costs, 3, seed=0)
    assert result.tokens_per_s == pytest.approx(50 / (50 * costs.round_seconds(3)))
    # The last rounds draft only what the budget allows (as the engine): 3, ..., 3, 2, 1, 0.
    assert result.drafts_per_token == pytest.approx((47 * 3 + 2 + 1) / 50)


@pytest.mark.parametrize("alpha, gamma", [(0.3, 1), (0.6, 3), (0.9, 6)])
def test_tokens_per_round_follow_equation_1(alpha, gamma):
    """Constant acceptance: a round's mean tokens are (1 - alpha^(g+1)) / (1 - alpha); each
    request's budget end cuts a few rounds short, so long requests and a 2% tolerance."""
    costs = CostModel(0.0, (1.0,) * 9)  # every round 1 s: tokens per second = tokens per round
    result = replay_mean([[alpha] * 2000] * 4, costs, gamma, seeds=5)
    assert result.tokens_per_s == pytest.approx(expected_tokens(alpha, gamma), rel=0.02)


@pytest.mark.parametrize("case, alphas", [
    ("temperature-1-like: requests alike", [0.78] * 16),
    ("greedy-like: requests from 0.5 to 1", [0.5, 0.53, 0.64, 0.75, 0.8, 0.83, 0.83, 0.84,
                                             0.85, 0.87, 0.92, 0.92, 0.95, 0.98, 0.99, 1.0]),
    ("draft good then useless", [0.9] * 8 + [0.1] * 8),
])
def test_auto_is_within_5_percent_of_the_best_fixed_gamma(case, alphas):
    """The issue's target, without the timing noise of a 2-core VM (specengine.devtools.replay)."""
    traces = bernoulli_traces(alphas) if "greedy" in case else [[a] * 128 for a in alphas]
    fixed = {g: replay_mean(traces, SHIPPED_COSTS, g, 10, SHIPPED_OVERHEADS).tokens_per_s for g in range(9)}
    auto = replay_mean(traces, SHIPPED_COSTS, "auto", 10, SHIPPED_OVERHEADS).tokens_per_s
    assert auto >= 0.95 * max(fixed.values()), (case, auto, fixed)


def test_auto_with_a_useless_draft_decodes_as_fast_as_target_only():
    traces = [[0.02] * 128] * 16
    target_only = replay_mean(traces, SHIPPED_COSTS, 0, 5, SHIPPED_OVERHEADS)
    auto = replay_mean(traces, SHIPPED_COSTS, "auto", 5, SHIPPED_OVERHEADS)
    assert auto.tokens_per_s >= 0.98 * target_only.tokens_per_s
    assert auto.drafts_per_token < 0.02  # a few probes


def test_replay_rejects_bad_input():
    with pytest.raises(ValueError, match="policy must be a gamma in \\[0, 8\\] or 'auto'"):
        replay([[0.5]], SHIPPED_COSTS, 9, seed=0)
    with pytest.raises(ValueError, match="acceptance probabilities in \\[0, 1\\]"):
        replay([[1.5]], SHIPPED_COSTS, 1, seed=0)
    with pytest.raises(ValueError, match="non-empty"):
        replay([[]], SHIPPED_COSTS, 1, seed=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_acceptance_along_a_sequence_is_each_prefixs_sum_of_min_p_q(temperature):
    """One forward per model over the whole sequence gives what each prefix alone would: the
    oracle decodes every prefix afresh and compares the two next-token distributions."""
    V = 40
    target, draft = tiny_model(V, seed=0, logit_scale=3.0), tiny_model(V, seed=1, num_layers=1, logit_scale=3.0)
    prompt, generated = [3, 1, 4], [1, 5, 9, 2, 6, 5, 3]
    along = acceptance_along(target, draft, prompt, generated, temperature)
    assert len(along) == len(generated)
    for t, value in enumerate(along):
        ids = torch.tensor([prompt + generated[:t]])

        def last_logits(model):
            cache = model.new_cache(1, ids.shape[1])
            return model.logits(model(ids, torch.zeros(1, dtype=torch.int64), cache, kv_len=ids.shape[1]))[0, -1]
        p, q = last_logits(target), last_logits(draft)
        if temperature == 0:
            assert value == float(p.argmax() == q.argmax())
        else:
            assert value == pytest.approx(torch.minimum(p.softmax(-1), q.softmax(-1)).sum().item(), abs=1e-5)
    assert 0 < sum(along) < len(along)  # the two models differ somewhere, agree somewhere
    # A draft identical to the target is always accepted.
    assert acceptance_along(target, target, prompt, generated, temperature) == pytest.approx([1.0] * len(generated))
