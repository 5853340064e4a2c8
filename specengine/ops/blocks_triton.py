"""Host side of specengine.kernels.blocks: products and row lookups of a BlockMatrix, computed from
its parts' bytes on the GPU (in Triton's interpreter on CPU tensors). specengine.ops.blocks
validates (linear_blocks, embedding_rows); these allocate and launch, one launch per part (its
weight type a constexpr) into the part's range of output columns. On a GPU a matrix's consecutive
parts of one type are one part (layers.blocks merges them when it holds them there), so a packed
q/k/v or gate/up of one type is one launch. Each part's split of K is the whole matrix's, so a
row's bits do not depend on how the matrix is cut into parts, and with K split the parts write
their partial sums into one buffer that one combine adds up. (Parts of different types, Q4_K_M's
q/k in Q4_K and v in Q6_K, stay a launch each: the type is a constexpr of the kernel.) Nothing
reads the device: every grid and buffer depends only on the shapes, so a graph-captured step can
replay them.
"""
from __future__ import annotations

import torch

from ..kernels import blocks as kernels
from .blocks import BlockMatrix, MatrixPart, WeightType
from .product import product_gemm_sized

# How each float type's bytes are handed to the kernel (see kernels.blocks: bfloat16 as its raw bits).
_FLOAT_VIEWS = {WeightType.F32: torch.float32, WeightType.F16: torch.float16, WeightType.BF16: torch.int16}


def _exact(device: torch.device) -> bool:
    """EXACT for the kernels: the inline-PTX rounding compiled; the interpreter (CPU tensors) never fuses."""
    return device.type == "cuda"


def part_weights(part: MatrixPart) -> tuple[torch.Tensor, int]:
    """(the part's rows as the kernel reads them, elements per row): float types viewed as their
    element type (a copy only where the bytes are not aligned for it), block types as bytes."""
    view = _FLOAT_VIEWS.get(part.weight_type)
    if view is None:
        return part.data, part.data.shape[1]
    data = part.data
    try:
        weights = data.view(view)
    except RuntimeError:  # an offset not a multiple of the element size
        weights = data.clone().view(view)
    return weights, weights.shape[1]


def _product_part(x: torch.Tensor, part: MatrixPart, p: dict, bias: torch.Tensor | None, out: torch.Tensor):
    """One part's product by plan p (kernels.plan) into out, its column range of the output [R, rows]
    (with its bias), or with K split of the partial sums [splits, R, rows] (no bias: the combine
    adds it)."""
    R, K = x.shape
    weights, row_stride = part_weights(part)
    kernel = kernels._gemv_kernel if p["kernel"] == "gemv" else kernels._gemm_kernel
    has_bias = int(bias is not None)
    split_stride = out.stride(0) if out.dim() == 3 else 0
    kernel[p["grid"]](x, weights, bias if has_bias else out, out, R, part.rows, K, row_stride, p["groups_per_split"],
                      split_stride, out.stride(-2), has_bias, TYPE=int(part.weight_type), BLOCK_R=p["BLOCK_R"],
                      BLOCK_N=p["BLOCK_N"], EXACT=_exact(x.device), num_warps=p["num_warps"])


def linear_blocks_triton(
    x: torch.Tensor,                   # [..., K] float32
    matrix: BlockMatrix,               # [N, K] as stored, on x's device
    bias: torch.Tensor | None = None,  # [N] float32, or None
) -> torch.Tensor:
    """x @ dequantized(matrix)^T + bias, float32 [..., N]: a launch per part, and with K split one
    combine for the whole matrix (every part's split is the matrix's)."""
    K, N = matrix.in_features, matrix.out_features
    lead = x.shape[:-1]
    R = lead.numel()
    out = torch.empty(R, N, dtype=torch.float32, device=x.device)
    if R == 0 or N == 0:
        return out.reshape(*lead, N)
    if K == 0:  # an empty sum: the bias
        out.zero_()
        if bias is not None:
            out += bias
        return out.reshape(*lead, N)
    gemm = product_gemm_sized(x)
    x = x.reshape(R, K).contiguous()
    bias = None if bias is None else bias.contiguous()
    splits = kernels.plan(R, N, K, gemm)["splits"]
    partial = None if splits == 1 else torch.empty(splits, R, N, dtype=torch.float32, device=x.device)
    col = 0
    for part in matrix.parts:
        if part.rows:
            columns = slice(col, col + part.rows)
            p = kernels.plan(R, part.rows, K, gemm, N)
            if partial is None:
                _product_part(x, part, p, None if bias is None else bias[columns], out[:, columns])
            else:
                _product_part(x, part, p, None, partial[:, :, columns])
        col += part.rows
    if partial is not None:
        grid = (R, -(-N // kernels.COMBINE_BLOCK))
        kernels._combine_kernel[grid](partial, partial if bias is None else bias, out, R, N, splits, out.stride(0),
                                      int(bias is not None), BLOCK=kernels.COMBINE_BLOCK, num_warps=kernels.NUM_WARPS)
    return out.reshape(*lead, N)


def embedding_rows_triton(
    matrix: BlockMatrix,   # [vocab, hidden] as stored
    ids: torch.Tensor,     # [...] int64, each in [0, vocab), on the matrix's device
) -> torch.Tensor:
    """The dequantized rows of `ids`: float32 [..., hidden] (an embedding lookup). Each part's
    launch writes the rows of the ids that fall in it; an id outside every part leaves its row
    unwritten (ops.blocks.embedding_rows takes ids in range)."""
    K = matrix.in_features
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    M = flat.shape[0]
    out = torch.empty(M, K, dtype=torch.float32, device=flat.device)
    if M and K:
        grid = kernels.rows_grid(M, K)
        start = 0
        for part in matrix.parts:
            if part.rows:
                weights, row_stride = part_weights(part)
                kernels._rows_kernel[grid](flat, weights, out, M, K, row_stride, start, part.rows,
                                           TYPE=int(part.weight_type), BLOCK_IDS=kernels.ROWS_BLOCK_IDS,
                                           GROUPS=kernels.ROWS_GROUPS, EXACT=_exact(flat.device),
                                           num_warps=kernels.NUM_WARPS)
            start += part.rows
    return out.reshape(*ids.shape, K)

