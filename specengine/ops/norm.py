"""Llama RMSNorm: normalise in float32, round to the input dtype, then scale (as transformers).

  "cpp"        specengine._C.rms_norm, float32 rows on a CPU: one call instead of a composite
               op measured at 40-70 us per norm on a 2-core CPU (17 norms per step of the
               shipped target)
  "triton"     specengine.kernels.norm, fused with the residual add (the model's path on CUDA)
  "reference"  weight * F.rms_norm(x) (the oracle, and every other device and dtype)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IMPLEMENTATIONS = ("cpp", "triton", "reference")


def rms_norm(
    x: torch.Tensor,       # [..., N]
    weight: torch.Tensor,  # [N]
    eps: float,
    impl: str = "reference",
) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension, [..., N] in x's dtype."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"rms_norm: impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    if weight.dim() != 1 or x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: x must be [..., {weight.shape[0]}] for weight [N], got x {tuple(x.shape)} "
                         f"and weight {tuple(weight.shape)}")
    if impl == "reference":
        return rms_norm_reference(x, weight, eps)
    if impl == "triton":
        from ..kernels.norm import add_rms_norm_triton

        return add_rms_norm_triton(x.contiguous(), weight.contiguous(), eps, None)
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"rms_norm: impl 'cpp' needs float32 CPU tensors, got {name} {t.dtype} on {t.device}")
    return rms_norm_cpp(x, weight.contiguous(), eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # F.rms_norm computes in float32 for low-precision inputs; the weight is applied after rounding.
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def rms_norm_cpp(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The C++ op without argument checks, for model layers (float32 CPU x, contiguous float32 weight)."""
    from .. import _C

    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty_like(x)
    N = x.shape[-1]
    _C.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // N, N, eps)
    return out
