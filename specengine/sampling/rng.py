"""Counter-based random numbers: Philox4x32-10 keyed by (seed, position, stream).

Every uniform a request consumes is a pure function of its seed, the absolute position
of the token being decided and a stream id, so results do not depend on the batch a
request runs in nor on launch order, and a Triton or C++ kernel can draw the very same
numbers. Each position is decided exactly once, so no uniform is ever reused.
"""
from __future__ import annotations

import torch

# Stream ids: which random decision at a position a uniform feeds.
STREAM_ACCEPT = 0  # the accept/reject test of a draft token
STREAM_SAMPLE = 1  # sampling from the target (residual, bonus or target-only decoding)
STREAM_DRAFT = 2   # sampling the draft token from q

_MASK32 = 0xFFFFFFFF
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


def _mulhilo32(a: int, b: torch.Tensor):
    """(hi, lo) 32-bit words of a * b for a constant a < 2**32 and b [..] in [0, 2**32) (int64).

    Splits a into 16-bit halves so no intermediate exceeds 2**49 (int64 never overflows).
    """
    a_hi, a_lo = a >> 16, a & 0xFFFF
    lo_part = a_lo * b  # < 2**48
    hi_part = a_hi * b  # < 2**48
    lo = (((hi_part & 0xFFFF) << 16) + lo_part) & _MASK32
    hi = (hi_part + (lo_part >> 16)) >> 16
    return hi, lo


def philox4x32(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor], rounds: int = 10):
    """Philox4x32 (Salmon et al., SC'11) on int64 tensors holding 32-bit words; returns 4 words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0 = (k0 + _PHILOX_W0) & _MASK32
            k1 = (k1 + _PHILOX_W1) & _MASK32
        hi0, lo0 = _mulhilo32(_PHILOX_M0, c0)
        hi1, lo1 = _mulhilo32(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniforms [B, K] float32 in [0, 1) on a 2**-24 grid, keyed by (seeds[b], positions[b, k], stream).

    seeds [B] int64 (>= 0); positions [B, K] int64 (>= 0), absolute token positions.
    CPU tensors take the C++ op, CUDA tensors the Triton kernel (one launch instead of the
    reference's ~150), others the torch reference (same numbers).
    """
    if seeds.device.type == "cpu":
        from .. import _C

        out = _C.philox_uniforms(seeds.contiguous().numpy(), positions.contiguous().numpy(), stream)
        return torch.from_numpy(out)
    if seeds.device.type == "cuda" and positions.dim() == 2:
        from ..kernels.philox import uniforms_triton

        return uniforms_triton(seeds.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous(), stream)
    return uniforms_reference(seeds, positions, stream)


def uniforms_reference(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """The torch reference of uniforms(): the oracle of the C++ and GPU implementations."""
    seeds = seeds.to(torch.int64).view(-1, *([1] * (positions.dim() - 1))).expand_as(positions)
    positions = positions.to(torch.int64)
    zero = torch.zeros_like(positions)
    word0, _, _, _ = philox4x32(
        (positions & _MASK32, positions >> 32, zero + stream, zero),
        (seeds & _MASK32, seeds >> 32),
    )
    # The top 24 bits: exactly representable in float32, and strictly below 1.
    return (word0 >> 8).to(torch.float32) * (1.0 / (1 << 24))
