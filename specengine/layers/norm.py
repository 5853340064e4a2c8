import torch
from torch import nn

from .. import ops
from ..ops.norm import add_rms_norm, rms_norm
from .tracked import TracksParameterAssignments


class RMSNorm(TracksParameterAssignments):
    """Llama RMSNorm's weight and eps, applied by ops.norm with the implementation the caller's
    backend runs (impl: "cpp", "triton" or "reference", see models.backend)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, impl: str = "reference") -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, impl, check=ops.CHECK_MODEL_CALLS)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                     impl: str = "reference") -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm): the residual add before a norm (see ops.norm.add_rms_norm)."""
        return add_rms_norm(x, delta, self.weight, self.eps, impl, check=ops.CHECK_MODEL_CALLS)
