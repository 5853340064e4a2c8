"""Dense linear layers. Their products, like those of layers.blocks' stored matrices, are the
model's backend's (ops.product): on a CPU in float32 specengine's C++ ops, each row's result
computed on its own (the same bits whatever rows share the call, so that prompts and rows may be
batched freely; oneDNN's and MKL's blocking follows the shape, so a row's bits would follow the
rows beside it)."""
import torch
from torch import nn

from ..ops.product import product_reference
from .tracked import TracksParameterAssignments


class ProductLayer:
    """A layer whose forward is a matrix product, run by `product`: the product of its model's
    backend (ops.product), which models.backend sets when it chooses one; torch's until then."""

    product = staticmethod(product_reference)


class Linear(ProductLayer, TracksParameterAssignments, nn.Linear):
    """nn.Linear on the model's backend's product. Same weights, same state-dict names; results
    agree to float rounding. Weights stored in bfloat16 with float32 inputs (how the loader keeps a
    bfloat16 checkpoint on a CPU) are widened to float32 by the product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """A Linear whose input features are split over tensor-parallel ranks (o_proj, down_proj): each
    rank's partial product is summed by one all-reduce, and the bias (whole on every rank) added
    once after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce_(self.product(x, self.weight, None))
        return out if self.bias is None else out.add_(self.bias)
