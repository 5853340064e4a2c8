"""Llama RMSNorm: normalise in float32, round to the input dtype, then scale (as transformers).

  "cpp"        specengine._C.rms_norm, float32 rows on a CPU: one call instead of a composite
               op whose dispatch, not its arithmetic, dominates at the shipped models' widths
               (measured: see bench/results/kernel-tuning-2026-11-29-to-12-03.md)
  "triton"     specengine.kernels.norm, fused with the residual add (add_rms_norm; the path on CUDA)
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
    check: bool = True,
) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension, [..., N] in x's dtype."""
    if check:
        x, weight = _checked("rms_norm", x, None, weight, impl)
    if impl == "cpp":
        return rms_norm_cpp(x, weight, eps)
    if impl == "triton":
        from ..kernels.norm import add_rms_norm_triton

        return add_rms_norm_triton(x, weight, eps, None)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor,             # [..., N] the residual stream
    delta: torch.Tensor | None,  # [..., N] added to it first, or None (no add)
    weight: torch.Tensor,        # [N]
    eps: float,
    impl: str = "reference",
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): the residual add before a norm. "triton" does both in one
    launch and updates x in place (x must be contiguous); the others return a new x, so that a
    forward with gradients keeps the tensors it saved."""
    if check:
        x, weight = _checked("add_rms_norm", x, delta, weight, impl)
    if impl == "triton":
        from ..kernels.norm import add_rms_norm_triton

        return x, add_rms_norm_triton(x, weight, eps, delta)
    if delta is not None:
        x = x + delta
    return x, rms_norm_cpp(x, weight, eps) if impl == "cpp" else rms_norm_reference(x, weight, eps)


def _checked(op: str, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
             impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, weight) in the layout impl needs, or a ValueError naming the problem."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"{op}: impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    if weight.dim() != 1 or x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"{op}: x must be [..., {weight.shape[0]}] for weight [N], got x {tuple(x.shape)} "
                         f"and weight {tuple(weight.shape)}")
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype or delta.device != x.device):
        raise ValueError(f"{op}: delta must be {tuple(x.shape)} {x.dtype} on {x.device}, got {tuple(delta.shape)} "
                         f"{delta.dtype} on {delta.device}")
    if impl == "reference":
        return x, weight
    if impl == "triton":
        if delta is not None and not (x.is_contiguous() and delta.is_contiguous()):
            raise ValueError(f"{op}: impl 'triton' adds delta into x in place: both must be contiguous")
        return x.contiguous(), weight.contiguous()
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{op}: impl 'cpp' needs float32 CPU tensors, got {name} {t.dtype} on {t.device}")
    return x, weight.contiguous()


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # F.rms_norm computes in float32 for low-precision inputs; the weight is applied after rounding.
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def rms_norm_cpp(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The C++ op (float32 CPU x, contiguous float32 weight; x made contiguous here)."""
    from .. import _C

    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty_like(x)
    N = x.shape[-1]
    _C.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // N, N, eps)
    return out
