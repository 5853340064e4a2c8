import torch
import torch.nn.functional as F
from torch import nn

from ..ops.blocks_cpp import gemm_blocks_cpp, linear_blocks_cpp
from ..ops.linear import GEMM_ROWS, amx_available, gemm_bf16_weight_amx_cpp, linear_bf16_weight_cpp
from .tracked import TracksParameterAssignments


def blocked_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 @ weight [N, K]^T + bias as float32, on CPUs without AMX: the prompt-sized
    C++ op (ops.blocks_cpp.gemm_blocks_cpp), which widens the weights 32 rows at a time."""
    return gemm_blocks_cpp(x, weight if weight.is_contiguous() else weight.contiguous(), bias)


class Linear(TracksParameterAssignments, nn.Linear):
    """nn.Linear whose CPU products are specengine's C++ ops, each row's result computed on its own
    (the same bits whatever rows share the call, so that prompts and rows may be batched freely):

    - bfloat16 weights with float32 inputs (how the loader keeps a bfloat16 checkpoint on a
      CPU): the C++ op widens the weights on the fly, reading half the bytes of a float32 copy;
      with GEMM_ROWS or more tokens per row ([B, T, K] inputs), the AMX op where the CPU has AMX,
      else float32 GEMM tiles on weights widened a panel at a time (blocked_gemm).
    - float32 weights: the block ops' float32 matrices (ops.blocks_cpp.linear_blocks_cpp): the
      few-row product under GEMM_ROWS tokens per row, the blocked GEMM from there on. (oneDNN and
      MKL pick their blocking by shape, so a row's bits followed the rows beside it.)
    A product that records gradients (training) runs torch's. Same weights, same state-dict
    names; results agree to float rounding.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_product(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """A Linear whose input features are split over tensor-parallel ranks (o_proj, down_proj): each
    rank's partial product is summed by one all-reduce, and the bias (whole on every rank) added
    once after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce_(linear_product(x, self.weight, None))
        return out if self.bias is None else out.add_(self.bias)


def linear_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T + bias, on the CPU paths Linear describes."""
    if (x.device.type != "cpu" or x.dtype != torch.float32
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    if weight.dtype == torch.bfloat16:
        if x.dim() >= 3 and x.shape[-2] >= GEMM_ROWS:
            return gemm_bf16_weight_amx_cpp(x, weight, bias) if amx_available() else blocked_gemm(x, weight, bias)
        return linear_bf16_weight_cpp(x, weight, bias)
    if weight.dtype != torch.float32:
        return F.linear(x, weight, bias)
    return linear_blocks_cpp(x, weight if weight.is_contiguous() else weight.contiguous(), bias)
