"""Products and row lookups of matrices kept as a GGUF file stores them (rows of ggml blocks), in
Triton: every weight is dequantized in registers to exactly the float32 value of the `gguf`
package's numpy dequantization.

Terms used throughout:
  weight type  ggml's tensor type id of a part (the constexprs F32 ... BF16 below, gguf's
               GGMLQuantizationType): a float format (one weight per "block") or a block format
               of `block_size` weights in `block_bytes` bytes (kernels/weight_types.py).
  part         rows of one weight type: w_ptr points at their first byte (block formats, *u8),
               float (F32: *fp32, F16: *fp16) or raw bfloat16 bits (BF16: *i16); a row is
               `row_stride` elements of w_ptr.
  group        32 consecutive weights of a row (GROUP): a Q4_0 ... Q8_0 block, an eighth of a
               K-quant block (a Q4_K/Q5_K sub-block with one scale and min, two Q6_K scales).
               Every kernel dequantizes one group of BLOCK_N rows at a time: a [BLOCK_N, 32]
               tile, column j the row's weight k0 + j (the file's order of weights).
  exact        as gguf computes it: the same float32 operations in the same order, none fused.
               Compiled, LLVM and ptxas contract a multiply followed by an add into one FMA
               (one rounding instead of two). EXACT=True emits Q4_1/Q5_1's (d * q) + m and
               the K-quants' scale * q - shift as `mul.rn.f32` then `add.rn.f32`/`sub.rn.f32`
               in one inline-PTX block, which neither can contract (PTX: an instruction with an
               explicit rounding modifier is never fused; tests/test_blocks_triton.py checks
               the PTX). The interpreter (numpy: never fuses, no inline PTX) runs EXACT=False,
               the same operations as plain ones. (In these formats each product is exact in
               float32 anyway: an 11-bit float16 scale times a 6-bit sub-block scale times a
               quant of at most 6 bits fits 24 bits; EXACT keeps the kernels from relying on
               that.) The products with the activations may fuse: they differ from F.linear
               by float32 summation order only, and so do the two kernels below from each other.

The launches (host side: specengine.ops.blocks_triton allocates and launches, one launch per part
into the part's range of output columns, a matrix on a GPU holding each run of consecutive parts of
one type as one part (layers.blocks); plan() below picks the tiles):
  _gemv_kernel    (n tiles, splits)  a call the host does not size as a GEMM (ops.product.gemm_sized:
                  few tokens per sequence row; a decode or verification step), any
                  number R of activation rows: each program loops over row tiles of BLOCK_R rows,
                  dequantizing each group of its BLOCK_N weight rows once per row tile, keeping
                  [BLOCK_R, BLOCK_N, 32] float32 partial products (explicit FMAs), summed over its K
                  range at the end by a fixed pairwise tree.
  _gemm_kernel    (r tiles * n tiles, 1)  a call the host sizes as a GEMM (a prompt): the
                  dequantized group as the K = 32 slice of a float32 dot ("ieee": no TF32) with the
                  activations' [BLOCK_R, 32] tile; K is never split.
  _combine_kernel (R, n blocks)      with splits > 1: the splits' partial sums added in split
                  order, plus the bias.
  _rows_kernel    (id blocks, group blocks)  an embedding lookup: the dequantized rows of the ids
                  that fall in the part, written to their output rows.

Batch invariance: a row's result is the same bits whatever rows share the call (alone, in a batch
of any size, as one token of a verification), as on the CPU path (ops.blocks_cpp), so that a
request decodes alike in any batch and greedy speculative decoding equals target-only decoding.
Hence: the kernel is chosen by tokens per row, never by the number of rows; the split of K
depends on the matrix's shape (N, K) only, N its rows whatever part a launch covers (so a matrix
whose parts are merged computes the same bits as the file's parts); every operation on a row's
values is elementwise (tl.fma, then _sum_groups' pairwise tree instead of tl.sum, whose order
follows the tile's register layout, which the compiler picks by tile shape); the tiles (BLOCK_R,
BLOCK_N) then change only which program computes a row, not how. The prompt kernel has one row
tile (64: its dot's shape never changes), accumulates each output over k in order (a float32
"ieee" dot is FMAs) and never splits K, so a prompt's row is also the same bits whatever the
batch (but not the same as the decode kernel's: the engine compares decoding with decoding).

Tiles for an H200 (141 GB at 4.8 TB/s, 132 SMs): a decode product is a stream of the weights,
so what counts is bytes in flight on every SM. Each _gemv_kernel thread dequantizes 8 weights of
a group per step (a [32, 32] tile in 4 warps: 80-150 registers on sm_90, three or more programs
per SM; wider tiles halve the programs per SM and spill: tests/compile_triton.py). A small model has few
row tiles (SmolLM2-135M: N = 576 over K = 576; a 1B model's down projection: N = 2048 over
K = 8192, 64 tiles), so K is split until about TARGET_PROGRAMS programs of SPLIT_BLOCK_N rows run
(counted at that tile whatever BLOCK_N is: the split depends on the matrix's (N, K) only), each
split at least MIN_SPLIT_GROUPS groups so the partial sums stay small beside the weights. More than GEMV_BLOCK_R
rows (a batch's verification) loop over row tiles, the group re-read from L1/L2 for each. A
prompt's product is float32 FMAs (no TF32), compute-bound: _gemm_kernel's BLOCK_R rows share each
dequantized group. The tiles and split count depend on the shapes only, never on values, so a
graph-captured step keeps its grid. (tests/compile_triton.py reports the registers; no H200 speed is recorded.)
"""
from __future__ import annotations

import triton
import triton.language as tl

from .weight_types import BY_ID, BY_NAME

# ggml's type ids of the weight types (gguf.GGMLQuantizationType), from the one table of them.
F32 = tl.constexpr(BY_NAME["F32"].type_id)
F16 = tl.constexpr(BY_NAME["F16"].type_id)
Q4_0 = tl.constexpr(BY_NAME["Q4_0"].type_id)
Q4_1 = tl.constexpr(BY_NAME["Q4_1"].type_id)
Q5_0 = tl.constexpr(BY_NAME["Q5_0"].type_id)
Q5_1 = tl.constexpr(BY_NAME["Q5_1"].type_id)
Q8_0 = tl.constexpr(BY_NAME["Q8_0"].type_id)
Q4_K = tl.constexpr(BY_NAME["Q4_K"].type_id)
Q5_K = tl.constexpr(BY_NAME["Q5_K"].type_id)
Q6_K = tl.constexpr(BY_NAME["Q6_K"].type_id)
BF16 = tl.constexpr(BY_NAME["BF16"].type_id)
# weight type -> (weights per block, bytes per block)
LAYOUT = {t.type_id: (t.block_size, t.block_bytes) for t in BY_ID.values()}
FLOAT_TYPES = tuple(t.type_id for t in BY_ID.values() if t.is_float)


# A field of a type's layout (kernels/weight_types.py: block_bytes, or the byte offset of d, m,
# scales, qh or qs in a block), read while a kernel compiles: _layout(TYPE, "qs").
@triton.constexpr_function
def _layout(type_id, field):
    return getattr(BY_ID[type_id], field)


GROUP = tl.constexpr(32)  # weights per dequantized group (the K slice of one step)
GEMV_BLOCK_R = 8         # _gemv_kernel's row tile: R rounded up to a power of two, at most this (1, 2, 4, 8)
GEMV_BLOCK_N = 32        # weight rows per _gemv_kernel program (8 weights of a group per thread) ...
GEMV_TILE = 128          # ... with BLOCK_R * BLOCK_N at most this (BLOCK_R 8: 16 rows): 80-150 registers
SPLIT_BLOCK_N = 32       # the weight rows per program at which the split of K is counted: fixed, so that the
                         # split (which decides a row's sums) never follows the tiles (which do not)
GEMM_BLOCK_N = 64        # weight rows per _gemm_kernel program
GEMM_BLOCK_R = 64        # _gemm_kernel's BLOCK_R (its dot's M): one size, so that a row's dot never changes shape
TARGET_PROGRAMS = 512    # programs a product aims for by splitting K (about 4 per SM of an H200)
MIN_SPLIT_GROUPS = 8     # groups (256 weights) per split at least
COMBINE_BLOCK = 1024     # output columns per _combine_kernel program
ROWS_BLOCK_IDS = 16      # ids per _rows_kernel program
ROWS_GROUPS = 4          # groups per _rows_kernel program (128 columns)
NUM_WARPS = 4            # per program, but _gemm_kernel's: at 4 its K-quant variants spill on sm_90
GEMM_WARPS = 8


# ---- exact float32 arithmetic ---------------------------------------------------------------

@triton.jit
def _mul_add(a, b, c, EXACT: tl.constexpr):
    """a * b + c, rounded after the multiply and after the add (never one FMA)."""
    if EXACT:
        return tl.inline_asm_elementwise("{ .reg .f32 t; mul.rn.f32 t, $1, $2; add.rn.f32 $0, t, $3; }",
                                         "=r,r,r,r", [a, b, c], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return a * b + c


@triton.jit
def _mul_sub(a, b, c, EXACT: tl.constexpr):
    """a * b - c, rounded after the multiply and after the subtraction (never one FMA)."""
    if EXACT:
        return tl.inline_asm_elementwise("{ .reg .f32 t; mul.rn.f32 t, $1, $2; sub.rn.f32 $0, t, $3; }",
                                         "=r,r,r,r", [a, b, c], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return a * b - c


# ---- fields of a block ---------------------------------------------------------------------------

@triton.jit
def _f16_at(p, mask):
    """The little-endian float16 at byte pointers p [...], as float32 (exact: every float16 is a float32)."""
    lo = tl.load(p, mask=mask, other=0).to(tl.int32)
    hi = tl.load(p + 1, mask=mask, other=0).to(tl.int32)
    return (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte_at(p, mask):
    """The bytes at pointers p [...] as int32 in [0, 256)."""
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _scale_min_k4(fields, s, mask):
    """Q4_K and Q5_K: sub-block s's 6-bit scale and min (float32 [BLOCK_N]) from the 12 bytes at
    `fields` (pointers [BLOCK_N]): bytes 0-3 hold the low 6 bits of scales 0-3 (their top 2 bits: those of scales 4-7),
    bytes 4-7 the mins' likewise, bytes 8-11 the low 4 bits of scales 4-7 and (high nibble) mins 4-7."""
    i = s % 4
    d = _byte_at(fields + i, mask)
    m = _byte_at(fields + 4 + i, mask)
    m_d = _byte_at(fields + 8 + i, mask)
    sc = tl.where(s < 4, d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30))
    mn = tl.where(s < 4, m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _dequant(w_ptr, row_at, row_ok, k0, K, TYPE: tl.constexpr, EXACT: tl.constexpr):
    """Weights k0 .. k0 + 31 of BLOCK_N rows, float32 [BLOCK_N, 32] (0 where masked).

    row_at  [BLOCK_N] int64, each row's first element of w_ptr (row * row_stride)
    row_ok  [BLOCK_N] bool, rows to read
    k0      the group's first weight, a multiple of 32 (K a multiple of 32 unless a float type)
    """
    j = tl.arange(0, GROUP)
    row_ok = row_ok & (k0 < K)
    ok = row_ok[:, None] & (k0 + j < K)[None, :]
    rows = w_ptr + row_at                      # [BLOCK_N] pointers to the rows
    g = k0 // GROUP                            # the group's index in its row
    if TYPE == F32:
        w = tl.load(rows[:, None] + (k0 + j)[None, :], mask=ok, other=0.0)
    elif TYPE == F16:
        w = tl.load(rows[:, None] + (k0 + j)[None, :], mask=ok, other=0.0).to(tl.float32)
    elif TYPE == BF16:  # its bits are a float32's top half
        bits = tl.load(rows[:, None] + (k0 + j)[None, :], mask=ok, other=0).to(tl.int32)
        w = (bits << 16).to(tl.float32, bitcast=True)
    elif TYPE == Q8_0:  # d, 32 int8: q * d
        block = rows + g * _layout(TYPE, "block_bytes")
        d = _f16_at(block + _layout(TYPE, "d"), row_ok)
        q = tl.load(block[:, None] + _layout(TYPE, "qs") + j[None, :], mask=ok, other=0).to(tl.int8, bitcast=True)
        w = q.to(tl.float32) * d[:, None]
    elif (TYPE == Q4_0) | (TYPE == Q4_1) | (TYPE == Q5_0) | (TYPE == Q5_1):
        # d (Q4_1, Q5_1: and m), (Q5: 4 bytes of high bits qh, bit j for weight j), 16 bytes of
        # nibbles qs: weight j < 16 the low nibble of byte j, weight 16 + j its high nibble.
        block = rows + g * _layout(TYPE, "block_bytes")
        d = _f16_at(block + _layout(TYPE, "d"), row_ok)[:, None]
        q = (_byte_at(block[:, None] + _layout(TYPE, "qs") + (j % 16)[None, :], ok) >> ((j // 16) * 4)[None, :]) & 0x0F
        if (TYPE == Q5_0) | (TYPE == Q5_1):
            high = (_byte_at(block[:, None] + _layout(TYPE, "qh") + (j // 8)[None, :], ok) >> (j % 8)[None, :]) & 1
            q = q | (high << 4)
        if TYPE == Q4_0:
            w = d * (q - 8).to(tl.float32)
        elif TYPE == Q5_0:
            w = d * (q - 16).to(tl.float32)
        else:  # (d * q) + m
            w = _mul_add(d, q.to(tl.float32), _f16_at(block + _layout(TYPE, "m"), row_ok)[:, None], EXACT)
    elif (TYPE == Q4_K) | (TYPE == Q5_K):
        # d, dmin (m), 12 bytes of sub-block scales and mins, (Q5_K: 32 bytes qh, bit s of byte j
        # for weight j of sub-block s), 128 bytes of nibbles qs: sub-blocks 2c and 2c + 1 the low
        # and high nibbles of bytes 32c .. 32c + 31. Weight: (d * scale) * q - (dmin * min).
        s = g % 8
        block = rows + (g // 8) * _layout(TYPE, "block_bytes")
        sc, mn = _scale_min_k4(block + _layout(TYPE, "scales"), s, row_ok)
        scale = _f16_at(block + _layout(TYPE, "d"), row_ok) * sc
        shift = _f16_at(block + _layout(TYPE, "m"), row_ok) * mn
        q = (_byte_at(block[:, None] + _layout(TYPE, "qs") + (s // 2) * 32 + j[None, :], ok) >> ((s % 2) * 4)) & 0x0F
        if TYPE == Q5_K:
            q = q | (((_byte_at(block[:, None] + _layout(TYPE, "qh") + j[None, :], ok) >> s) & 1) << 4)
        w = _mul_sub(scale[:, None], q.to(tl.float32), shift[:, None], EXACT)
    else:
        tl.static_assert(TYPE == Q6_K, "unknown weight type")
        # 128 bytes ql (qs), 64 bytes qh, 16 int8 scales (one per 16 weights), d. Group t = 4h + c
        # of the block (half h, quarter c): low 4 bits from byte 64h + 32(c % 2) + j of ql (nibble
        # c // 2), high 2 bits from bits 2c of byte 32h + j of qh. Weight: (d * scale) * (q - 32).
        t = g % 8
        h = t // 4
        c = t % 4
        block = rows + (g // 8) * _layout(TYPE, "block_bytes")
        low_at = block[:, None] + _layout(TYPE, "qs") + 64 * h + 32 * (c % 2) + j[None, :]
        low = (_byte_at(low_at, ok) >> ((c // 2) * 4)) & 0x0F
        high = (_byte_at(block[:, None] + _layout(TYPE, "qh") + 32 * h + j[None, :], ok) >> (2 * c)) & 3
        q = (low | (high << 4)) - 32
        d = _f16_at(block + _layout(TYPE, "d"), row_ok)
        scales = block + _layout(TYPE, "scales") + 2 * t
        first = d * tl.load(scales, mask=row_ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        second = d * tl.load(scales + 1, mask=row_ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = tl.where((j < 16)[None, :], first[:, None], second[:, None]) * q.to(tl.float32)
    return w


# ---- products -----------------------------------------------------------------------------------

# Runtime integers: a new shape does not recompile (K and row_stride stay specialized: their
# divisibility lets loads vectorize).
_RUNTIME = ["R", "N", "groups_per_split", "stride_out_split", "stride_out_row", "has_bias"]


@triton.jit
def _sum_groups(acc, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc [BLOCK_R, BLOCK_N, 32] summed over its last axis, [BLOCK_R, BLOCK_N], by a fixed tree:
    adjacent pairs, then pairs of those, five times. Unlike tl.sum (whose order follows the
    compiler's register layout of the tile), every element is summed in the same order whatever
    the tile's shape."""
    s = tl.reshape(acc, (BLOCK_R, BLOCK_N, 16, 2))
    a, b = tl.split(s)
    s = tl.reshape(a + b, (BLOCK_R, BLOCK_N, 8, 2))
    a, b = tl.split(s)
    s = tl.reshape(a + b, (BLOCK_R, BLOCK_N, 4, 2))
    a, b = tl.split(s)
    s = tl.reshape(a + b, (BLOCK_R, BLOCK_N, 2, 2))
    a, b = tl.split(s)
    s = tl.reshape(a + b, (BLOCK_R, BLOCK_N, 2))
    a, b = tl.split(s)
    return a + b


@triton.jit(do_not_specialize=_RUNTIME)
def _gemv_kernel(
    x_ptr,      # [R, K] float32 contiguous: the activations
    w_ptr,      # [N, row_stride] the part's rows (see the terms)
    bias_ptr,   # [N] float32 (read when has_bias)
    out_ptr,    # [splits, R, *] float32: out_ptr + split * stride_out_split + r * stride_out_row + n
    R, N, K, row_stride, groups_per_split, stride_out_split, stride_out_row, has_bias,
    TYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, EXACT: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    n_ok = n < N
    row_at = tl.where(n_ok, n, 0).to(tl.int64) * row_stride
    j = tl.arange(0, GROUP)
    k_start = split * groups_per_split * GROUP
    k_stop = tl.minimum(k_start + groups_per_split * GROUP, K)
    for r0 in range(0, R, BLOCK_R):  # row tiles: a row's sums never depend on the rows beside it
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < R
        x_rows = x_ptr + r.to(tl.int64)[:, None] * K
        acc = tl.zeros([BLOCK_R, BLOCK_N, GROUP], tl.float32)
        for k0 in range(k_start, k_stop, GROUP):
            w = _dequant(w_ptr, row_at, n_ok, k0, K, TYPE, EXACT)
            k = k0 + j
            x = tl.load(x_rows + k[None, :], mask=r_ok[:, None] & (k < K)[None, :], other=0.0)
            acc = tl.fma(tl.broadcast_to(x[:, None, :], (BLOCK_R, BLOCK_N, GROUP)),
                         tl.broadcast_to(w[None, :, :], (BLOCK_R, BLOCK_N, GROUP)), acc)
        out = _sum_groups(acc, BLOCK_R, BLOCK_N)
        if has_bias != 0:
            out += tl.load(bias_ptr + n, mask=n_ok, other=0.0)[None, :]
        out_at = split.to(tl.int64) * stride_out_split + r.to(tl.int64)[:, None] * stride_out_row + n[None, :]
        tl.store(out_ptr + out_at, out, mask=r_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=_RUNTIME)
def _gemm_kernel(
    x_ptr,      # [R, K] float32 contiguous: the activations
    w_ptr,      # [N, row_stride] the part's rows (see the terms)
    bias_ptr,   # [N] float32 (read when has_bias)
    out_ptr,    # [splits, R, *] float32: out_ptr + split * stride_out_split + r * stride_out_row + n
    R, N, K, row_stride, groups_per_split, stride_out_split, stride_out_row, has_bias,
    TYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, EXACT: tl.constexpr,
):
    n_tiles = tl.cdiv(N, BLOCK_N)
    n = (tl.program_id(0) % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = (tl.program_id(0) // n_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    split = tl.program_id(1)
    n_ok = n < N
    r_ok = r < R
    row_at = tl.where(n_ok, n, 0).to(tl.int64) * row_stride
    x_rows = x_ptr + r.to(tl.int64)[:, None] * K
    j = tl.arange(0, GROUP)
    k_start = split * groups_per_split * GROUP
    k_stop = tl.minimum(k_start + groups_per_split * GROUP, K)
    acc = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_stop, GROUP):
        w = _dequant(w_ptr, row_at, n_ok, k0, K, TYPE, EXACT)
        k = k0 + j
        x = tl.load(x_rows + k[None, :], mask=r_ok[:, None] & (k < K)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    if has_bias != 0:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0)[None, :]
    out_at = split.to(tl.int64) * stride_out_split + r.to(tl.int64)[:, None] * stride_out_row + n[None, :]
    tl.store(out_ptr + out_at, acc, mask=r_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["R", "N", "splits", "stride_out_row", "has_bias"])
def _combine_kernel(
    part_ptr,   # [splits, R, N] float32: the splits' partial sums
    bias_ptr,   # [N] float32 (read when has_bias)
    out_ptr,    # [R, *] float32: out_ptr + r * stride_out_row + n
    R, N, splits, stride_out_row, has_bias,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    total = tl.load(part_ptr + r * N + n, mask=ok, other=0.0)
    for s in range(1, splits):
        total += tl.load(part_ptr + (s * R + r) * N + n, mask=ok, other=0.0)
    if has_bias != 0:
        total += tl.load(bias_ptr + n, mask=ok, other=0.0)
    tl.store(out_ptr + r * stride_out_row + n, total, mask=ok)


@triton.jit(do_not_specialize=["M", "start", "rows"])
def _rows_kernel(
    ids_ptr,    # [M] int64: rows of the whole matrix
    w_ptr,      # [rows, row_stride] the part's rows (see the terms), matrix rows start .. start + rows - 1
    out_ptr,    # [M, K] float32: row i the dequantized row ids[i] (written where it falls in the part)
    M, K, row_stride, start, rows,
    TYPE: tl.constexpr, BLOCK_IDS: tl.constexpr, GROUPS: tl.constexpr, EXACT: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK_IDS + tl.arange(0, BLOCK_IDS)
    i_ok = i < M
    local = tl.load(ids_ptr + i, mask=i_ok, other=-1) - start
    mine = i_ok & (local >= 0) & (local < rows)
    row_at = tl.where(mine, local, 0) * row_stride
    j = tl.arange(0, GROUP)
    out_rows = out_ptr + i.to(tl.int64)[:, None] * K
    for gi in tl.static_range(GROUPS):
        k0 = (tl.program_id(1) * GROUPS + gi) * GROUP
        w = _dequant(w_ptr, row_at, mine, k0, K, TYPE, EXACT)
        k = k0 + j
        tl.store(out_rows + k[None, :], w, mask=mine[:, None] & (k < K)[None, :])


# ---- launch plans ---------------------------------------------------------------------------------

def plan(R: int, N: int, K: int, gemm: bool, matrix_rows: int | None = None) -> dict:
    """The launch of one part's product, R activation rows by N weight rows of K weights, as a
    GEMM or not (the caller's decision, by tokens per row), the part being rows of a matrix of
    matrix_rows rows (None: N, the part is the matrix): kernel ("gemv" or "gemm"), BLOCK_R,
    BLOCK_N, num_warps, splits of K, groups_per_split, grid. The kernel follows gemm and the split
    (matrix_rows, K) alone, so a row's result depends neither on R nor on the part it lies in (see
    the module docstring)."""
    M = N if matrix_rows is None else matrix_rows
    groups = triton.cdiv(K, GROUP.value)
    if not gemm:
        kernel, block_r, warps = "gemv", min(triton.next_power_of_2(max(R, 1)), GEMV_BLOCK_R), NUM_WARPS
        block_n = min(GEMV_BLOCK_N, GEMV_TILE // block_r)
        splits = max(1, min(triton.cdiv(TARGET_PROGRAMS, triton.cdiv(M, SPLIT_BLOCK_N)), groups // MIN_SPLIT_GROUPS))
        r_tiles = 1  # looped over in the program
    else:
        kernel, block_r, warps = "gemm", GEMM_BLOCK_R, GEMM_WARPS
        block_n, r_tiles, splits = GEMM_BLOCK_N, triton.cdiv(R, block_r), 1
    groups_per_split = triton.cdiv(groups, splits)
    splits = triton.cdiv(groups, groups_per_split)  # none empty
    return dict(kernel=kernel, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=warps, splits=splits,
                groups_per_split=groups_per_split, grid=(r_tiles * triton.cdiv(N, block_n), splits))


def rows_grid(M: int, K: int) -> tuple[int, int]:
    """_rows_kernel's grid for M ids of K weights."""
    return triton.cdiv(M, ROWS_BLOCK_IDS), triton.cdiv(triton.cdiv(K, GROUP.value), ROWS_GROUPS)
