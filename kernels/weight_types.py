"""The weight types that matrices are run in as a GGUF file stores them: one table, from which the
host side (specengine.ops.blocks), the Triton kernels (kernels/blocks.py) and the tests take each
type's block size, bytes and layout. The C++ ops (csrc/blocks.h) keep the same table in C++;
tests/test_weight_types.py compares the two field by field, and both with the `gguf` package.

Plain Python, importing nothing: the kernels, the C++ build's test and the host all read it.

A block is ggml's block struct of its type, little-endian: `block_size` weights in `block_bytes`
bytes. The float types are blocks of one weight (their value). The offsets say where a block's
fields start, in bytes, -1 where the type has none:
  d       the float16 scale (Q6_K's after its codes)
  m       the float16 min (Q4_1, Q5_1) or the scale of the sub-block mins, dmin (Q4_K, Q5_K)
  scales  sub-block scales: Q4_K/Q5_K 12 bytes of 6-bit scales and mins, Q6_K 16 int8
  qh      the high bits of the codes (Q5_0, Q5_1: bit i of 4 bytes for weight i; Q5_K: bit s of
          byte l for weight l of sub-block s; Q6_K: 2 bits each)
  qs      the codes' low bits (4-bit nibbles; Q8_0's int8; Q6_K's ql), or a float type's value
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightTypeLayout:
    name: str          # ggml's name (gguf.GGMLQuantizationType[name])
    type_id: int       # ggml's type id (gguf.GGMLQuantizationType)
    block_size: int    # weights per block
    block_bytes: int   # bytes per block
    d: int = -1
    m: int = -1
    scales: int = -1
    qh: int = -1
    qs: int = 0

    @property
    def is_float(self) -> bool:
        return self.block_size == 1

    @property
    def half_fields(self) -> tuple[int, ...]:
        """Offsets of the block's float16 scale fields (d, then m where it has one)."""
        return tuple(offset for offset in (self.d, self.m) if offset >= 0)


WEIGHT_TYPES: tuple[WeightTypeLayout, ...] = (
    WeightTypeLayout("F32", 0, 1, 4),
    WeightTypeLayout("F16", 1, 1, 2),
    WeightTypeLayout("Q4_0", 2, 32, 18, d=0, qs=2),
    WeightTypeLayout("Q4_1", 3, 32, 20, d=0, m=2, qs=4),
    WeightTypeLayout("Q5_0", 6, 32, 22, d=0, qh=2, qs=6),
    WeightTypeLayout("Q5_1", 7, 32, 24, d=0, m=2, qh=4, qs=8),
    WeightTypeLayout("Q8_0", 8, 32, 34, d=0, qs=2),
    WeightTypeLayout("Q4_K", 12, 256, 144, d=0, m=2, scales=4, qs=16),
    WeightTypeLayout("Q5_K", 13, 256, 176, d=0, m=2, scales=4, qh=16, qs=48),
    WeightTypeLayout("Q6_K", 14, 256, 210, d=208, scales=192, qh=128, qs=0),
    WeightTypeLayout("BF16", 30, 1, 2),
)
BY_ID: dict[int, WeightTypeLayout] = {t.type_id: t for t in WEIGHT_TYPES}
BY_NAME: dict[str, WeightTypeLayout] = {t.name: t for t in WEIGHT_TYPES}
