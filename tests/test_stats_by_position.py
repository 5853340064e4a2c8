"""Acceptance by draft position in DecodeStats, and rounds by drafts accepted for each number
drafted: counted from host rounds and from blocks of rounds run from device state, summed by
combine(), reported by to_dict() and summary(), and consistent with the other counters on real
decoding."""
import pytest

from specengine import Engine, SamplingParams
from specengine.drafters.model import ModelDrafter
from specengine.drafters.ngram import NgramDrafter
from specengine.engine.outputs import Outputs
from specengine.engine.request import DecodeStats, Request
from specengine.engine.rounds import RoundResult

from engine_util import tiny_pair

V = 40


def request(gamma: int) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(max_new_tokens=100, ignore_eos=True), 0, DecodeStats(gamma=gamma))


def test_a_host_round_counts_its_drafts_and_acceptances_by_position():
    outputs, r = Outputs(None, (), 1000), request(gamma=4)
    # Three drafts (the row's budget was short of gamma), the first accepted, the second rejected.
    outputs.apply(r, RoundResult(tokens=[5, 6], emitted=[2], drafted=[3], draft_calls=3))
    assert r.stats.drafted_by_position == [1, 1, 1, 0] and r.stats.accepted_by_position == [1, 0, 0, 0]
    # A round without drafts counts at no position.
    outputs.apply(r, RoundResult(tokens=[7], emitted=[1], drafted=[0], draft_calls=0))
    assert r.stats.drafted_by_position == [1, 1, 1, 0] and r.stats.accepted_by_position == [1, 0, 0, 0]
    assert r.stats.acceptance_by_position == [1.0, 0.0, 0.0, None]
    # The round of three drafts accepted one; the round without drafts is in no row.
    assert r.stats.accepted_histogram_by_draft_length == {3: [0, 1, 0, 0]}
    outputs.apply(r, RoundResult(tokens=[8, 9, 10, 11, 12], emitted=[1, 4], drafted=[1, 4], draft_calls=5))
    assert r.stats.accepted_histogram_by_draft_length == {1: [1, 0], 3: [0, 1, 0, 0], 4: [0, 0, 0, 1, 0]}


def test_a_block_of_rounds_counts_gamma_drafts_in_every_round():
    outputs, r = Outputs(None, (), 1000), request(gamma=3)
    # Four rounds of three drafts: one accepted none, two accepted two, one accepted all three.
    outputs.apply(r, RoundResult(tokens=list(range(11)), emitted=[1, 3, 3, 4], drafted=[3] * 4, draft_calls=12))
    s = r.stats
    assert (s.rounds, s.drafted, s.accepted, s.rejections, s.accepted_histogram) == (4, 12, 7, 3, [1, 0, 2, 1])
    assert s.drafted_by_position == [4, 4, 4] and s.accepted_by_position == [3, 3, 1]
    assert sum(s.drafted_by_position) == s.drafted and sum(s.accepted_by_position) == s.accepted
    assert s.acceptance_by_position == [0.75, 0.75, 0.25]
    assert s.accepted_histogram_by_draft_length == {3: [1, 0, 2, 1]}


def test_combine_sums_positions_and_reports_them():
    a, b = DecodeStats(gamma=2), DecodeStats(gamma=3)
    a.drafted_by_position, a.accepted_histogram = [4, 2], [1, 2, 1]
    b.drafted_by_position, b.accepted_histogram = [2, 2, 2], [1, 0, 1, 0]
    assert a.accepted_by_position == [3, 1] and b.accepted_by_position == [1, 1, 0]
    a.accepted_histogram_by_draft_length = {1: [1, 2], 2: [0, 1, 1]}
    b.accepted_histogram_by_draft_length = {2: [3, 0, 1], 3: [0, 0, 0, 1]}
    total = DecodeStats.combine([a, b], wall_time_s=1.0)
    assert total.drafted_by_position == [6, 4, 2] and total.accepted_by_position == [4, 2, 0]
    assert total.accepted_histogram_by_draft_length == {1: [1, 2], 2: [3, 1, 2], 3: [0, 0, 0, 1]}
    assert a.accepted_histogram_by_draft_length == {1: [1, 2], 2: [0, 1, 1]}  # the parts stay as they were
    assert total.acceptance_by_position == [4 / 6, 0.5, 0.0]
    d = total.to_dict()
    assert d["drafted_by_position"] == [6, 4, 2] and d["acceptance_by_position"] == [4 / 6, 0.5, 0.0]
    assert d["accepted_by_position"] == [4, 2, 0]
    assert d["accepted_histogram_by_draft_length"] == {1: [1, 2], 2: [3, 1, 2], 3: [0, 0, 0, 1]}
    d["drafted_by_position"].append(1)  # a copy: the stats stay as they were
    d["accepted_histogram_by_draft_length"][2].append(1)
    assert total.drafted_by_position == [6, 4, 2] and total.accepted_histogram_by_draft_length[2] == [3, 1, 2]
    assert "acceptance by position [0.67, 0.50, 0.00]" in total.summary()
    assert "acceptance by position [n/a]" in DecodeStats(gamma=1).summary()
    assert DecodeStats(gamma=0).acceptance_by_position == []


PROMPTS = [[1, 2, 3, 4, 5], [7, 7], [3, 9, 27, 1, 3, 9, 27, 1, 3, 9], [4]]
PARAMS = [SamplingParams(max_new_tokens=n, temperature=t, seed=s)
          for n, t, s in [(30, 0.0, 1), (41, 1.0, 2), (17, 0.8, 3), (26, 0.0, 4)]]


def assert_consistent(s: DecodeStats, gamma: int):
    assert len(s.drafted_by_position) == len(s.accepted_by_position) == gamma
    assert sum(s.drafted_by_position) == s.drafted and sum(s.accepted_by_position) == s.accepted
    # Drafting (accepting) at position i + 1 means drafting (accepting) at position i too.
    assert all(x >= y for x, y in zip(s.drafted_by_position, s.drafted_by_position[1:]))
    assert all(x >= y for x, y in zip(s.accepted_by_position, s.accepted_by_position[1:]))
    assert all(a <= d for a, d in zip(s.accepted_by_position, s.drafted_by_position))
    assert s.drafted_by_position[0] <= s.rounds
    assert s.accepted_by_position[0] == s.rounds - s.accepted_histogram[0]
    # The rows by number drafted hold every round that drafted, and its drafts and acceptances.
    rows = s.accepted_histogram_by_draft_length
    assert all(1 <= k <= gamma and len(row) == k + 1 for k, row in rows.items())
    assert sum(map(sum, rows.values())) == s.drafted_by_position[0]
    assert sum(k * sum(row) for k, row in rows.items()) == s.drafted
    assert sum(j * n for row in rows.values() for j, n in enumerate(row)) == s.accepted
    assert [sum(sum(row) for k, row in rows.items() if k > i) for i in range(gamma)] == s.drafted_by_position


@pytest.mark.parametrize("rounds_per_read", [1, 4])
def test_positions_agree_with_the_other_counters_when_decoding(rounds_per_read):
    """Host rounds and blocks from device state (weak and perfect drafts), and the n-gram drafter,
    whose drafts vary in length round to round."""
    target, draft = tiny_pair(V)
    for drafter, want_all in ((ModelDrafter(draft, V, V), False), (ModelDrafter(target, V, V), True)):
        engine = Engine(target, drafter=drafter, gamma=3, cuda_graphs=True, max_batch_size=4,
                        rounds_per_read=rounds_per_read)
        results = engine.generate(PROMPTS, PARAMS)
        for result in results:
            assert_consistent(result.stats, 3)
            assert result.stats.drafted_by_position[0] > 0
            if want_all:  # the target drafting for itself: every draft accepted at every position
                assert result.stats.acceptance_by_position == [1.0, 1.0, 1.0]
        assert_consistent(engine.last_run_stats, 3)
    results = Engine(target, drafter=NgramDrafter(), gamma=4).generate(PROMPTS, PARAMS)
    for result in results:
        assert_consistent(result.stats, 4)
