"""The pure-torch verify step (the kernels' oracle): exact, greedy/one-hot, statistical, invariants."""
import pytest
import torch

from specengine.sampling.batch import rows_valid
from specengine.sampling.verify import verify_reference
from specengine.sampling.warp import sample_from_probs, warp_probs

from stats_util import chi_square_pvalue
from verify_cases import WARPS, VerifyCase, fixed_position_case, naive_verify, random_case

HOSTILE = [(1, 1, 1), (3, 2, 111), (5, 8, 111), (1, 4, 8193), (3, 3, 32000), (2, 2, 151936), (7, 5, 64),
           (64, 1, 16), (64, 8, 33)]


def check_invariants(case: VerifyCase, emitted, counts):
    B, G1 = emitted.shape
    assert counts.dtype == torch.int64 and emitted.dtype == torch.int64
    assert ((counts >= 1) & (counts <= case.num_drafts + 1)).all()
    position = torch.arange(G1)
    assert ((emitted >= 0) == (position < counts[:, None])).all(), "-1 exactly after each row's end"
    accepted = position[None, : G1 - 1] < (counts - 1)[:, None]
    assert torch.equal(emitted[:, :-1][accepted], case.draft_tokens[accepted]), "accepted tokens are the drafts"
    assert (emitted < case.target_logits.shape[-1]).all()


@pytest.mark.parametrize("B,G,V", HOSTILE)
@pytest.mark.parametrize("one_hot", [False, True])
def test_equals_naive_algorithm_given_same_uniforms(B, G, V, one_hot):
    case = random_case(B, G, V, seed=B * 1000 + G * 10 + V % 7, one_hot=one_hot)
    emitted, counts = verify_reference(*case.args())
    want_emitted, want_counts = naive_verify(case)
    assert torch.equal(counts, want_counts)
    assert torch.equal(emitted, want_emitted)
    check_invariants(case, emitted, counts)


def test_bfloat16_logits_equal_their_float32_upcast():
    case = random_case(4, 3, 111, seed=3, dtype=torch.bfloat16)
    up = VerifyCase(**{**case.__dict__, "target_logits": case.target_logits.float(),
                       "draft_logits": case.draft_logits.float()})
    for a, b in zip(verify_reference(*case.args()), verify_reference(*up.args())):
        assert torch.equal(a, b)


def test_greedy_accepts_while_draft_is_argmax_then_emits_argmax():
    V = 10
    target = torch.full((1, 4, V), -1.0)
    for i, best in enumerate([3, 5, 7, 2]):
        target[0, i, best] = 4.0
    tokens = torch.tensor([[3, 5, 1]])
    case = VerifyCase(target, torch.randn(1, 3, V), tokens, torch.tensor([3]), torch.zeros(1),
                      torch.zeros(1, dtype=torch.int64), torch.ones(1), torch.zeros(1),
                      torch.rand(1, 4), torch.rand(1, 4))
    emitted, counts = verify_reference(*case.args())
    assert emitted.tolist() == [[3, 5, 7, -1]] and counts.tolist() == [3]
    # All accepted: the bonus token is the argmax after the last draft.
    case.draft_tokens = torch.tensor([[3, 5, 7]])
    emitted, counts = verify_reference(*case.args())
    assert emitted.tolist() == [[3, 5, 7, 2]] and counts.tolist() == [4]


def test_one_hot_drafts_on_one_hot_target():
    """p one-hot (temperature 1, a dominant logit): a matching one-hot draft is always accepted,
    another always rejected and replaced by p's token."""
    V = 6
    target = torch.full((2, 3, V), -1e4)
    target[:, 0, 4], target[:, 1, 1], target[:, 2, 0] = 0.0, 0.0, 0.0
    tokens = torch.tensor([[4, 1], [4, 2]])
    case = VerifyCase(target, None, tokens, torch.tensor([2, 2]), torch.ones(2), torch.zeros(2, dtype=torch.int64),
                      torch.ones(2), torch.zeros(2), torch.rand(2, 3), torch.rand(2, 3))
    emitted, counts = verify_reference(*case.args())
    assert emitted.tolist() == [[4, 1, 0], [4, 1, -1]]
    assert counts.tolist() == [3, 2]


def test_rows_without_drafts_emit_one_target_sample():
    case = random_case(9, 4, 50, seed=1)
    case.num_drafts = torch.zeros(9, dtype=torch.int64)
    emitted, counts = verify_reference(*case.args())
    assert counts.tolist() == [1] * 9 and (emitted[:, 1:] == -1).all()
    p = warp_probs(case.target_logits[:, 0], case.temperature, case.top_k, case.top_p, case.min_p)
    assert torch.equal(emitted[:, 0], sample_from_probs(p, case.u_sample[:, 0]))


# ---- statistics: the emitted token at a position is distributed as the warped p --------------

@pytest.mark.slow
@pytest.mark.parametrize("warp", list(WARPS))
@pytest.mark.parametrize("one_hot", [False, True])
def test_emitted_token_is_distributed_as_p(warp, one_hot):
    N = 100_000
    case, p = fixed_position_case(N, WARPS[warp], one_hot)
    emitted, counts = verify_reference(*case.args())
    check_invariants(case, emitted, counts)
    first = emitted[:, 0]
    assert chi_square_pvalue(torch.bincount(first, minlength=p.numel()), p) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("bug, N", [("residual_p", 5000), ("reused_uniform", 20_000), ("wrong_position", 5000),
                                    ("no_renorm", 5000)])
def test_statistical_test_catches_broken_variants(bug, N):
    # Sample sizes give each bug p < 1e-6 with margin (a reused uniform is the subtlest).
    case, p = fixed_position_case(N, WARPS["T=1"], seed=1)
    if bug == "wrong_position":  # make the next position's p differ from this one's
        case.target_logits[:, 1] = torch.randn(12, generator=torch.Generator().manual_seed(5)) * 1.5
    correct, _ = naive_verify(case)
    assert chi_square_pvalue(torch.bincount(correct[:, 0], minlength=12), p) > 1e-3
    broken, _ = naive_verify(case, bug=bug)
    assert chi_square_pvalue(torch.bincount(broken[:, 0], minlength=12), p) < 1e-6


def test_the_one_reduction_validity_check_breaks_only_the_broken_row():
    """A draft that scores only its first 8192 ids has -inf on the rest of every row: valid. A NaN
    or +inf anywhere in a row, or a position of -inf only, breaks that row and no other."""
    g = torch.Generator().manual_seed(0)
    draft = torch.full((2, 3, 49152), float("-inf"))
    draft[..., :8192] = torch.randn(2, 3, 8192, generator=g)
    assert rows_valid(draft).tolist() == [True, True]
    for index, value in [((1, 2, 5), float("nan")), ((0, 0, 40000), float("nan")), ((1, 1, 9000), float("inf")),
                         ((0, 2, slice(None)), float("-inf"))]:
        broken = draft.clone()
        broken[index] = value
        assert rows_valid(broken).tolist() == [index[0] == 1, index[0] == 0]
    assert rows_valid(torch.zeros(0, 1, 5)).tolist() == []
