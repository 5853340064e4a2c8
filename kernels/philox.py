"""Philox uniforms in Triton: the counter-based random numbers of specengine/sampling/rng.py.

_philox_uniform is the device function the fused verify kernel draws with; uniforms_triton
fills a [B, K] block of them in one launch (the torch reference spends about 150 small kernels
on the same numbers: a launch each on a GPU, a round's worth of host time in eager decoding).
Host side: specengine.sampling.rng.uniforms dispatches here for CUDA tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# As specengine/sampling/rng.py. A jitted function may read a global only if it is a
# tl.constexpr (the interpreter does not enforce this; the compiler does).
_STREAM_ACCEPT = tl.constexpr(0)
_STREAM_SAMPLE = tl.constexpr(1)


@triton.jit
def _philox_uniform(seed, position, stream: tl.constexpr):
    """Uniform in [0, 1) keyed by (seed, position, stream): Philox4x32-10, top 24 bits of word 0."""
    c0 = (position & 0xFFFFFFFF).to(tl.uint64)
    c1 = ((position >> 32) & 0xFFFFFFFF).to(tl.uint64)
    c2 = (0 * position + stream).to(tl.uint64)
    c3 = (0 * position).to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint64)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint64)
    for r in tl.static_range(10):
        if r > 0:
            k0 = (k0 + 0x9E3779B9) & 0xFFFFFFFF
            k1 = (k1 + 0xBB67AE85) & 0xFFFFFFFF
        prod0 = c0 * 0xD2511F53
        prod1 = c2 * 0xCD9E8D57
        c0_new = ((prod1 >> 32) ^ c1 ^ k0) & 0xFFFFFFFF
        c2_new = ((prod0 >> 32) ^ c3 ^ k1) & 0xFFFFFFFF
        c1 = prod1 & 0xFFFFFFFF
        c3 = prod0 & 0xFFFFFFFF
        c0 = c0_new
        c2 = c2_new
    return (c0 >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit(do_not_specialize=["K"])
def _uniforms_kernel(seeds_ptr, positions_ptr, out_ptr, K, stream: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    seed = tl.load(seeds_ptr + b)
    positions = tl.load(positions_ptr + b * K + offs, mask=mask, other=0)
    tl.store(out_ptr + b * K + offs, _philox_uniform(seed, positions, stream), mask=mask)


def uniforms_triton(
    seeds: torch.Tensor,      # [B] int64, contiguous
    positions: torch.Tensor,  # [B, K] int64, contiguous
    stream: int,
) -> torch.Tensor:
    """Uniforms [B, K] float32 in [0, 1); the caller (rng.uniforms) has validated the arguments."""
    B, K = positions.shape
    out = torch.empty(B, K, dtype=torch.float32, device=positions.device)
    if B and K:
        _uniforms_kernel[(B,)](seeds, positions, out, K, stream=stream, BLOCK=max(16, triton.next_power_of_2(K)))
    return out
