"""Layers over matrices kept as a GGUF file stores them (ops.blocks): a linear layer, an embedding,
and a head tied to that embedding.

Each part's bytes are a buffer of the module (so model.to(device) moves them, and a file's
memory map stays their storage on a CPU); the BlockMatrix the ops take is rebuilt from them when
they change. Off the CPU (holds_parts_merged) a module holds each run of consecutive parts of one
weight type as one part (BlockMatrix.merged), merged where the parts arrive there (set_parts, or
a move): the Triton kernels launch once per part, and a GPU holds a copy of the bytes anyway,
whereas a CPU's parts stay views of the file's memory map (the C++ op takes every part in one
call). The products are the model's backend's (ops.product, layers.linear.ProductLayer) and the
embedding's lookup runs the backend's implementation (`impl`): models.backend sets both when it
chooses a backend, so that a forward tests no flags.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops.blocks import BlockMatrix, MatrixPart, WeightType, embedding_rows
from .linear import ProductLayer
from .tracked import TracksParameterAssignments


def holds_parts_merged(device: torch.device) -> bool:
    """Whether a module holds its matrix's parts merged on `device` (see the module docstring)."""
    return device.type != "cpu"


class HoldsBlockMatrix(nn.Module):
    """A module whose matrix is the parts registered as buffers part_0, part_1, ..."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_types: tuple[WeightType, ...] = ()
        self._matrix: BlockMatrix | None = None

    def set_parts(self, parts: list[MatrixPart]):
        """Hold these parts (rows stacked in order): out_features rows of in_features weights,
        merged off the CPU (holds_parts_merged)."""
        matrix = BlockMatrix(tuple(parts))
        if matrix.shape != (self.out_features, self.in_features):
            raise ValueError(f"a {type(self).__name__} of [{self.out_features}, {self.in_features}] got a "
                             f"matrix of {list(matrix.shape)}")
        if holds_parts_merged(matrix.device):
            matrix = matrix.merged()
        for i in range(len(self.weight_types)):
            delattr(self, f"part_{i}")
        for i, part in enumerate(matrix.parts):
            self.register_buffer(f"part_{i}", part.data)
        self.weight_types = matrix.weight_types
        self._matrix = matrix
        TracksParameterAssignments.assignments += 1  # views built from the old parts are stale

    @property
    def matrix(self) -> BlockMatrix:
        if self._matrix is None:
            if not self.weight_types:
                raise RuntimeError(f"{type(self).__name__} holds no matrix yet (set_parts)")
            self._matrix = BlockMatrix(tuple(MatrixPart(t, getattr(self, f"part_{i}"))
                                             for i, t in enumerate(self.weight_types)))
        return self._matrix

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        self._matrix = None  # the buffers may be new tensors (moved)
        types = self.weight_types
        if any(a == b for a, b in zip(types, types[1:])) and holds_parts_merged(self.matrix.device):
            self.set_parts(list(self.matrix.parts))  # moved off the CPU: merged there
        return result

    def extra_repr(self) -> str:
        types = "+".join(t.name for t in self.weight_types) or "empty"
        return f"in_features={self.in_features}, out_features={self.out_features}, stored={types}"


class BlockLinear(ProductLayer, HoldsBlockMatrix):
    """x @ W^T + bias over a matrix as stored."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__(in_features, out_features)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.matrix, self.bias)


class BlockEmbedding(HoldsBlockMatrix):
    """Rows of a matrix as stored, looked up by token id (float32)."""

    impl = "reference"  # ops.blocks.embedding_rows's implementation: the model's backend's

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(embedding_dim, num_embeddings)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding_rows(self.matrix, ids, self.impl)


class TiedBlockHead(ProductLayer, nn.Module):
    """An output head whose matrix is an embedding's (tie_word_embeddings): no bytes of its own."""

    def __init__(self, embedding: BlockEmbedding):
        super().__init__()
        self.in_features, self.out_features = embedding.in_features, embedding.out_features
        self._embedding = [embedding]  # in a list: not registered twice as a submodule

    @property
    def matrix(self) -> BlockMatrix:
        return self._embedding[0].matrix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.matrix, None)
