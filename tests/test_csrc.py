"""The C++ CPU ops (specengine._C) against their Python/torch references."""
import numpy as np
import pytest
import torch

from specengine import _C
from specengine.sampling.rng import philox4x32, uniforms, uniforms_reference


def words(*values):
    return tuple(torch.tensor([v], dtype=torch.int64) for v in values)


@pytest.mark.parametrize("counter, key, expected", [
    # Known-answer vectors of Philox4x32-10 from the Random123 distribution (kat_vectors).
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_reference_known_answers(counter, key, expected):
    out = philox4x32(words(*counter), words(*key))
    assert tuple(int(w) for w in out) == expected


def test_cpp_uniforms_equal_reference_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    seeds = torch.cat([torch.tensor([0, 2**63 - 1, 2**32, 2**32 - 1]), torch.randint(0, 2**62, (12,), generator=g)])
    positions = torch.randint(0, 2**40, (16, 9), generator=g)
    positions[0] = torch.arange(9)
    for stream in (0, 1, 2):
        got, want = uniforms(seeds, positions, stream), uniforms_reference(seeds, positions, stream)
        assert got.dtype == torch.float32 and torch.equal(got, want)
    assert ((want >= 0) & (want < 1)).all()


@pytest.mark.parametrize("K", [1, 9, 40])
def test_triton_uniforms_equal_reference_bit_for_bit(K):
    """The Triton kernel (in the interpreter on CPU; rng.uniforms takes it for CUDA tensors)."""
    from specengine.kernels.philox import uniforms_triton

    g = torch.Generator().manual_seed(K)
    seeds = torch.cat([torch.tensor([0, 2**63 - 1, 2**32, 2**32 - 1]), torch.randint(0, 2**62, (3,), generator=g)])
    positions = torch.randint(0, 2**40, (7, K), generator=g)
    positions[0] = torch.arange(K)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for stream in (0, 1, 2):
        got = uniforms_triton(seeds.to(device), positions.to(device), stream).cpu()
        assert got.dtype == torch.float32 and torch.equal(got, uniforms_reference(seeds, positions, stream))


def test_uniforms_are_uniform_and_streams_differ():
    seeds = torch.arange(64)
    positions = torch.arange(1000).expand(64, 1000).contiguous()
    u0, u1 = uniforms(seeds, positions, 0), uniforms(seeds, positions, 1)
    assert not torch.equal(u0, u1)
    counts = torch.histc(u0, bins=10, min=0, max=1)
    expected = u0.numel() / 10
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 27.9  # chi-square, 9 degrees of freedom, p = 0.001
    assert abs(torch.corrcoef(torch.stack([u0.flatten(), u1.flatten()]))[0, 1]) < 0.02


# The oracle of specengine._C.ngram_propose.
def ngram_propose_reference(tokens: list[int], min_n: int, max_n: int, max_drafts: int) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the longest re-occurring suffix."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + max_drafts]
    return []


@pytest.mark.parametrize("seed", range(20))
def test_ngram_propose_matches_reference(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 4 if seed % 2 else 20, size=rng.integers(1, 60)).tolist()
    for min_n, max_n, k in [(1, 1, 3), (1, 3, 5), (2, 4, 8), (3, 3, 0)]:
        got = _C.ngram_propose(np.asarray(tokens, dtype=np.int64), min_n, max_n, k).tolist()
        assert got == ngram_propose_reference(tokens, min_n, max_n, k)


def test_ngram_propose_exact_cases():
    seq = np.array([7, 1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3])
    # Longest suffix [1, 2, 3] recurs most recently at index 5, followed by 4, 5, 1, ...
    assert _C.ngram_propose(seq, 1, 3, 2).tolist() == [4, 5]
    assert _C.ngram_propose(seq, 1, 3, 10).tolist() == [4, 5, 1, 2, 3]
    assert _C.ngram_propose(np.array([1, 2, 3]), 1, 2, 4).tolist() == []
    assert _C.ngram_propose(np.array([5]), 1, 2, 4).tolist() == []
    with pytest.raises(ValueError, match="min_n"):
        _C.ngram_propose(seq, 0, 2, 4)
