"""The "cpp" implementation of ops.blocks: specengine._C's block-format ops (csrc/blocks.cpp), CPU.

  few_row_blocks_cpp  decoding and verification (few tokens per row): reads each weight block once
                      for all rows
  gemm_blocks_cpp     prompt-sized products (csrc/gemm_blocks.cpp): the matrix's rows dequantized
                      32 at a time into a float32 panel, and float32 FMA tiles over it; each
                      output's bits depend only on its row of x and its weight row (batch
                      invariance). A dense tensor is a matrix of one part.
  linear_blocks_cpp   ops.blocks.linear_blocks's "cpp": the models' C++ product (ops.product.product_cpp),
                      which chooses between the two by tokens per row
  embedding_rows_cpp  rows dequantized by the C++ op

No argument checks here: ops.blocks' entry points check (the model's calls skip them; the loader
checked the matrices).
"""
from __future__ import annotations

import weakref

import torch

from ..kernels.weight_types import BY_NAME

# id(matrix) -> (weakref to it, its descriptor, out_features), for BlockMatrix objects (frozen:
# their parts' tensors are theirs for life). The weak reference both drops the entry when the
# matrix dies and tells a matrix from a later object given the same id. Building a descriptor
# is a noticeable share of a small product's time, a lookup is not (measured: see
# bench/results/host-overheads-2026-11-29-to-12-03.md). Dense tensors, cheaper to describe, are
# described afresh each call: a tensor's data can be re-pointed
# (param.data = ...), a BlockMatrix's cannot.
_described: dict[int, tuple[weakref.ref, tuple[int, ...], int]] = {}
_DENSE_TYPES = {dtype: BY_NAME[name].type_id  # ggml type ids
                for dtype, name in ((torch.float32, "F32"), (torch.float16, "F16"), (torch.bfloat16, "BF16"))}


def _forget(key: int):
    def drop(_ref):
        _described.pop(key, None)

    return drop


def _descriptor(matrix) -> tuple[tuple[int, ...], int]:
    """(matrix_descriptor(matrix), out_features), cached per matrix object."""
    if isinstance(matrix, torch.Tensor):  # dense [N, K], contiguous: one part of its float type (as from_dense)
        return (matrix.shape[1], 1, _DENSE_TYPES[matrix.dtype], matrix.data_ptr(), matrix.shape[0]), matrix.shape[0]
    key = id(matrix)
    entry = _described.get(key)
    if entry is not None and entry[0]() is matrix:
        return entry[1], entry[2]
    descriptor = (matrix.in_features, len(matrix.parts))
    for part in matrix.parts:
        descriptor += (int(part.weight_type), part.data.data_ptr(), part.rows)
    out_features = sum(descriptor[4::3])
    _described[key] = (weakref.ref(matrix, _forget(key)), descriptor, out_features)
    return descriptor, out_features


def matrix_descriptor(matrix) -> tuple[int, ...]:
    """A BlockMatrix (or a contiguous float32, float16 or bfloat16 CPU tensor [N, K]) as
    specengine._C takes it: (in_features, part_count, type0, data0, rows0, type1, ...), ggml type
    ids and raw pointers. Valid while the matrix lives."""
    return _descriptor(matrix)[0]


def linear_blocks_cpp(x: torch.Tensor, matrix, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 @ dequantized(matrix)^T + bias -> float32 [..., N] (see ops.blocks.linear_blocks),
    by the models' C++ product (ops.product.product_cpp)."""
    from .product import product_cpp

    return product_cpp(x, matrix, bias)


def few_row_blocks_cpp(x: torch.Tensor, matrix, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 @ dequantized(matrix)^T + bias -> float32 [..., N] by the few-row op, at
    any row count; matrix a BlockMatrix or a contiguous float32/float16/bfloat16 tensor [N, K]."""
    return _call(x, matrix, bias, gemm=False)


def gemm_blocks_cpp(x: torch.Tensor, matrix, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 @ dequantized(matrix)^T + bias -> float32 [..., N] by the prompt-sized op,
    at any row count; matrix a BlockMatrix or a contiguous float32/float16/bfloat16 tensor [N, K]."""
    return _call(x, matrix, bias, gemm=True)


def _call(x: torch.Tensor, matrix, bias: torch.Tensor | None, gemm: bool) -> torch.Tensor:
    from .. import _C

    descriptor, N = _descriptor(matrix)
    if not x.is_cpu:
        raise ValueError(f"linear_blocks: impl 'cpp' takes CPU tensors, got x on {x.device}")
    if not x.is_contiguous():
        x = x.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    K = descriptor[0]
    out = torch.empty((*x.shape[:-1], N), dtype=torch.float32)
    R = x.numel() // K if K else out.numel() // max(N, 1)
    bias_address = 0 if bias is None else bias.data_ptr()
    if gemm:
        _C.gemm_blocks(x.data_ptr(), descriptor, bias_address, out.data_ptr(), R, N)
    else:
        _C.linear_blocks(x.data_ptr(), descriptor, bias_address, out.data_ptr(), R)
    return out


def dequantize_rows_cpp(matrix, row_begin: int = 0, row_end: int | None = None) -> torch.Tensor:
    """The exact float32 weights of rows [row_begin, row_end) (all by default): [rows, K]."""
    from .. import _C

    descriptor, N = _descriptor(matrix)
    row_end = N if row_end is None else row_end
    out = torch.empty((max(row_end - row_begin, 0), descriptor[0]), dtype=torch.float32)
    _C.dequantize_rows(descriptor, row_begin, row_end, out.data_ptr())
    return out


def embedding_rows_cpp(matrix, ids: torch.Tensor) -> torch.Tensor:
    """The dequantized rows of ids [...] int64 -> float32 [..., K] (see ops.blocks.embedding_rows)."""
    from .. import _C

    descriptor, _ = _descriptor(matrix)
    if not ids.is_cpu:
        raise ValueError(f"embedding_rows: impl 'cpp' takes CPU tensors, got ids on {ids.device}")
    flat = ids.reshape(-1)
    if flat.dtype != torch.int64 or not flat.is_contiguous():
        flat = flat.to(torch.int64).contiguous()
    out = torch.empty((*ids.shape, descriptor[0]), dtype=torch.float32)
    _C.gather_rows(descriptor, flat.data_ptr(), flat.numel(), out.data_ptr())
    return out
