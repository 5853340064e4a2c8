"""The step's plan (engine.scheduler.StepPlan) and the model runner that carries it out
(engine.runner.ModelRunner): plans are checked when made, the scheduler cuts prefills by the
units the runner gives them (tokens at multiples of 32, T5's encoder blocks), the rows a plan says
join are those that do (and a plan that says otherwise is refused), and the runner runs at most
the plan's rounds per read."""
from fractions import Fraction

import pytest
import torch

from specengine import SamplingParams
from specengine.engine.batch import PrefillChunk, Prefilling
from specengine.engine.prefill_budget import PrefillBudget, PrefillShare
from specengine.engine.request import DecodeStats, Request
from specengine.engine.scheduler import Admission, RowRelease, Scheduler, StepPlan

from engine_util import make_engine

V = 32


@pytest.fixture(scope="module")
def models(tiny_pair):
    return tiny_pair


def prompt(n: int, seed: int = 0, vocab: int = V) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def request(tokens: list[int], request_id: str = "r", **params) -> Request:
    return Request(request_id, tokens, SamplingParams(**params), 0, DecodeStats(gamma=0, prompt_tokens=len(tokens)))


def test_a_plan_and_its_parts_are_checked_when_made():
    r, s = request([1, 2, 3], "r"), request([4, 5], "s")
    row = Prefilling(r, [1, 2], units=2)
    plan = dict(admitted=[], chunks=[PrefillChunk(row, 2, 2)], layers=None, joins=[row], decoding=[s, r], gamma=3,
                rounds_per_read=1)
    StepPlan(**plan)
    with pytest.raises(ValueError, match="gamma >= 0"):
        StepPlan(**{**plan, "gamma": -1})
    with pytest.raises(ValueError, match="rounds_per_read >= 1 exactly when rows decode"):
        StepPlan(**{**plan, "rounds_per_read": 0})
    with pytest.raises(ValueError, match="rounds_per_read >= 1 exactly when rows decode"):
        StepPlan(**{**plan, "joins": [], "decoding": [], "rounds_per_read": 1})
    with pytest.raises(ValueError, match="the rows that join decode last"):
        StepPlan(**{**plan, "decoding": [r, s]})
    with pytest.raises(ValueError, match="one chunk at most"):
        StepPlan(**{**plan, "chunks": [PrefillChunk(row, 1, 1), PrefillChunk(row, 1, 1)]})
    with pytest.raises(ValueError, match="at least one layer"):
        StepPlan(**{**plan, "layers": 0})
    with pytest.raises(ValueError, match="a chunk of 3 units, with 2 left"):
        PrefillChunk(row, 3, 3)
    with pytest.raises(ValueError, match="0 <= done <= units"):
        Prefilling(r, [1, 2], units=2, done=3)
    with pytest.raises(ValueError, match="starts with the prefix cache's 1 blocks done"):
        Admission(Prefilling(r, list(range(70)), units=70), [object()])


def scheduler_over(rows: list[Prefilling], budget: int | None, layers: int | None = None) -> Scheduler:
    """A scheduler whose batch holds these staged rows and nothing decodes."""
    class Batch:
        requests, prefilling, pending, rows_held = [], rows, None, len(rows)

    class Share(PrefillBudget):
        def next(self, decoding):
            return PrefillShare(budget, layers)

    return Scheduler(Batch(), None, Share(budget), None, None, 2, False, 1024, 1, 0, lambda: None)


def test_chunks_end_at_multiples_of_the_cut_or_the_prefill_end_within_the_budget():
    tokens = [Prefilling(request(prompt(n + 1), str(n)), prompt(n), n, cut=32) for n in (100, 20, 50)]
    plan = scheduler_over(tokens, 96).schedule()
    assert [(c.row.units, c.units, c.tokens) for c in plan.chunks] == [(100, 96, 96)]
    tokens[0].done = 96
    plan = scheduler_over(tokens, 64).schedule()  # 4 to finish the first, 20 the second, 40 left: 32 of the third
    assert [(c.units, c.tokens) for c in plan.chunks] == [(4, 4), (20, 20), (32, 32)]
    assert plan.joins == tokens[:2] and plan.decoding == [t.request for t in tokens[:2]]
    plan = scheduler_over(tokens, 32).schedule()  # 8 left for the third: less than its cut
    assert [(c.units, c.tokens) for c in plan.chunks] == [(4, 4), (20, 20)]
    assert [(c.units, c.tokens) for c in scheduler_over(tokens, None).schedule().chunks] == [(4, 4), (20, 20), (50, 50)]


def test_encoder_blocks_count_their_share_of_the_prompt_and_a_step_runs_one_at_least():
    def encoder(source: int, blocks: int = 4) -> Prefilling:
        return Prefilling(request(prompt(source)), [], blocks, unit_tokens=Fraction(source, blocks))

    rows = [encoder(300), encoder(20)]
    # 75 tokens a block: 64 pays for none, but the step's first chunk takes one.
    assert [(c.units, c.tokens) for c in scheduler_over(rows, 64).schedule().chunks] == [(1, 75)]
    assert [(c.units, c.tokens) for c in scheduler_over(rows, 160).schedule().chunks] == [(2, 150), (2, 10)]
    rows[0].done = 3
    plan = scheduler_over(rows, 160).schedule()
    assert [(c.units, c.tokens) for c in plan.chunks] == [(1, 75), (4, 20)] and plan.joins == rows


def test_a_chunk_run_by_layers_joins_when_its_last_layer_runs():
    row = Prefilling(request(prompt(41)), prompt(40), 40, cut=32)
    assert scheduler_over([row], None, layers=1).schedule().joins == []  # one layer of two
    assert scheduler_over([row], None, layers=2).schedule().joins == [row]


@pytest.mark.parametrize("drafter, options", [("model", dict(prefill_chunk_tokens=32)),
                                              ("none", dict(prefill_chunk_tokens=64, max_batch_size=2)),
                                              ("model", dict(cuda_graphs=True, max_batch_size=4, rounds_per_read=4))])
def test_each_plan_is_what_the_runner_does(models, drafter, options):
    """Step by step with requests joining and leaving: the rows a plan says join are the rows that
    join, its decoding rows are the ones that get tokens, and no read runs more rounds than it allows."""
    engine = make_engine(models, drafter, **options)
    specs = [(prompt(n, seed=n), SamplingParams(max_new_tokens=m, temperature=t, seed=n))
             for n, m, t in ((5, 30, 0.0), (100, 12, 1.0), (40, 20, 0.7), (70, 9, 0.0), (3, 15, 1.0))]
    engine.add_request(*specs[0])
    plans, run = [], engine.runner.run

    def recorded(plan):
        outcome = run(plan)
        plans.append((plan, outcome))
        return outcome

    engine.runner.run = recorded
    step = 0
    while engine.has_unfinished_requests():
        if step in (1, 2, 4, 5):
            engine.add_request(*specs[(1, 2, 4, 5).index(step) + 1])
        prefilling = list(engine.runner.batch.prefilling)
        outputs = engine.step()
        plan, outcome = plans[-1]
        joined = [j for j in prefilling + [a.row for a in plan.admitted] if j.request in engine.scheduler.decoding
                  or j.request.finish_reason is not None]
        assert plan.joins == joined
        assert {o.request_id for o in outputs} == {r.request_id for r in plan.decoding}
        assert len(outcome.results) == len(plan.decoding) and outcome.rounds <= plan.rounds_per_read
        step += 1
    assert any(p.joins for p, _ in plans) and any(p.chunks and not p.joins for p, _ in plans)
    if options.get("rounds_per_read"):
        assert any(o.rounds > 1 for _, o in plans)


def test_a_plan_naming_other_rows_to_join_is_refused(models):
    engine = make_engine(models, "model", prefill_chunk_tokens=32)
    engine.add_request(prompt(100), SamplingParams(max_new_tokens=4))
    plan = engine.scheduler.schedule()  # the first of four chunks: nothing joins yet
    assert plan.joins == [] and len(plan.admitted) == 1
    row = plan.admitted[0].row
    wrong = StepPlan(plan.admitted, plan.chunks, plan.layers, [row], [row.request], plan.gamma, 1)
    with pytest.raises(RuntimeError, match="other rows than the plan said"):
        engine.runner.run(wrong)


GREEDY6 = SamplingParams(max_new_tokens=6, temperature=0.0)


def test_a_step_whose_planning_fails_ends_the_requests_it_admitted_and_keeps_serving(models, monkeypatch):
    engine = make_engine(models, "model", prefill_chunk_tokens=32)
    want = engine.generate([prompt(70, seed=1)], GREEDY6)[0].token_ids
    engine.add_request(prompt(70, seed=1), GREEDY6, "runs")
    assert engine.step()[0].new_token_ids == want[:1]

    def broken(*args):
        raise RuntimeError("lookup failed")

    monkeypatch.setattr(engine.prefix_cache, "match", broken)
    engine.add_request(prompt(80, seed=2), GREEDY6, "planned")
    with pytest.raises(RuntimeError, match="lookup failed"):
        engine.step()
    monkeypatch.undo()
    outputs = {}
    for _ in range(50):  # a request lost off the queue would leave it unfinished for ever
        if not (engine.has_unfinished_requests() or engine.has_pending_outputs()):
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    (ended,) = outputs["planned"]
    assert ended.finish_reason == "abort" and "planning its step failed (RuntimeError: lookup failed)" in ended.message
    assert engine.num_waiting == 0 and engine.num_running == 0
    assert [t for out in outputs["runs"] for t in out.new_token_ids] == want[1:]  # its first came before
    assert engine.generate([prompt(70, seed=1)], GREEDY6)[0].token_ids == want


class MovelessBatch:
    """A batch whose row moves fail: the scheduler must decide, never move."""

    def __init__(self, requests, prefilling):
        self.requests, self.prefilling, self.pending = requests, prefilling, None
        self.rows_held = len(requests) + len(prefilling)

    def _moved(self, *args):
        raise AssertionError("the scheduler moved rows: the model runner's job")

    keep = drop_prefilling = drop_all_prefilling = clear = promote = _moved


def test_the_scheduler_decides_the_rows_to_free_and_moves_none():
    """release, abort, fail and rows_broken return the rows to free (RowRelease) for the model
    runner to drop; they end the requests the decision concerns."""
    running = [request([1, 2], str(i)) for i in range(3)]
    staged = [Prefilling(request([3, 4, 5], f"s{i}"), [3, 4], 2) for i in range(2)]
    batch = MovelessBatch(running, staged)
    scheduler = Scheduler(batch, None, PrefillBudget(None), None, None, 2, False, 1024, 1, 0, lambda: None)
    scheduler.add(running + [j.request for j in staged])
    scheduler.waiting.clear()
    assert scheduler.release() == RowRelease()
    running[1].finish_reason, staged[0].request.finish_reason = "stop", "stop"
    assert scheduler.release(report=True) == RowRelease((staged[0],), (0, 2))
    assert [r.request_id for r in scheduler.take_ended()] == ["1"]
    # Nothing carried the release out here: the rows of the requests that ended are still held.
    assert scheduler.abort("0") == RowRelease((staged[0],), (2,)) and running[0].finish_reason == "abort"
    assert scheduler.abort("nobody") is None
    assert scheduler.rows_broken("prefilling", RuntimeError("x")) == RowRelease(all_prefilling=True)
    assert staged[1].request.finish_reason == "abort" and running[2].finish_reason is None
    assert scheduler.rows_broken("running", RuntimeError("device lost")) == RowRelease(all_rows=True)
    assert "device lost" in running[2].message


def test_planning_measures_nothing(models):
    """The step costs a plan prices are measured before the scheduler plans (Engine._cover_costs,
    up to rows_to_hold's batch size), never by the scheduler."""
    engine = make_engine(models, "model", gamma="auto", max_gamma=3)
    covered, controller = [], engine.gamma_controller
    cover = controller.costs_by_batch.cover
    controller.costs_by_batch.cover = lambda rows: (covered.append(rows), cover(rows))
    for i in range(3):
        engine.add_request(prompt(10, seed=i), SamplingParams(max_new_tokens=3))
    assert engine.scheduler.rows_to_hold() == 3
    schedule = engine.scheduler.schedule

    def planning():
        before = list(covered)
        plan = schedule()
        assert covered == before, "the scheduler measured costs"
        return plan

    engine.scheduler.schedule = planning
    engine.step()
    assert covered == [3]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.rows_to_hold() is None
