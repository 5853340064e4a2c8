"""A drafter's per-step sampling, ops.verify.sample_warped (the fused verify kernels with no drafts),
against sample_from_probs(warp_probs(...)): exact given the same uniforms, greedy, statistical,
invariants, hostile vocabulary sizes."""
import pytest
import torch

from specengine.ops.verify import sample_warped
from specengine.sampling.warp import warp_probs

from conftest import portable_cpu_kernels
from stats_util import chi_square_pvalue
from verify_cases import WARPS

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
KERNELS = ["cpp", "cpp-portable", "triton"]


def draw(impl, logits, params, u):
    dev = "cpu" if impl.startswith("cpp") else DEVICE
    with portable_cpu_kernels(impl == "cpp-portable"):
        out = sample_warped(logits.to(dev), *(t.to(dev) for t in params), u.to(dev), impl=impl.removesuffix("-portable"))
    return out.cpu()


def row_params(B, seed):
    """Each row its own warp: greedy, plain, tempered top-k, top-p, min-p, in turn."""
    g = torch.Generator().manual_seed(seed)
    kinds = [dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0), *WARPS.values()]
    rows = [kinds[int(torch.randint(len(kinds), (1,), generator=g))] for _ in range(B)]
    return (torch.tensor([r["temperature"] for r in rows]), torch.tensor([r["top_k"] for r in rows]),
            torch.tensor([r["top_p"] for r in rows]), torch.tensor([r["min_p"] for r in rows]))


def near_boundary(logits, params, u, eps=2e-5) -> torch.Tensor:
    """[B] bool: u lies within float rounding of a step of the row's warped CDF."""
    cdf = warp_probs(logits, *params).double().cumsum(-1)
    return ((cdf - u[:, None].double() * cdf[:, -1:]).abs() <= eps * cdf[:, -1:]).any(-1)


SHAPES = [(1, 1), (5, 111), (1, 8193), (7, 64), (3, 32000), (2, 151936)]
# Triton's interpreter costs milliseconds per program on CPU: its runs there stop at V = 8193.
CASES = [(impl, B, V) for impl in KERNELS for B, V in SHAPES if impl != "triton" or GPU or V <= 8193]


@pytest.mark.parametrize("impl,B,V", CASES)
def test_matches_the_reference_given_the_same_uniforms(impl, B, V):
    g = torch.Generator().manual_seed(V + B)
    logits = torch.randn(B, V, generator=g) * 3
    params = row_params(B, V)
    u = torch.rand(B, generator=g)
    want = sample_warped(logits, *params, u, impl="reference")
    got = draw(impl, logits, params, u)
    differ = got != want
    assert not (differ & ~near_boundary(logits, params, u)).any(), f"rows {differ.nonzero().flatten().tolist()}"


@pytest.mark.parametrize("impl", KERNELS + ["reference"])
def test_greedy_rows_take_the_first_argmax_for_any_uniform(impl):
    logits = torch.tensor([[0.0, 3.0, 3.0, -1.0], [5.0, 1.0, 5.0, 5.0], [-2.0, -3.0, -9.0, -1.0]])
    zeros = torch.zeros(3)
    params = (zeros, zeros.long(), torch.ones(3), zeros)
    for u in (0.0, 0.5, 1 - 2 ** -24):
        assert draw(impl, logits, params, torch.full((3,), u)).tolist() == [1, 0, 3]


@pytest.mark.parametrize("impl", ["cpp", "cpp-portable"])
@pytest.mark.parametrize("warp", list(WARPS))
def test_samples_follow_the_warped_distribution(impl, warp):
    """20000 draws of one row against its warped probabilities (chi-square, p > 1e-3); the same
    draws must reject the distribution at 1.5 times the temperature (the test has power)."""
    N, V = 20000, 12
    g = torch.Generator().manual_seed(7)
    row = torch.randn(V, generator=g) * 2
    w = WARPS[warp]
    params = (torch.full((N,), w["temperature"]), torch.full((N,), w["top_k"]), torch.full((N,), w["top_p"]),
              torch.full((N,), w["min_p"]))
    tokens = draw(impl, row.expand(N, V), params, torch.rand(N, generator=g))
    counts = torch.bincount(tokens, minlength=V)
    assert chi_square_pvalue(counts, warp_probs(row[None], *(t[:1] for t in params))[0]) > 1e-3
    hotter = (params[0][:1] * 1.5, *(t[:1] for t in params[1:]))
    assert chi_square_pvalue(counts, warp_probs(row[None], *hotter)[0]) < 1e-3


@pytest.mark.parametrize("impl", KERNELS)
def test_invariants(impl):
    """Tokens lie in [0, V); a token outside the top-k never appears; u = 0 takes the first token
    with mass."""
    B, V = 9, 50
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B, V, generator=g)
    logits[:, 0] = float("-inf")  # a masked id (a padded draft vocabulary)
    params = (torch.ones(B), torch.full((B,), 3), torch.ones(B), torch.zeros(B))
    tokens = draw(impl, logits, params, torch.rand(B, generator=g))
    top3 = logits.topk(3, dim=-1).indices
    assert ((tokens[:, None] == top3).any(-1)).all()
    first = draw(impl, logits, (torch.ones(B), torch.zeros(B, dtype=torch.int64), torch.ones(B), torch.zeros(B)),
                 torch.zeros(B))
    assert (first == 1).all()


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"need logits \[B, V\] and u \[B\]"):
        sample_warped(torch.zeros(2, 5), torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.ones(2),
                      torch.zeros(2), torch.zeros(3))


def test_cpp_takes_uniform_columns_and_batches_past_its_shared_zeros():
    """Drafters pass u as a column of their [B, G] uniforms (not contiguous); the C++ path shares
    one read-only tensor of zeros for the kernel's unused inputs, grown for large batches."""
    from specengine.ops import verify as verify_module

    B, V = 70, 37
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(B, V, generator=g) * 2
    params = row_params(B, 5)
    uniforms = torch.rand(B, 3, generator=g)
    want = sample_warped(logits, *params, uniforms[:, 1].contiguous(), impl="reference")
    got = sample_warped(logits, *params, uniforms[:, 1], impl="cpp")
    assert not ((got != want) & ~near_boundary(logits, params, uniforms[:, 1])).any()
    assert verify_module._HOST_ZEROS.numel() >= B and not verify_module._HOST_ZEROS.any()
    with pytest.raises(ValueError, match="contiguous in the vocabulary dimension"):
        sample_warped(logits.t().contiguous().t(), *params, uniforms[:, 1], impl="cpp")
