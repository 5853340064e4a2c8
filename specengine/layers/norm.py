import torch
from torch import nn

from ..ops.norm import rms_norm_cpp, rms_norm_reference
from .tracked import TracksParameterAssignments


class RMSNorm(TracksParameterAssignments):
    """Llama RMSNorm (see ops.norm). cpu_kernels: the caller allows the C++ op, which is taken for
    float32 on a CPU (the model decides once per forward, see LlamaForCausalLM.cpu_kernels)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, cpu_kernels: bool = False) -> torch.Tensor:
        if cpu_kernels and self.weight.dtype == torch.float32:
            return rms_norm_cpp(x, self.weight, self.eps)
        return rms_norm_reference(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor | None, cpu_kernels: bool = False,
                     triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm): the residual add before a norm (no add without a delta). The
        Triton kernel does both in one launch and updates x in place; the others return a new x,
        so that a forward with gradients keeps the tensors it saved."""
        if triton:
            from ..kernels.norm import add_rms_norm_triton

            return x, add_rms_norm_triton(x, self.weight, self.eps, delta)
        if delta is not None:
            x = x + delta
        return x, self(x, cpu_kernels)
