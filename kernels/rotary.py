"""Rotary embedding fused with the K/V write into the static cache, in Triton: one launch per layer.

One program per new token: its query heads are (optionally RMS-normalised per head, Qwen3's
q_norm, then) rotated into a contiguous q; its key heads are normalised (k_norm) and rotated, and
keys and values written into the cache at the token's position (a padding position at or past
the capacity goes to the spill slot, as in the torch path). Rotate-half convention of Llama;
the half-rotated operand is a second load at permuted offsets rather than a register shuffle.
Oracle: specengine.ops.attention.apply_rope and the cache write of cached_attention_reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, heads, D, cos, sin, norm_ptr, eps, HAS_NORM: tl.constexpr,
                  HEADS: tl.constexpr, BLOCK_D: tl.constexpr):
    """dst[h, :] = rope(norm(src[h, :])) for h < heads; src and dst hold heads of D contiguous."""
    h = tl.arange(0, HEADS)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    half = D // 2
    partner = tl.where(d < half, d + half, d - half)  # rotate-half: [-x2, x1]
    mask = (h < heads) & (d < D)
    x = tl.load(src_ptr + h * D + d, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(src_ptr + h * D + partner, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # per head over D, rounded to the input dtype before the weight (transformers)
        rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
        dtype = src_ptr.dtype.element_ty
        w = tl.load(norm_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        w_partner = tl.load(norm_ptr + partner, mask=d < D, other=0.0).to(tl.float32)
        x = (w * (x * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x_partner = (w_partner * (x_partner * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    rotated = tl.where(d < half, -x_partner, x_partner)
    tl.store(dst_ptr + h * D + d, (x * cos + rotated * sin).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T", "H", "Hkv", "D", "capacity", "stride_row", "stride_q", "stride_k",
                               "stride_v", "eps"])
def _rope_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, positions_ptr, q_out_ptr, cache_k_ptr, cache_v_ptr,
                       q_norm_ptr, k_norm_ptr, T, H, Hkv, D, capacity, stride_row, stride_q, stride_k, stride_v, eps,
                       HAS_NORM: tl.constexpr, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    b = token // T
    slot = tl.minimum(tl.load(positions_ptr + token), capacity)
    d = tl.arange(0, BLOCK_D)[None, :]
    cos = tl.load(cos_ptr + token * D + d, mask=d < D, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * D + d, mask=d < D, other=0.0).to(tl.float32)
    cache_at = (b * stride_row + slot * Hkv * D)
    _rotate_heads(q_ptr + token * stride_q, q_out_ptr + token * H * D, H, D, cos, sin, q_norm_ptr, eps, HAS_NORM,
                  Q_HEADS, BLOCK_D)
    _rotate_heads(k_ptr + token * stride_k, cache_k_ptr + cache_at, Hkv, D, cos, sin, k_norm_ptr, eps, HAS_NORM,
                  KV_HEADS, BLOCK_D)
    h = tl.arange(0, KV_HEADS)[:, None]
    mask = (h < Hkv) & (d < D)
    tl.store(cache_v_ptr + cache_at + h * D + d, tl.load(v_ptr + token * stride_v + h * D + d, mask=mask, other=0.0),
             mask=mask)


def rope_write_triton(
    q: torch.Tensor,          # [B, T, H, D] before the rotary embedding, heads contiguous
    k: torch.Tensor,          # [B, T, Hkv, D] likewise (views of the packed qkv output are fine)
    v: torch.Tensor,          # [B, T, Hkv, D] likewise
    token_strides: tuple[int, int, int],  # elements between consecutive tokens of q, k and v
    cos: torch.Tensor,        # [B, T, D] contiguous
    sin: torch.Tensor,        # [B, T, D] contiguous
    positions: torch.Tensor,  # [B, T] int64 contiguous
    cache_k: torch.Tensor,    # [B_alloc >= B, capacity + 1, Hkv, D] contiguous, written
    cache_v: torch.Tensor,    # [B_alloc, capacity + 1, Hkv, D] contiguous, written
    q_norm: torch.Tensor | None,  # [D] Qwen3's per-head norms, or None
    k_norm: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """The rotated queries [B, T, H, D] (contiguous); keys (rotated) and values land in the cache."""
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    q_out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    if B * T:
        _rope_write_kernel[(B * T,)](
            q, k, v, cos, sin, positions, q_out, cache_k, cache_v, q_norm if q_norm is not None else cos,
            k_norm if k_norm is not None else cos, T, H, Hkv, D, cache_k.shape[1] - 1, cache_k.stride(0),
            *token_strides, eps, HAS_NORM=q_norm is not None, Q_HEADS=triton.next_power_of_2(H),
            KV_HEADS=triton.next_power_of_2(Hkv), BLOCK_D=triton.next_power_of_2(D))
    return q_out
