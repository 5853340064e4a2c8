"""Speculative sampling reproduces the target's exact distribution over short continuations (stats_util:
the target's probabilities warped in float64 from the definitions, not by the engine's warps)."""
import pytest
import torch

from specengine import Engine, SamplingParams
from specengine.drafters.model import ModelDrafter
from specengine.drafters.ngram import NgramDrafter

from engine_util import tiny_model
from stats_util import CASES, PROMPT, V, chi_square_pvalue, exact_distribution, sample_counts
from verify_cases import VerifyCase, naive_verify

@pytest.fixture(scope="module")
def target():
    return tiny_model(V, seed=0, hidden_size=16, logit_scale=4.0)


@pytest.fixture(scope="module")
def draft():
    return tiny_model(V, seed=3, num_layers=1, hidden_size=16, logit_scale=4.0)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("drafter", ["model", "ngram", "none"])
@pytest.mark.parametrize("impl", ["reference", "cpp"])
def test_speculative_sampling_matches_exact_target_distribution(case, drafter, impl, target, draft):
    params = CASES[case]
    chosen = {"model": ModelDrafter(draft, V, V), "ngram": NgramDrafter(1, 2), "none": None}[drafter]
    engine = Engine(target, drafter=chosen, gamma=3, verify_impl=impl)
    counts = sample_counts(engine, params, 12_000)
    expected = exact_distribution(target, params)
    assert chi_square_pvalue(counts, expected) > 1e-3
    if drafter == "model":  # drafts were really tested, and some rejected
        assert 0.05 < engine.last_run_stats.acceptance_rate < 0.95


@pytest.mark.slow
def test_distribution_test_fails_for_broken_residual(target, draft, monkeypatch):
    """Resampling from p instead of norm(max(0, p - q)) is not lossless, and the test sees it."""
    import specengine.ops.verify as ops

    params = CASES["T=1"]
    engine = Engine(target, drafter=ModelDrafter(draft, V, V), gamma=3, verify_impl="reference")
    monkeypatch.setattr(ops, "verify_reference", lambda *args: naive_verify(VerifyCase(*args), bug="residual_p"))
    counts = sample_counts(engine, params, 6_000)
    assert chi_square_pvalue(counts, exact_distribution(target, params)) < 1e-6


@pytest.mark.parametrize("impl", ["reference", "cpp"])
def test_seeded_request_is_reproducible_and_batch_invariant(target, draft, impl):
    engine = Engine(target, drafter=ModelDrafter(draft, V, V), gamma=3, verify_impl=impl)
    mine = SamplingParams(max_new_tokens=20, temperature=1.0, seed=1234)
    (alone,) = engine.generate([PROMPT], mine)
    (again,) = engine.generate([PROMPT], mine)
    others = [SamplingParams(max_new_tokens=n, temperature=t, top_k=k, seed=s)
              for n, t, k, s in [(5, 0.0, 0, 1), (30, 0.8, 2, 2), (9, 1.3, 0, None)]]
    batch = engine.generate([[3, 3], [0, 1, 2, 3, 4, 0, 1], PROMPT, [2]], [others[0], others[1], mine, others[2]])
    assert alone.token_ids == again.token_ids == batch[2].token_ids
    # Without a drafter (different rounds, different batch) the same request is still reproducible.
    plain = Engine(target)
    assert plain.generate([PROMPT], mine)[0].token_ids == plain.generate([[4, 4], PROMPT], [others[1], mine])[1].token_ids
    # Different seeds give different samples.
    assert engine.generate([PROMPT], SamplingParams(max_new_tokens=20, seed=99))[0].token_ids != alone.token_ids


def test_sampling_batch_knows_whether_any_row_filters():
    from specengine.sampling.batch import SamplingBatch

    def filters(*params):
        return SamplingBatch.from_params(list(params), [0] * len(params), "cpu").filters

    assert not filters(SamplingParams(temperature=1.0), SamplingParams(temperature=0.5))
    assert not filters(SamplingParams(temperature=0.0, top_k=5, top_p=0.5))  # greedy rows warp nothing
    assert filters(SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3))
    assert filters(SamplingParams(top_p=0.9)) and filters(SamplingParams(min_p=0.1))
    batch = SamplingBatch.from_params([SamplingParams(), SamplingParams(top_k=2)], [0, 1], "cpu")
    assert batch.select([0]).filters  # a subset keeps the safe answer


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernel runs here in the interpreter, on CPU tensors "
                                                       "(compiled, test_verify_kernels runs it on the GPU)")
def test_triton_verify_in_the_loop_gives_the_cpp_tokens(target, draft):
    """The Triton kernel (in its interpreter on CPU) inside the engine: seeded requests in a batch
    without filters (their passes skipped) and in one with top-k, top-p and greedy rows."""
    batches = [[SamplingParams(max_new_tokens=10, temperature=t, seed=s) for s, t in enumerate((1.0, 0.6, 1.4))],
               [SamplingParams(max_new_tokens=10, temperature=0.8, top_k=2, seed=7),
                SamplingParams(max_new_tokens=10, top_p=0.8, seed=8), SamplingParams(max_new_tokens=10, temperature=0.0)]]
    for params in batches:
        tokens = {impl: [r.token_ids for r in Engine(target, drafter=ModelDrafter(draft, V, V), gamma=3,
                                                     verify_impl=impl).generate([PROMPT] * 3, params)]
                  for impl in ("cpp", "triton")}
        assert tokens["triton"] == tokens["cpp"]


@pytest.fixture(scope="module")
def stored_pair():
    """A target and draft whose matrices are kept as a GGUF file stores them (Q4_1 and Q8_0 blocks:
    rows of 32 weights): the file's own model, at its own precision."""
    from specengine.devtools.tiny import stored_copy

    target = stored_copy(tiny_model(V, seed=0, hidden_size=32, logit_scale=4.0), "Q4_1")
    draft = stored_copy(tiny_model(V, seed=3, num_layers=1, hidden_size=32, logit_scale=4.0), "Q8_0")
    return target, draft


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpp-layers", "torch"])
def test_speculative_sampling_on_a_quantized_target_matches_its_exact_distribution(backend, stored_pair):
    target, draft = stored_pair
    for model in stored_pair:
        model.use_backend(backend)
    params = CASES["T=0.7,top_k=3"]
    engine = Engine(target, drafter=ModelDrafter(draft, V, V), gamma=3)
    counts = sample_counts(engine, params, 12_000)
    assert chi_square_pvalue(counts, exact_distribution(target, params)) > 1e-3
    assert 0.05 < engine.last_run_stats.acceptance_rate < 0.95


SCRIPTED_GAMMAS = [3, 0, 4, 1, 0, 0, 2, 4, 1]  # each round's gamma, in turn: up, down, and runs at 0


def scripted_gamma_engine(target, draft, verify_impl: str = "cpp") -> tuple[Engine, list[int]]:
    """An engine with gamma="auto" whose controller's choice is forced through SCRIPTED_GAMMAS (the
    policy's own bookkeeping kept: its estimates, probes and ramp are what a real choice leaves), and
    the gammas its rounds ran at. Batches of 200 rows: requests join as others leave, each at its
    own place in the script."""
    from specengine.engine.gamma import CostModel

    engine = Engine(target, drafter=ModelDrafter(draft, V, V), gamma="auto", verify_impl=verify_impl,
                    costs=CostModel(0.05, tuple(1.0 + 0.02 * k for k in range(9))), max_batch_size=200)
    controller = engine.gamma_controller
    choose, ran = controller.choose, []

    def scripted(estimates):
        choose(estimates)  # its bookkeeping, its choice ignored
        gamma = SCRIPTED_GAMMAS[len(ran) % len(SCRIPTED_GAMMAS)]
        for e in estimates:
            e.last_gamma = gamma
        ran.append(gamma)
        return gamma

    controller.choose = scripted
    return engine, ran


@pytest.mark.slow
def test_auto_gamma_keeps_the_exact_distribution_whatever_gamma_each_round_takes(target, draft):
    """gamma="auto" changes gamma from round to round, with rounds at 0 between (the draft model
    then catches up on what it missed): with the choice scripted up and down and through runs of
    0, the continuations are still distributed as the target's."""
    params = CASES["T=0.7,top_k=3"]
    engine, ran = scripted_gamma_engine(target, draft)
    counts = sample_counts(engine, params, 4_000)
    assert set(ran) == set(SCRIPTED_GAMMAS) and len(ran) > 3 * len(SCRIPTED_GAMMAS)
    assert chi_square_pvalue(counts, exact_distribution(target, params)) > 1e-3
    assert 0.05 < engine.last_run_stats.acceptance_rate < 0.95
