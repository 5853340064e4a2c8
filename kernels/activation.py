"""SiLU-and-multiply of the packed gate/up projection, in Triton: one launch per MLP.

out = silu(gate) * up with the torch path's roundings: silu computed in float32 and rounded to
the input dtype (as F.silu), then the product rounded. Oracle: F.silu(gate) * up.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit(do_not_specialize=["inter"])
def _silu_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * 2 * inter + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inter + inter + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * inter + offs, (silu * up).to(dtype), mask=mask)


def silu_mul_triton(
    gate_up: torch.Tensor,  # [..., 2 * I] contiguous: gate then up
) -> torch.Tensor:
    """silu(gate) * up, [..., I] in gate_up's dtype."""
    inter = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    rows = gate_up.numel() // (2 * inter) if inter else 0
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(inter, BLOCK))](gate_up, out, inter, BLOCK=BLOCK)
    return out
