"""RMSNorm fused with the residual add, in Triton: one launch per norm of a decoder step.

With a delta, the residual stream x becomes x + delta in place (rounded to x's dtype, as the
torch sum is) and the norm reads that sum; without, it only normalises. Numerics as
transformers': normalise in float32, round to the input dtype, then multiply by the weight.
Oracle: specengine.ops.norm.rms_norm_reference (after x + delta). Host side: specengine.ops.norm
validates and dispatches (impl "triton"), for the model and the tests alike.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["N", "eps"])
def _add_rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, out_ptr, N, eps, HAS_DELTA: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)).to(
            x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * N + offs, x, mask=mask)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * N + offs, (weight.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def add_rms_norm_triton(
    x: torch.Tensor,             # [..., N] contiguous, the residual stream (updated in place with a delta)
    weight: torch.Tensor,        # [N]
    eps: float,
    delta: torch.Tensor | None,  # [..., N] contiguous, same dtype as x, or None
) -> torch.Tensor:
    """weight * rmsnorm(x (+= delta)), [..., N] in the dtype of weight * x (torch's promotion)."""
    N = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    rows = x.numel() // N
    if rows:
        _add_rms_norm_kernel[(rows,)](x, delta if delta is not None else x, weight, out, N, eps,
                                      HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(N))
    return out
