import torch
import torch.nn.functional as F
from torch import nn

from ..ops.linear import linear_bf16_weight_cpp
from .tracked import TracksParameterAssignments


# From this many rows (a prefill) a bfloat16 weight is widened to float32 for one GEMM: on a
# 2-core AVX-512 CPU the C++ few-row op held ~100 GFLOP/s at any row count, while widening and
# oneDNN's sgemm reached 108-160 at 32 rows, 300-330 at 200 and ~400 at 800 (SmolLM2's
# 576 -> 1536, 576 -> 3072 and 1536 -> 576 products); below 32 rows the C++ op was faster.
GEMM_ROWS = 32


class Linear(TracksParameterAssignments, nn.Linear):
    """nn.Linear with two CPU fast paths for the few-row products of decoding.

    - bfloat16 weights with float32 inputs (how the loader keeps a bfloat16 checkpoint on a
      CPU): the C++ op widens the weights on the fly, reading half the bytes of a float32 copy;
      from GEMM_ROWS rows on, a GEMM on the widened weights.
    - float32 weights, 2..32 rows (a verification of gamma + 1 tokens, a small batch):
      oneDNN/MKL's x @ W^T was measured 2-4x slower than W @ x^T on an AVX2 CPU (e.g.
      512 -> 8192 at 5 rows: 7.4 ms vs 2.0 ms), which made verifying k tokens cost k times
      one token.
    Same weights, same state-dict names; results agree to float rounding.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // x.shape[-1]
        if self.weight.dtype == torch.bfloat16 and x.dtype == torch.float32:
            if rows >= GEMM_ROWS:
                return F.linear(x, self.weight.float(), self.bias)
            return linear_bf16_weight_cpp(x, self.weight, self.bias)
        if not 1 < rows <= 32:
            return F.linear(x, self.weight, self.bias)
        out = (self.weight @ x.reshape(rows, -1).t()).t().contiguous()
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], -1)
