"""Matrix products with bfloat16-stored weights and float32 activations, for CPU decoding.

A decode step streams every weight once; on a CPU that is most of its time. A bfloat16
checkpoint kept in bfloat16 is half the bytes of an upcast float32 copy, and widening
bfloat16 to float32 is exact, so the products equal float32 ones up to summation order.

  "cpp"        specengine._C.linear_bf16_weight: csrc/blocks.cpp's linear_blocks on the matrix as
               one BF16 part (AVX-512 or AVX2/FMA where the CPU has it, else a plain C++ loop;
               OpenMP over columns): few rows, bound by the weight stream
  "amx"        specengine._C.gemm_bf16_weight_amx: AMX tiles on x split into three bfloat16
               terms, float32-accurate, for prompt-sized products (CPUs with AMX only)
  "reference"  F.linear on the weight upcast to float32 (the oracle)
  "auto"       cpp

The models' products choose between the C++ ops by tokens per row (ops.product).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IMPLEMENTATIONS = ("auto", "cpp", "amx", "reference")


def _check(cond: bool, message: str):
    if not cond:
        raise ValueError(f"linear_bf16_weight: {message}")


def linear_bf16_weight(
    x: torch.Tensor,                   # [..., K] float32, CPU
    weight: torch.Tensor,              # [N, K] bfloat16, CPU, contiguous
    bias: torch.Tensor | None = None,  # [N] float32, or None
    impl: str = "auto",
) -> torch.Tensor:
    """x @ weight^T + bias as float32 [..., N], weights widened to float32 on the fly."""
    _check(impl in IMPLEMENTATIONS, f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    _check(weight.dim() == 2, f"weight must be [N, K], got {tuple(weight.shape)}")
    N, K = weight.shape
    _check(K >= 1, "weight has no input features")
    _check(x.dim() >= 1 and x.shape[-1] == K, f"x must be [..., {K}], got {tuple(x.shape)}")
    _check(x.dtype == torch.float32, f"x must be float32, got {x.dtype}")
    _check(weight.dtype == torch.bfloat16, f"weight must be bfloat16, got {weight.dtype}")
    _check(x.device.type == "cpu" and weight.device.type == "cpu", "x and weight must be CPU tensors")
    _check(weight.is_contiguous(), "weight must be contiguous")
    if bias is not None:
        _check(tuple(bias.shape) == (N,), f"bias must be [{N}], got {tuple(bias.shape)}")
        _check(bias.dtype == torch.float32 and bias.device.type == "cpu", "bias must be a float32 CPU tensor")
        bias = bias.contiguous()
    if impl == "reference":
        return F.linear(x, weight.float(), bias)
    if impl == "amx":
        _check(amx_available(), "impl 'amx' needs a CPU with AMX bfloat16 tiles (and an instruction-set limit "
                                "that allows them); this one has " + _cpu_isa())
        return gemm_bf16_weight_amx_cpp(x, weight, bias)
    return linear_bf16_weight_cpp(x, weight, bias)


def _cpu_isa() -> str:
    from .. import _C

    return _C.cpu_isa()


def amx_available() -> bool:
    """Whether gemm_bf16_weight_amx_cpp runs here (asked each call: tests lower the limit)."""
    return _cpu_isa() == "amx"


def gemm_bf16_weight_amx_cpp(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The AMX op without argument checks, for model layers (see linear_bf16_weight_cpp); only
    where amx_available(). Same contract as linear_bf16_weight."""
    from .. import _C

    return _call_cpp(_C.gemm_bf16_weight_amx, x, weight, bias)


def linear_bf16_weight_cpp(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The C++ op without argument checks, for model layers whose weights the loader already
    checked (the checks cost more than the product of a small layer). Same contract as above."""
    from .. import _C

    return _call_cpp(_C.linear_bf16_weight, x, weight, bias)


def _call_cpp(op, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """op(x, weight, bias, out, R, K, N) on raw pointers, out allocated here."""
    # Every torch call costs microseconds here, as much as a small layer's product: no views.
    if not x.is_contiguous():
        x = x.contiguous()
    K, N = x.shape[-1], weight.shape[0]
    out = torch.empty((*x.shape[:-1], N), dtype=torch.float32)
    op(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(), x.numel() // K, K, N)
    return out
