"""SiLU-and-multiply of a packed [gate, up] projection (the Llama MLP's activation): silu(gate) * up.

  "triton"     specengine.kernels.activation: one launch (the path on CUDA)
  "reference"  F.silu(gate) * up (the oracle). "cpp" takes it too: on a CPU the two torch ops
               cost little next to the MLP's products, and specengine._C has no op of its own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IMPLEMENTATIONS = ("cpp", "triton", "reference")


def silu_mul(
    gate_up: torch.Tensor,  # [..., 2 * I]: gate then up
    impl: str = "reference",
    check: bool = True,
) -> torch.Tensor:
    """silu(gate) * up, [..., I] in gate_up's dtype."""
    if check:
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"silu_mul: impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
        if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
            raise ValueError(f"silu_mul: gate_up must be [..., 2 * I], got {tuple(gate_up.shape)}")
        gate_up = gate_up.contiguous() if impl == "triton" else gate_up
    if impl == "triton":
        from ..kernels.activation import silu_mul_triton

        return silu_mul_triton(gate_up)
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up
