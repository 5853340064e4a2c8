"""Matrices kept as a GGUF file stores them: rows of ggml blocks, computed at the file's precision.

Terms used throughout:
  weight type   ggml's tensor type of a matrix: a float format (F32, F16, BF16: a "block" of one
                value) or a block format (Q8_0 ... Q6_K: `block_size` weights in `block_bytes`
                bytes, with their scales).
  row bytes     one matrix row of K weights: K / block_size blocks, back to back.
  part          rows of one weight type, held as raw bytes uint8 [rows, row_bytes]. A packed
                projection (q, k and v; gate and up) is the parts of its checkpoint matrices,
                stacked; in a Q4_K_M file those can differ in type (v in Q6_K, q and k in Q4_K).
                Consecutive parts of one type can be merged into one (BlockMatrix.merged), as
                layers.blocks holds them on a GPU.
  dequantized   a weight's float32 value, computed exactly as the `gguf` package's numpy
                dequantization computes it (the same float32 operations in the same order; none
                fused), so that a product over these weights is transformers' float32 load of the
                file, up to float32 summation order.

Implementations of the products (linear_blocks) and lookups (embedding_rows), chosen by `impl`:
  "cpp"        specengine._C (ops.blocks_cpp): CPU, float32 activations; the few-row product reads
               each weight block once for all rows; prefill-sized products (gemm_blocks) dequantize
               32 weight rows at a time into a panel that every row of x passes over
  "triton"     specengine.kernels.blocks (ops.blocks_triton): CUDA tensors, blocks dequantized in
               registers
  "reference"  dequantize_reference below, then F.linear: the oracle (itself checked bit for bit
               against gguf's numpy dequantization)
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels.weight_types import WEIGHT_TYPES, WeightTypeLayout


# ggml's type ids (gguf.GGMLQuantizationType) of the weight types run as stored, named as ggml
# names them; their layouts are kernels/weight_types.py's table (LAYOUTS).
WeightType = enum.IntEnum("WeightType", [(t.name, t.type_id) for t in WEIGHT_TYPES], module=__name__)
LAYOUTS: dict[WeightType, WeightTypeLayout] = {WeightType(t.type_id): t for t in WEIGHT_TYPES}
# weight type -> (weights per block, bytes per block)
BLOCK_LAYOUT: dict[WeightType, tuple[int, int]] = {t: (lay.block_size, lay.block_bytes) for t, lay in LAYOUTS.items()}
FLOAT_TYPES = frozenset(t for t, lay in LAYOUTS.items() if lay.is_float)
IMPLEMENTATIONS = ("cpp", "triton", "reference")


class BlockFormatError(ValueError):
    """A matrix's bytes do not form whole rows of whole blocks of its weight type."""


def row_bytes(weight_type: WeightType, in_features: int) -> int:
    """Bytes of one row of `in_features` weights (a whole number of blocks, else BlockFormatError)."""
    block_size, block_bytes = BLOCK_LAYOUT[weight_type]
    if in_features % block_size:
        raise BlockFormatError(f"a {weight_type.name} row holds blocks of {block_size} weights; "
                               f"{in_features} is not a multiple of {block_size}")
    return in_features // block_size * block_bytes


@dataclass(frozen=True)
class MatrixPart:
    """Rows of one weight type: raw bytes, as the file stores them."""

    weight_type: WeightType
    data: torch.Tensor  # [rows, row_bytes] uint8, contiguous

    def __post_init__(self):
        object.__setattr__(self, "weight_type", WeightType(self.weight_type))
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or not self.data.is_contiguous():
            raise BlockFormatError(f"a {self.weight_type.name} part must be contiguous uint8 [rows, row_bytes], got "
                                   f"{self.data.dtype} {tuple(self.data.shape)}")
        block_bytes = BLOCK_LAYOUT[self.weight_type][1]
        if self.data.shape[1] % block_bytes:
            raise BlockFormatError(f"a {self.weight_type.name} row is whole blocks of {block_bytes} bytes; "
                                   f"got rows of {self.data.shape[1]} bytes")

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def in_features(self) -> int:
        block_size, block_bytes = BLOCK_LAYOUT[self.weight_type]
        return self.data.shape[1] // block_bytes * block_size


@dataclass(frozen=True)
class BlockMatrix:
    """A weight matrix [out_features, in_features] as stored: its parts' rows, stacked in order."""

    parts: tuple[MatrixPart, ...]

    def __post_init__(self):
        object.__setattr__(self, "parts", tuple(self.parts))
        if not self.parts:
            raise BlockFormatError("a matrix needs at least one part")
        widths = {p.in_features for p in self.parts}
        devices = {p.data.device for p in self.parts}
        if len(widths) != 1 or len(devices) != 1:
            raise BlockFormatError(f"a matrix's parts must share in_features and device, got {sorted(widths)} "
                                   f"on {sorted(map(str, devices))}")

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def out_features(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def device(self) -> torch.device:
        return self.parts[0].data.device

    @property
    def nbytes(self) -> int:
        return sum(p.data.numel() for p in self.parts)

    @property
    def weight_types(self) -> tuple[WeightType, ...]:
        return tuple(p.weight_type for p in self.parts)

    def to(self, device: torch.device | str) -> BlockMatrix:
        return BlockMatrix(tuple(MatrixPart(p.weight_type, p.data.to(device)) for p in self.parts))

    def merged(self) -> BlockMatrix:
        """The same matrix with each run of consecutive parts of one weight type as one part: their
        rows stacked, which is exact (a row is whole blocks of its type, and every part has the
        matrix's in_features). A run's bytes are copied into the new part; a part alone in its run
        is kept as it is."""
        parts = []
        for _, run in itertools.groupby(self.parts, key=lambda p: p.weight_type):
            run = list(run)
            parts.append(run[0] if len(run) == 1 else MatrixPart(run[0].weight_type, torch.cat([p.data for p in run])))
        return BlockMatrix(tuple(parts))

    @staticmethod
    def from_dense(weight: torch.Tensor) -> BlockMatrix:
        """A float32, float16 or bfloat16 matrix [N, K] as one part of its float type (its bytes viewed, not copied)."""
        types = {torch.float32: WeightType.F32, torch.float16: WeightType.F16, torch.bfloat16: WeightType.BF16}
        if weight.dtype not in types or weight.dim() != 2:
            raise BlockFormatError(f"from_dense takes a 2-d float32, float16 or bfloat16 matrix, got {weight.dtype} "
                                   f"{tuple(weight.shape)}")
        weight = weight.contiguous()
        return BlockMatrix((MatrixPart(types[weight.dtype], weight.view(torch.uint8)),))


# ---- the reference: gguf's numpy dequantization, in torch ------------------------------------


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 fields [..., 2] uint8 -> float32 [...]."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Bytes [n, g * group] -> [n, g, 2 * group]: each group's low nibbles, then its high ones."""
    qs = qs.reshape(qs.shape[0], -1, 1, group)
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=qs.device).view(1, 1, 2, 1)
    return ((qs >> shifts) & 0x0F).reshape(qs.shape[0], -1, 2 * group)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K and Q5_K's 12 bytes of 6-bit sub-block scales and mins -> ([n, 8], [n, 8]) float32."""
    s = scales.reshape(-1, 3, 4).to(torch.int32)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mins.float()


def _dequantize_blocks(weight_type: WeightType, b: torch.Tensor) -> torch.Tensor:
    """Blocks [n, block_bytes] uint8 -> their weights [n, block_size] float32."""
    n = b.shape[0]
    T = WeightType
    lay = LAYOUTS[weight_type]
    if weight_type == T.F32:
        return b.contiguous().view(torch.float32).reshape(n, 1)
    if weight_type == T.F16:
        return _f16(b).reshape(n, 1)
    if weight_type == T.BF16:
        return b.contiguous().view(torch.bfloat16).float().reshape(n, 1)
    d = _f16(b[:, lay.d:lay.d + 2])[:, None]
    if weight_type == T.Q8_0:
        return b[:, lay.qs:lay.qs + 32].contiguous().view(torch.int8).float() * d
    if weight_type in (T.Q4_0, T.Q4_1):
        if weight_type == T.Q4_0:
            q = _nibbles(b[:, lay.qs:lay.qs + 16], 16).reshape(n, 32).to(torch.int8) - 8
            return d * q.float()
        m = _f16(b[:, lay.m:lay.m + 2])[:, None]
        return d * _nibbles(b[:, lay.qs:lay.qs + 16], 16).reshape(n, 32).float() + m
    if weight_type in (T.Q5_0, T.Q5_1):
        # A fresh copy: a view of one block is "contiguous" at an odd offset, which int32 cannot view.
        qh = b[:, lay.qh:lay.qh + 4].clone(memory_format=torch.contiguous_format).view(torch.int32).reshape(n, 1)
        high = (qh >> torch.arange(32, dtype=torch.int32, device=b.device)) & 1
        q = _nibbles(b[:, lay.qs:lay.qs + 16], 16).reshape(n, 32).to(torch.int32) | (high << 4)
        if weight_type == T.Q5_0:
            return d * (q - 16).float()
        return d * q.float() + _f16(b[:, lay.m:lay.m + 2])[:, None]
    if weight_type in (T.Q4_K, T.Q5_K):
        dmin = _f16(b[:, lay.m:lay.m + 2])[:, None]
        sc, mins = _scale_min_k4(b[:, lay.scales:lay.scales + 12])
        scale, shift = (d * sc)[:, :, None], (dmin * mins)[:, :, None]  # [n, 8, 1]
        if weight_type == T.Q4_K:
            q = _nibbles(b[:, lay.qs:lay.qs + 128], 32).reshape(n, 8, 32).float()
        else:
            low = _nibbles(b[:, lay.qs:lay.qs + 128], 32).reshape(n, 8, 32).to(torch.int32)
            qh = b[:, lay.qh:lay.qh + 32].to(torch.int32).reshape(n, 1, 32)
            high = (qh >> torch.arange(8, dtype=torch.int32, device=b.device).view(1, 8, 1)) & 1
            q = (low | (high << 4)).float()
        return (scale * q - shift).reshape(n, 256)
    if weight_type == T.Q6_K:
        ql, qh, scales = b[:, lay.qs:lay.qs + 128], b[:, lay.qh:lay.qh + 64], b[:, lay.scales:lay.scales + 16]
        scale = (d * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
        low = _nibbles(ql, 64).reshape(n, 8, 32).to(torch.int32)
        qh = qh.reshape(n, 2, 1, 32).to(torch.int32)
        high = ((qh >> torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=b.device).view(1, 1, 4, 1)) & 3)
        q = (low | (high.reshape(n, 8, 32) << 4)) - 32
        return (scale * q.reshape(n, 16, 16).float()).reshape(n, 256)
    raise BlockFormatError(f"weight type {weight_type!r} has no dequantization")


def dequantize_part(part: MatrixPart) -> torch.Tensor:
    """A part's weights as float32 [rows, in_features]."""
    block_size, block_bytes = BLOCK_LAYOUT[part.weight_type]
    blocks = part.data.reshape(-1, block_bytes)
    return _dequantize_blocks(part.weight_type, blocks).reshape(part.rows, part.in_features)


def dequantize_reference(matrix: BlockMatrix) -> torch.Tensor:
    """The matrix's weights as float32 [out_features, in_features]."""
    return torch.cat([dequantize_part(p) for p in matrix.parts])


def _rows_reference(matrix: BlockMatrix, ids: torch.Tensor) -> torch.Tensor:
    """Dequantized rows `ids` [...] int64 -> [..., in_features] float32."""
    out = ids.new_empty((*ids.shape, matrix.in_features), dtype=torch.float32)
    flat, start = ids.reshape(-1), 0
    result = out.view(-1, matrix.in_features)
    for part in matrix.parts:
        inside = (flat >= start) & (flat < start + part.rows)
        if inside.any():
            local = flat[inside] - start
            result[inside] = dequantize_part(MatrixPart(part.weight_type, part.data[local].contiguous()))
        start += part.rows
    return out


# ---- entry points -----------------------------------------------------------------------------


def _check(cond: bool, message: str):
    if not cond:
        raise ValueError(f"linear_blocks: {message}")


def linear_blocks(
    x: torch.Tensor,                   # [..., K] float32
    matrix: BlockMatrix,               # [N, K] as stored
    bias: torch.Tensor | None = None,  # [N] float32, or None
    impl: str = "reference",
    check: bool = True,
) -> torch.Tensor:
    """x @ dequantized(matrix)^T + bias, float32 [..., N]."""
    if check:
        _check(impl in IMPLEMENTATIONS, f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
        K = matrix.in_features
        _check(x.dim() >= 1 and x.shape[-1] == K, f"x must be [..., {K}], got {tuple(x.shape)}")
        _check(x.dtype == torch.float32, f"x must be float32, got {x.dtype}")
        _check(x.device == matrix.device, f"x is on {x.device}, the matrix on {matrix.device}")
        if bias is not None:
            _check(tuple(bias.shape) == (matrix.out_features,) and bias.dtype == torch.float32,
                   f"bias must be float32 [{matrix.out_features}], got {bias.dtype} {tuple(bias.shape)}")
    if impl == "cpp":
        from .blocks_cpp import linear_blocks_cpp

        return linear_blocks_cpp(x, matrix, bias)
    if impl == "triton":
        from .blocks_triton import linear_blocks_triton

        return linear_blocks_triton(x, matrix, bias)
    return F.linear(x, dequantize_reference(matrix), bias)


def embedding_rows(
    matrix: BlockMatrix,   # [vocab, hidden] as stored
    ids: torch.Tensor,     # [...] int64, each in [0, vocab)
    impl: str = "reference",
) -> torch.Tensor:
    """The dequantized rows of `ids`: float32 [..., hidden] (an embedding lookup)."""
    if impl == "cpp":
        from .blocks_cpp import embedding_rows_cpp

        return embedding_rows_cpp(matrix, ids)
    if impl == "triton":
        from .blocks_triton import embedding_rows_triton

        return embedding_rows_triton(matrix, ids)
    return _rows_reference(matrix, ids)
