"""The fused verify kernels (C++ on CPU, Triton in its interpreter on CPU or compiled on a GPU)
against the pure-torch reference: exact given the same uniforms, greedy/one-hot, statistical,
invariants, hostile shapes. The interpreter costs about 10 ms per program (a row's tile), so
Triton's CPU grids stay small; its statistical runs (100,000 rows) are marked gpu, and the same
test runs the C++ kernel on CPU."""
import re

import pytest
import torch

from specengine.ops.verify import verify
from specengine.sampling.rng import STREAM_ACCEPT, STREAM_SAMPLE, uniforms
from specengine.sampling.verify import verify_reference
from specengine.sampling.warp import sample_from_probs, warp_probs

from conftest import portable_cpu_kernels
from stats_util import chi_square_pvalue
from verify_cases import WARPS, VerifyCase, fixed_position_case, random_case

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
# "cpp-portable": the C++ kernel through its plain loops, as on CPUs without AVX2/FMA.
KERNELS = ["cpp", "cpp-portable", "triton"]


def device_for(impl):
    return "cpu" if impl.startswith("cpp") else DEVICE


def run(impl, case: VerifyCase, explicit=True, seeds=None, positions=None, target_lengths=None, draft_lengths=None,
        filters=True):
    dev = device_for(impl)
    B = case.num_drafts.shape[0]
    to = lambda t: None if t is None else t.to(dev).contiguous()  # noqa: E731
    seeds = torch.zeros(B, dtype=torch.int64) if seeds is None else seeds
    positions = torch.zeros(B, dtype=torch.int64) if positions is None else positions
    with portable_cpu_kernels(impl == "cpp-portable"):
        out = verify(to(case.target_logits), to(case.draft_logits), to(case.draft_tokens), to(case.num_drafts),
                     to(case.temperature), to(case.top_k), to(case.top_p), to(case.min_p), to(seeds), to(positions),
                     u_accept=to(case.u_accept) if explicit else None,
                     u_sample=to(case.u_sample) if explicit else None,
                     target_lengths=target_lengths, draft_lengths=draft_lengths, impl=impl.removesuffix("-portable"),
                     filters=filters)
    return tuple(t.cpu() for t in out)


def boundary_explains(case: VerifyCase, b: int, ref_row: torch.Tensor, got_row: torch.Tensor, eps=2e-5) -> bool:
    """Whether row b's first disagreement sits where a uniform is within float rounding of a decision."""
    j = int((ref_row != got_row).nonzero()[0])
    V = case.target_logits.shape[-1]
    params = [t[b:b + 1] for t in (case.temperature, case.top_k, case.top_p, case.min_p)]
    p = warp_probs(case.target_logits[b, j:j + 1].float(), *params)[0].double()
    if case.draft_logits is not None and j < case.draft_logits.shape[1]:
        q = warp_probs(case.draft_logits[b, j:j + 1].float(), *params)[0].double()
    elif j < case.draft_tokens.shape[1]:
        q = torch.nn.functional.one_hot(case.draft_tokens[b, j], V).double()
    else:
        q = torch.zeros(V, dtype=torch.float64)
    if j < int(case.num_drafts[b]):
        x = int(case.draft_tokens[b, j])
        if abs(float(case.u_accept[b, j]) * q[x] - p[x]) <= eps:
            return True
        dist = (p - q).clamp(min=0)
    else:
        dist = p
    cdf = dist.cumsum(0)
    return bool((cdf - float(case.u_sample[b, j]) * cdf[-1]).abs().min() <= eps * cdf[-1])


def assert_matches_reference(case: VerifyCase, got):
    ref_emitted, ref_counts = verify_reference(*case.args())
    emitted, counts = got
    differing = [b for b in range(len(counts)) if not torch.equal(emitted[b], ref_emitted[b])]
    assert len(differing) <= max(1, len(counts) // 100), f"rows {differing} differ from the reference"
    for b in differing:
        assert boundary_explains(case, b, ref_emitted[b], emitted[b]), f"row {b} differs away from any boundary"
    same = [b for b in range(len(counts)) if b not in differing]
    assert torch.equal(counts[same], ref_counts[same])


def shapes_for(impl):
    # Vocabularies across the Triton kernel's tiles (4096): one entry, one partial tile, 8193 =
    # two tiles and one entry. random_case's rows cycle through greedy, min-p, top-k and top-p,
    # so B >= 4 meets every warp (B = 3 at 151936 leaves out top-p, the interpreter's slowest).
    shapes = [(1, 1, 1), (7, 1, 1), (3, 2, 111), (5, 8, 111), (4, 4, 8193), (3, 1, 64), (6, 3, 17), (17, 2, 16),
              (4, 2, 32000), (4, 1, 49152), (3, 1, 151936)]
    if impl.startswith("cpp") or GPU:
        shapes += [(64, 2, 16), (3, 3, 32000), (2, 2, 151936), (64, 5, 64), (8, 8, 1000), (1, 6, 32000),
                   (4, 1, 151936)]
    if GPU:
        shapes += [(64, 8, 32000), (8, 4, 151936)]
    return shapes


def one_hot_forms(impl, shape) -> list[bool]:
    """Drafts as logits, and as one-hot tokens (no draft logits). The interpreter takes one-hot
    drafts up to 8193 entries (two tiles and one entry: every tile case of the one-hot path, whose
    vocabulary loop is the other form's); the larger vocabularies' one-hot cases (95 s of the
    interpreter) run on the C++ kernel and, compiled, on a GPU."""
    return [False] if impl == "triton" and not GPU and shape[2] > 8193 else [False, True]


def pytest_generate_tests(metafunc):
    if "kernel_shape" in metafunc.fixturenames:
        params = [(impl, shape, one_hot) for impl in KERNELS for shape in shapes_for(impl)
                  for one_hot in one_hot_forms(impl, shape)]
        metafunc.parametrize("impl, kernel_shape, one_hot", params, ids=[f"{i}-{s}-{o}" for i, s, o in params])


def test_exact_against_reference_given_same_uniforms(impl, kernel_shape, one_hot):
    B, G, V = kernel_shape
    case = random_case(B, G, V, seed=B * 7 + G * 3 + V % 11, one_hot=one_hot)
    assert_matches_reference(case, run(impl, case))


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits(impl, dtype):
    case = random_case(5, 3, 111, seed=4, dtype=dtype)
    assert_matches_reference(case, run(impl, case))


@pytest.mark.parametrize("impl", KERNELS)
def test_huge_logits_and_all_but_one_masked(impl):
    case = random_case(4, 2, 50, seed=9)
    case.target_logits = case.target_logits * 1e30
    case.draft_logits[1] = float("-inf")
    case.draft_logits[1, :, 7] = 0.0  # the draft can only say token 7
    case.draft_tokens[1] = 7
    assert_matches_reference(case, run(impl, case))


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thresholds_inside_and_at_the_edges_of_tied_logits(impl, dtype):
    """Logits in steps of 0.5 (groups of equal values): top-k, top-p and min-p cut inside the
    groups and at their edges, where every tie is kept; k = 1, V - 1 and V, top-p near 0 and 1."""
    B, G, V = 12, 2, 300
    g = torch.Generator().manual_seed(3)
    target = (torch.randn(B, G + 1, V, generator=g) * 4).round() / 2
    draft = ((target[:, :G] + torch.randn(B, G, V, generator=g)) * 2).round() / 2
    temperature = torch.tensor([1.0, 0.8, 1.0, 1.2, 1.0, 1.0, 0.9, 1.0, 1.0, 1.0, 0.7, 1.0])
    top_k = torch.tensor([1, 2, 7, V - 1, V, 0, 0, 0, 0, 0, 3, 50])
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.01, 0.5, 0.95, 0.999, 1.0, 0.7, 0.3])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.3, 0.2, 0.0])
    q = warp_probs(draft.reshape(B * G, V), *(t.repeat_interleave(G) for t in (temperature, top_k, top_p, min_p)))
    tokens = sample_from_probs(q, torch.rand(B * G, generator=g)).view(B, G)
    case = VerifyCase(target.to(dtype), draft.to(dtype), tokens, torch.full((B,), G), temperature, top_k, top_p,
                      min_p, torch.rand(B, G + 1, generator=g), torch.rand(B, G + 1, generator=g))
    assert_matches_reference(case, run(impl, case))


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("one_hot", [False, True])
def test_temperature_only_rows_without_the_filter_passes(impl, one_hot):
    """filters=False (no row uses top-k, top-p or min-p) gives the reference's tokens, and on
    the same rows exactly what the full kernel gives."""
    case = random_case(6, 3, 4100, seed=12, one_hot=one_hot, params="plain")
    case.temperature = torch.tensor([0.0, 1.0, 0.6, 1.7, 0.0, 1.0])
    plain = run(impl, case, filters=False)
    assert_matches_reference(case, plain)
    full = run(impl, case, filters=True)
    assert torch.equal(plain[0], full[0]) and torch.equal(plain[1], full[1])


@pytest.mark.parametrize("impl", KERNELS)
def test_philox_mode_equals_reference_with_the_same_uniforms(impl):
    """Without explicit uniforms the kernels draw Philox(seed, position + i, stream) themselves."""
    case = random_case(6, 4, 97, seed=2)
    seeds = torch.tensor([0, 1, 2**62, 12345, 2**32, 77])
    positions = torch.tensor([0, 5, 2**33, 100, 7, 1])
    steps = positions[:, None] + torch.arange(5)
    case.u_accept, case.u_sample = uniforms(seeds, steps, STREAM_ACCEPT), uniforms(seeds, steps, STREAM_SAMPLE)
    got = run(impl, case, explicit=False, seeds=seeds, positions=positions)
    assert_matches_reference(case, got)


@pytest.mark.parametrize("impl", KERNELS)
def test_greedy_rows_take_the_argmax_path_beside_sampled_rows(impl):
    V = 10
    target = torch.randn(3, 4, V)
    best = target.argmax(-1)
    tokens = best[:, :3].clone()
    tokens[0, 1] = (tokens[0, 1] + 1) % V  # row 0: second draft wrong
    case = VerifyCase(target, torch.randn(3, 3, V), tokens, torch.tensor([3, 3, 2]), torch.tensor([0.0, 0.0, 1.0]),
                      torch.zeros(3, dtype=torch.int64), torch.ones(3), torch.zeros(3), torch.rand(3, 4),
                      torch.rand(3, 4))
    emitted, counts = run(impl, case)
    assert emitted[0].tolist() == [int(best[0, 0]), int(best[0, 1]), -1, -1] and counts[0] == 2
    assert emitted[1].tolist() == best[1].tolist() and counts[1] == 4
    assert_matches_reference(case, (emitted, counts))


@pytest.mark.parametrize("impl", KERNELS)
def test_invariants_and_cache_lengths(impl):
    case = random_case(9, 5, 40, seed=5)
    case.num_drafts[0] = 0
    target_lengths = torch.arange(9) * 10
    draft_lengths = target_lengths + torch.tensor([-3, 0, 2, 9, 4, -1, 6, 0, 1])
    t, d = target_lengths.clone().to(device_for(impl)), draft_lengths.clone().to(device_for(impl))
    emitted, counts = run(impl, case, target_lengths=t, draft_lengths=d)
    t, d = t.cpu(), d.cpu()
    assert counts[0] == 1 and (emitted[0, 1:] == -1).all(), "a row without drafts emits exactly one token"
    assert ((counts >= 1) & (counts <= case.num_drafts + 1)).all()
    assert ((emitted >= 0) == (torch.arange(6) < counts[:, None])).all(), "-1 exactly after the end"
    assert torch.equal(t, target_lengths + counts), "target lengths advance by the emitted count"
    assert torch.equal(d, torch.minimum(draft_lengths, t)), "draft lengths clip to the target's"


@pytest.mark.parametrize("impl", KERNELS)
def test_rows_are_independent_of_the_batch(impl):
    case = random_case(6, 3, 64, seed=8)
    seeds, positions = torch.arange(6) * 1000, torch.arange(6) * 3
    whole = run(impl, case, explicit=False, seeds=seeds, positions=positions)
    sub = VerifyCase(*(t[2:4] if t is not None else None for t in case.args()))
    part = run(impl, sub, explicit=False, seeds=seeds[2:4], positions=positions[2:4])
    assert torch.equal(whole[0][2:4], part[0]) and torch.equal(whole[1][2:4], part[1])


# ---- statistics: the emitted token is distributed as the warped p --------------------------------

def statistical_impls():
    return ["cpp", pytest.param("triton", marks=pytest.mark.gpu)]


@pytest.mark.slow
@pytest.mark.parametrize("impl", statistical_impls())
@pytest.mark.parametrize("warp", list(WARPS))
@pytest.mark.parametrize("one_hot", [False, True])
def test_emitted_token_is_distributed_as_p(impl, warp, one_hot):
    N = 100_000
    case, p = fixed_position_case(N, WARPS[warp], one_hot)
    emitted, counts = run(impl, case, explicit=False, seeds=torch.arange(N), positions=torch.full((N,), 17))
    assert chi_square_pvalue(torch.bincount(emitted[:, 0], minlength=p.numel()), p) > 1e-3


@pytest.mark.gpu
def test_triton_does_not_recompile_for_new_round_sizes():
    from specengine.kernels import verify as kernels

    launched = [kernels._stats_kernel, kernels._top_k_kernel, kernels._top_p_first_kernel, kernels._top_p_kernel,
                kernels._floor_kernel, kernels._decide_kernel, kernels._sample_kernel]
    caches = [k.device_caches[torch.cuda.current_device()][0] for k in launched]
    for G, V in [(1, 64), (3, 100)]:  # compiles what these flags and this dtype need
        run("triton", random_case(4, G, V, seed=G))
    before = [set(c) for c in caches]
    for G, V in [(2, 60), (4, 33), (6, 5000), (1, 99), (8, 32000)]:  # new G and V, one of them over tiles
        run("triton", random_case(5, G, V, seed=G))
    assert all(set(c) == b for c, b in zip(caches, before)), "a new round size compiled a kernel again"


def planted_bug_tokens(bug: str, case: VerifyCase) -> torch.Tensor:
    """The first emitted token [N] of the C++ kernel's verification of `case` (G = 1, one draft a
    row, explicit uniforms) with a deliberate mistake planted around the kernel, none in it:
      reused-uniform       the residual sample takes the accept test's uniform (u_sample = u_accept)
      residual-from-wrong-row
                           a rejected row's token sampled from max(0, p_1 - q_0): the next position's p
      no-renormalisation   a rejected row's token the first index whose cumulative residual exceeds u,
                           not u times the residual's mass
    ("none": the kernel's own tokens.) Each row's uniform for the residual sample is its u_sample
    (the first two bugs' rows take the same uniform the kernel took)."""
    u_sample = case.u_accept if bug == "reused-uniform" else case.u_sample
    emitted, counts = verify(case.target_logits, case.draft_logits, case.draft_tokens, case.num_drafts,
                             case.temperature, case.top_k, case.top_p, case.min_p,
                             torch.zeros_like(case.num_drafts), torch.zeros_like(case.num_drafts),
                             u_accept=case.u_accept, u_sample=u_sample, impl="cpp")
    tokens = emitted[:, 0].clone()
    if bug in ("none", "reused-uniform"):
        return tokens
    params = (case.temperature, case.top_k, case.top_p, case.min_p)
    p = warp_probs(case.target_logits[:, 1 if bug == "residual-from-wrong-row" else 0].float(), *params)
    residual = (p - warp_probs(case.draft_logits[:, 0].float(), *params)).clamp(min=0)  # [N, V]
    u = case.u_sample[:, 0]
    if bug == "residual-from-wrong-row":
        planted = sample_from_probs(residual, u)
    else:
        last_positive = residual.shape[-1] - 1 - (residual > 0).flip(-1).to(torch.int64).argmax(-1)
        planted = torch.minimum((residual.cumsum(-1) <= u[:, None]).sum(-1), last_positive)
    rejected = counts == 1  # one draft a row: a single token is the rejection's
    tokens[rejected] = planted[rejected]
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("bug, N", [("reused-uniform", 60_000), ("residual-from-wrong-row", 5000),
                                    ("no-renormalisation", 5000)])
def test_statistical_test_catches_planted_bugs(bug, N):
    """The very distribution test above, on the C++ kernel's verification with a deliberate
    mistake planted around it (planted_bug_tokens): it must reject each, while the kernel's own
    tokens pass."""
    case, p = fixed_position_case(N, WARPS["T=1"], seed=1)
    case.target_logits[:, 1] = torch.randn(12, generator=torch.Generator().manual_seed(5)) * 1.5
    correct, broken = planted_bug_tokens("none", case), planted_bug_tokens(bug, case)
    assert chi_square_pvalue(torch.bincount(correct, minlength=12), p) > 1e-3
    assert chi_square_pvalue(torch.bincount(broken, minlength=12), p) < 1e-6


B_BAD, G_BAD, V_BAD = 3, 2, 11
BAD_VERIFY_ARGUMENTS = {  # a change to a valid call: the words its error must contain
    "3-d target": (dict(target_logits=torch.zeros(B_BAD, V_BAD)), "target_logits must be [B, G+1, V]"),
    "int target": (dict(target_logits=torch.zeros(B_BAD, G_BAD + 1, V_BAD, dtype=torch.int64)),
                   "logits dtype torch.int64 is not supported"),
    "strided target": (dict(target_logits=torch.zeros(B_BAD, G_BAD + 1, 2 * V_BAD)[..., ::2]),
                       "target_logits must be contiguous"),
    "draft shape": (dict(draft_logits=torch.zeros(B_BAD, G_BAD + 1, V_BAD)), "draft_logits must be [3, 2, 11]"),
    "draft dtype": (dict(draft_logits=torch.zeros(B_BAD, G_BAD, V_BAD, dtype=torch.float16)), "must share a dtype"),
    "tokens shape": (dict(draft_tokens=torch.zeros(B_BAD, G_BAD + 1, dtype=torch.int64)), "draft_tokens must be [3, 2]"),
    "counts dtype": (dict(num_drafts=torch.zeros(B_BAD, dtype=torch.int32)), "num_drafts must be torch.int64"),
    "temperature rows": (dict(temperature=torch.zeros(B_BAD + 1)), "temperature must be [3]"),
    "strided seeds": (dict(seeds=torch.zeros(2 * B_BAD, dtype=torch.int64)[::2]), "seeds must be contiguous"),
    "one uniform": (dict(u_accept=torch.rand(B_BAD, G_BAD + 1)), "pass both u_accept and u_sample"),
    "uniform shape": (dict(u_accept=torch.rand(B_BAD, G_BAD), u_sample=torch.rand(B_BAD, G_BAD)),
                      "u_accept must be [3, 3]"),
    "draft lengths alone": (dict(draft_lengths=torch.zeros(B_BAD, dtype=torch.int64)), "draft_lengths needs target"),
    "impl": (dict(impl="cuda"), "impl must be one of"),
}


@pytest.mark.parametrize("case", BAD_VERIFY_ARGUMENTS)
def test_bad_arguments_are_named(case):
    """The host wrapper validates before any kernel runs (kernels never check): a bad argument
    raises a ValueError naming it, where the same call with valid arguments passes."""
    B, G, V = B_BAD, G_BAD, V_BAD
    zeros = torch.zeros(B, dtype=torch.int64)
    valid = dict(target_logits=torch.randn(B, G + 1, V), draft_logits=torch.randn(B, G, V),
                 draft_tokens=torch.zeros(B, G, dtype=torch.int64), num_drafts=torch.full((B,), G),
                 temperature=torch.ones(B), top_k=zeros, top_p=torch.ones(B), min_p=torch.zeros(B), seeds=zeros,
                 positions=zeros, impl="cpp")
    emitted, counts = verify(**valid)
    assert emitted.shape == (B, G + 1) and counts.shape == (B,)
    change, words = BAD_VERIFY_ARGUMENTS[case]
    with pytest.raises(ValueError, match=re.escape("verify: ") + ".*" + re.escape(words)):
        verify(**{**valid, **change})
