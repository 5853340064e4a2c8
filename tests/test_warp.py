"""Logit warps and inverse-CDF sampling: exact cases and an independent slow oracle."""
import math

import pytest
import torch

from specengine.sampling.warp import sample_from_probs, warp_probs

from bounds import assert_within, warp_error_bound
from stats_util import chi_square_pvalue


def warp_one(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    t = lambda v, dt=torch.float32: torch.tensor([v], dtype=dt)  # noqa: E731
    return warp_probs(torch.tensor([logits], dtype=torch.float32), t(temperature), t(top_k, torch.int64),
                      t(top_p), t(min_p))[0]


def slow_warp(logits: list[float], temperature, top_k, top_p, min_p) -> list[float]:
    """Straight from the definitions in warp.py, one token at a time in float64."""
    V = len(logits)
    if temperature == 0:
        best = max(range(V), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(V)]
    scaled = [x / temperature for x in logits]
    if 0 < top_k < V:
        kth = sorted(scaled, reverse=True)[top_k - 1]
        scaled = [x if x >= kth else -math.inf for x in scaled]
    m = max(scaled)
    probs = [math.exp(x - m) for x in scaled]
    probs = [p / sum(probs) for p in probs]
    if top_p < 1:
        probs = [p if sum(q for q in probs if q > p) < top_p else 0.0 for p in probs]
        probs = [p / sum(probs) for p in probs]
    top = max(probs)
    probs = [p if p >= min_p * top else 0.0 for p in probs]
    return [p / sum(probs) for p in probs]


def test_temperature_scales_logits():
    logits = [1.0, 2.0, 0.5]
    expected = torch.softmax(torch.tensor(logits) / 0.5, -1)
    torch.testing.assert_close(warp_one(logits, temperature=0.5), expected)


def test_greedy_is_one_hot_of_first_argmax():
    assert warp_one([1.0, 3.0, 3.0, 0.0], temperature=0).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_top_k_keeps_ties_at_the_threshold():
    probs = warp_one([3.0, 1.0, 2.0, 2.0, 0.0], top_k=2)
    assert (probs > 0).tolist() == [True, False, True, True, False]


def test_top_p_keeps_smallest_nucleus_with_ties():
    logits = torch.tensor([0.5, 0.2, 0.2, 0.1]).log().tolist()
    assert (warp_one(logits, top_p=0.6) > 0).tolist() == [True, True, True, False]
    assert (warp_one(logits, top_p=0.5) > 0).tolist() == [True, False, False, False]
    assert (warp_one(logits, top_p=0.01) > 0).tolist() == [True, False, False, False]
    assert (warp_one(logits, top_p=1.0) > 0).all()


def test_min_p_is_relative_to_the_top_token():
    logits = torch.tensor([0.5, 0.2, 0.2, 0.1]).log().tolist()
    assert (warp_one(logits, min_p=0.35) > 0).tolist() == [True, True, True, False]


def test_minus_inf_and_huge_logits():
    probs = warp_one([-math.inf, 3e38, -3e38, 3e38], temperature=0.5)
    assert probs.tolist() == [0.0, 0.5, 0.0, 0.5]
    assert warp_one([5.0]).tolist() == [1.0]  # vocab of one


@pytest.mark.parametrize("seed", range(6))
def test_warps_match_slow_oracle(seed):
    g = torch.Generator().manual_seed(seed)
    V = [1, 2, 7, 111][seed % 4]
    rows = []
    for i in range(24):
        logits = (torch.randn(V, generator=g) * 3).round(decimals=1)  # rounding makes ties
        params = dict(temperature=[0.0, 0.7, 1.0, 1.5][i % 4], top_k=[0, 1, 3, V][i % 4 if i < 8 else 0],
                      top_p=[1.0, 0.9, 0.5, 0.3][(i // 4) % 4], min_p=[0.0, 0.05, 0.2][i % 3])
        rows.append((logits, params))
    got = warp_probs(torch.stack([r[0] for r in rows]),
                     torch.tensor([r[1]["temperature"] for r in rows]),
                     torch.tensor([r[1]["top_k"] for r in rows]),
                     torch.tensor([r[1]["top_p"] for r in rows]),
                     torch.tensor([r[1]["min_p"] for r in rows]))
    for row, (logits, params) in zip(got, rows):
        want = torch.tensor(slow_warp(logits.double().tolist(), **params), dtype=torch.float64)
        assert_within(row, want, warp_error_bound(logits, params["temperature"], want), f"{params}")


def test_sample_from_probs_exact_cases():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([0.0, 0.49, 0.5, 1 - 2**-24])
    assert sample_from_probs(probs, u).tolist() == [1, 1, 3, 3]
    # Unnormalised input: the CDF is scaled by its total.
    assert sample_from_probs(torch.tensor([[2.0, 6.0]]), torch.tensor([0.24])).tolist() == [0]
    assert sample_from_probs(torch.tensor([[2.0, 6.0]]), torch.tensor([0.26])).tolist() == [1]


def test_sample_from_probs_distribution():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(50, generator=g), -1)
    n = 200_000
    tokens = sample_from_probs(probs.expand(n, -1), torch.rand(n, generator=g))
    assert chi_square_pvalue(torch.bincount(tokens, minlength=50), probs) > 1e-3
