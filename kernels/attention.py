"""Attention of 1..G+1 new query tokens per row over the static KV cache, in Triton, split over the
KV length and merged (SGLang's decode attention: split-KV, then merge).

  _split_kernel  (B * q_blocks, Hkv, splits)  one KV head's keys in one split of the positions,
                                   for one block of at most MAX_Q_ROWS of the row's query rows
                                   (token t, head g of the group at row t * group + g): the rows
                                   of a block share every K/V load; each query sees keys at or
                                   before its own position (and within the sliding window); per
                                   query, a partial softmax (max, sum) and its weighted values
  _merge_kernel  (B * T, H)        the splits of one query combined, in the output dtype

A decoding or verification step (T * group <= MAX_Q_ROWS) is one block per KV head; a prompt
is cut into blocks, so its rows never outgrow one program's registers and shared memory however
long it is. Per-row positions come from a device tensor; the grid depends only on (B, T, group,
Hkv, kv_len), so one graph-captured step keeps it, and splits past a block's last position return
at once. Oracle: specengine.ops.attention.cached_attention_reference (its attention part).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_N = 64            # keys per step of a split
# Query rows per program. A float32 dot (float32 models: exact, no TF32) runs on FMAs with its
# operands in registers: 64 rows at head_dim 128 spilled 9.6 KB per thread on sm_90, 16 rows about
# 0.5 KB (tests/compile_triton.py reports registers, spills and shared memory of the largest blocks).
MAX_Q_ROWS = 64
MAX_Q_ROWS_FP32 = 16
MIN_DOT = 16            # a compiled tl.dot needs M, N and K of at least 16 (the interpreter takes any)
TARGET_PROGRAMS = 256   # splits are added until B * Hkv * splits reaches about this (fills an H100/H200)
MAX_SPLITS = 64


# The group size is a runtime argument: each model's group would otherwise compile its own kernel
# (seconds of ptxas each), and a division by it costs a few instructions per block of rows.
@triton.jit(do_not_specialize=["T", "H", "Hkv", "kv_len", "split_len", "splits", "stride_row", "window", "group"])
def _split_kernel(q_ptr, k_ptr, v_ptr, positions_ptr, m_ptr, l_ptr, acc_ptr, T, H, Hkv, kv_len, split_len, splits,
                  stride_row, window, scale, group, Q_ROWS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):
    q_blocks = tl.cdiv(T * group, Q_ROWS)
    b = tl.program_id(0).to(tl.int64) // q_blocks
    q_block = tl.program_id(0) % q_blocks
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Query rows of this program: token t, head kv_head * group + g for row i = t * group + g.
    i = q_block * Q_ROWS + tl.arange(0, Q_ROWS)
    t = i // group
    head = kv_head * group + i % group
    row_ok = t < T
    d = tl.arange(0, BLOCK_D)
    # Positions and offsets within a row's cache in int32 (capacity * Hkv * D stays below 2^31):
    # [rows, keys] masks and [keys, D] offsets in int64 would need about half as many registers
    # again on sm_90 (tests/compile_triton.py reports them).
    q_pos = tl.load(positions_ptr + b * T + t, mask=row_ok, other=-1).to(tl.int32)
    # Padding queries (positions at or past kv_len: the spill slot's) do not widen the span: a
    # padded bucket of a CUDA graph would otherwise read its rows' whole capacity.
    real = row_ok & (q_pos < kv_len)
    last = tl.max(tl.where(real, q_pos, -1), 0)  # the last key any of them may see
    # The first key any of them may see (within the window of the earliest query).
    first = tl.where(window > 0, tl.maximum(tl.min(tl.where(real, q_pos, 2**30), 0) - window + 1, 0), 0)
    start = split * split_len
    stop = tl.minimum(start + split_len, last + 1)
    m_i = tl.full([Q_ROWS], -float("inf"), tl.float32)
    l_i = tl.zeros([Q_ROWS], tl.float32)
    acc = tl.zeros([Q_ROWS, BLOCK_D], tl.float32)
    if (start <= last) & (start + split_len > first):
        q_at = ((b * T + t) * H + head)[:, None] * D + d[None, :]
        q = tl.load(q_ptr + q_at, mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        k_row = k_ptr + b * stride_row  # the row's cache, then int32 offsets within it
        v_row = v_ptr + b * stride_row
        for n0 in range(start, stop, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            kv_at = (n * Hkv + kv_head)[:, None] * D + d[None, :]
            kv_ok = (n < stop)[:, None] & (d[None, :] < D)
            k = tl.load(k_row + kv_at, mask=kv_ok, other=0.0)
            v = tl.load(v_row + kv_at, mask=kv_ok, other=0.0)
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            visible = (n[None, :] <= q_pos[:, None]) & (n[None, :] < stop)
            if window > 0:
                visible &= n[None, :] > q_pos[:, None] - window
            s = tl.where(visible, s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # Rows with nothing visible yet keep m = -inf; they subtract 0 instead (exp(-inf) = 0,
            # where -inf - -inf would be NaN).
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.where(visible, tl.exp(s - m_safe[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, 1)
            if DOT_FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
    out = ((b * T + t) * H + head) * splits + split
    tl.store(m_ptr + out, m_i, mask=row_ok)
    tl.store(l_ptr + out, l_i, mask=row_ok)
    tl.store(acc_ptr + out[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & (d[None, :] < D))


@triton.jit(do_not_specialize=["splits"])
def _merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, splits, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  SPLITS: tl.constexpr):
    query = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)  # (token, head)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    ok = s < splits
    m = tl.load(m_ptr + query * splits + s, mask=ok, other=-float("inf"))
    l = tl.load(l_ptr + query * splits + s, mask=ok, other=0.0)
    acc = tl.load(acc_ptr + (query * splits + s)[:, None] * D + d[None, :], mask=ok[:, None] & (d[None, :] < D),
                  other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m == -float("inf"), 0.0, tl.exp(m - tl.where(m_max == -float("inf"), 0.0, m_max)))
    total = tl.sum(w * l, 0)
    # A padding query whose split saw nothing gets zeros, never NaN (its logits are read, not used).
    out = tl.where(total > 0.0, tl.sum(w[:, None] * acc, 0) / tl.where(total > 0.0, total, 1.0), 0.0)
    tl.store(out_ptr + query * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def split_count(B: int, Hkv: int, kv_len: int, q_blocks: int = 1) -> int:
    """Splits of the KV length: enough programs to fill the GPU, at least BLOCK_N keys each. A
    prompt's many query blocks fill it alone (and keep its partials [B, T, H, splits, D] small)."""
    return max(1, min(MAX_SPLITS, triton.cdiv(kv_len, BLOCK_N), triton.cdiv(TARGET_PROGRAMS, B * Hkv * q_blocks)))


def query_rows(T: int, group: int, dot_fp32: bool = False) -> tuple[int, int]:
    """(rows per program, query blocks per KV head) for T tokens of `group` query heads each."""
    rows = min(MAX_Q_ROWS_FP32 if dot_fp32 else MAX_Q_ROWS, max(MIN_DOT, triton.next_power_of_2(T * group)))
    return rows, triton.cdiv(T * group, rows)


def split_warps(q_rows: int, block_d: int) -> int:
    """Warps of a split program: 8 for a prompt's blocks at head_dim 128 (at 4 their [64, 128]
    tiles spill about a kilobyte per thread on sm_90; at 8, a tenth of that), else 4."""
    return 8 if q_rows * block_d >= MAX_Q_ROWS * 128 else 4


def decode_attention_triton(
    q: torch.Tensor,          # [B, T, H, D] rotated queries, contiguous
    cache_k: torch.Tensor,    # [B_alloc >= B, capacity + 1, Hkv, D] contiguous, this step's keys written
    cache_v: torch.Tensor,    # [B_alloc, capacity + 1, Hkv, D] contiguous
    positions: torch.Tensor,  # [B, T] int64 contiguous, each query's position
    kv_len: int,              # keys that may be visible: max(positions) + 1, clipped to capacity
    sliding_window: int | None,
) -> torch.Tensor:
    """Attention output [B, T, H * D] in q's dtype (scale 1 / sqrt(D), GQA by head groups)."""
    B, T, H, D = q.shape
    Hkv = cache_k.shape[2]
    group = H // Hkv
    # The interpreter's dot is float32 only; compiled, a float32 dot must not round through TF32.
    dot_fp32 = q.dtype == torch.float32 or q.device.type != "cuda"
    # Blocks as compiled for q's dtype, in the interpreter too (which then runs the same grid).
    q_rows, q_blocks = query_rows(T, group, q.dtype == torch.float32)
    splits = split_count(B, Hkv, kv_len, q_blocks)
    split_len = triton.cdiv(triton.cdiv(kv_len, splits), BLOCK_N) * BLOCK_N
    f32 = dict(dtype=torch.float32, device=q.device)
    m, l = torch.empty(B, T, H, splits, **f32), torch.empty(B, T, H, splits, **f32)
    acc = torch.empty(B, T, H, splits, D, **f32)
    out = torch.empty(B, T, H * D, dtype=q.dtype, device=q.device)
    if B * T == 0:
        return out
    block_d = max(MIN_DOT, triton.next_power_of_2(D))  # K of q @ k^T, N of p @ v
    _split_kernel[(B * q_blocks, Hkv, splits)](
        q, cache_k, cache_v, positions, m, l, acc, T, H, Hkv, kv_len, split_len, splits, cache_k.stride(0),
        sliding_window or 0, 1.0 / math.sqrt(D), group, Q_ROWS=q_rows, D=D, BLOCK_D=block_d,
        BLOCK_N=BLOCK_N, DOT_FP32=dot_fp32, num_warps=split_warps(q_rows, block_d))
    _merge_kernel[(B * T, H)](m, l, acc, out, splits, D=D, BLOCK_D=block_d, SPLITS=triton.next_power_of_2(splits))
    return out
