import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in float32, round to the input dtype, then scale (as transformers)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm computes in float32 for low-precision inputs and is one op instead of six;
        # the weight is applied after rounding, as transformers does.
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
