"""One attention layer over a static KV cache, after the q/k/v projections.

For a batch of rows that each append T tokens at their own positions (decode, verification
or prefill): rotate q and k (Llama rotate-half), write k and v into the cache at the tokens'
positions, and let every query attend to the cache keys at or before its own position
(within the sliding window, if any). Rolled-back drafts need nothing: their stale entries lie
past the row's length and no query sees them until they are overwritten.

  "cpp"        specengine._C.cached_attention: float32 on a CPU, one call instead of ~10 torch
               ops that cost 0.5 ms per layer of the shipped models (dispatch, not arithmetic)
  "triton"     specengine.kernels: rotary and the cache write in one launch, then split-KV
               attention and its merge (three launches; the model's path on CUDA)
  "reference"  torch ops and scaled_dot_product_attention (the oracle; every other device/dtype)

Qwen3's per-head q/k norms go before the rotary embedding; the Triton path applies them inside
its rotary launch (q_norm, k_norm), the others leave them to the caller.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

IMPLEMENTATIONS = ("cpp", "triton", "reference")
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, head_dim]; cos, sin [B, T, head_dim]. Rotate-half convention of Llama."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attention_mask(positions: torch.Tensor, kv_len: int, sliding_window: int | None) -> torch.Tensor:
    """[B, 1, T, kv_len] bool: key j is visible to the query at positions[b, t] (shared by all layers)."""
    key_pos = torch.arange(kv_len, device=positions.device)
    mask = key_pos <= positions[..., None]
    if sliding_window is not None:
        mask &= key_pos > positions[..., None] - sliding_window
    return mask[:, None]


def cached_attention(
    q: torch.Tensor,          # [B, T, H, D] queries before the rotary embedding
    k: torch.Tensor,          # [B, T, Hkv, D] new keys before the rotary embedding
    v: torch.Tensor,          # [B, T, Hkv, D] new values
    cos: torch.Tensor,        # [B, T, D] rotary tables at the tokens' positions
    sin: torch.Tensor,        # [B, T, D]
    positions: torch.Tensor,  # [B, T] int64, absolute position of each new token
    cache_k: torch.Tensor,    # [B_alloc >= B, capacity + 1, Hkv, D] one layer's keys, rows in use first (written)
    cache_v: torch.Tensor,    # [B_alloc, capacity + 1, Hkv, D] one layer's values (written)
    kv_len: int,              # keys that may be visible: max(positions) + 1, clipped to capacity
    sliding_window: int | None = None,
    impl: str = "reference",
) -> torch.Tensor:
    """Attention output [B, T, H * D]. Positions at or past capacity (padding) write to the spill
    slot `capacity`, which no query reads."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"cached_attention: impl must be one of {IMPLEMENTATIONS}, got {impl!r}")

    def check(cond: bool, message: str):
        if not cond:
            raise ValueError(f"cached_attention: {message}")

    check(q.dim() == 4, f"q must be [B, T, H, D], got {tuple(q.shape)}")
    B, T, H, D = q.shape
    check(k.dim() == 4 and k.shape[:2] == (B, T) and k.shape[3] == D, f"k must be [{B}, {T}, Hkv, {D}], got "
          f"{tuple(k.shape)}")
    Hkv = k.shape[2]
    check(Hkv >= 1 and H % Hkv == 0, f"query heads ({H}) must be a multiple of kv heads ({Hkv})")
    check(v.shape == k.shape, f"v must be {tuple(k.shape)}, got {tuple(v.shape)}")
    check(D % 2 == 0, f"head_dim must be even for the rotary embedding, got {D}")
    for name, t in (("cos", cos), ("sin", sin)):
        check(t.shape == (B, T, D), f"{name} must be [{B}, {T}, {D}], got {tuple(t.shape)}")
    check(positions.shape == (B, T) and positions.dtype == torch.int64,
          f"positions must be [{B}, {T}] int64, got {tuple(positions.shape)} {positions.dtype}")
    check(cache_k.dim() == 4 and cache_k.shape[0] >= B and cache_k.shape[2:] == (Hkv, D),
          f"cache_k must be [>= {B}, capacity + 1, {Hkv}, {D}], got {tuple(cache_k.shape)}")
    check(cache_v.shape == cache_k.shape, f"cache_v must be {tuple(cache_k.shape)}, got {tuple(cache_v.shape)}")
    capacity = cache_k.shape[1] - 1
    check(1 <= kv_len <= capacity, f"kv_len must be in [1, capacity={capacity}], got {kv_len}")
    check(sliding_window is None or sliding_window >= 1, f"sliding_window must be >= 1, got {sliding_window}")
    check(B == 0 or int(positions.min()) >= 0, "positions must be >= 0")
    if impl == "triton":
        check(cache_k.is_contiguous() and cache_v.is_contiguous(), "cache_k and cache_v must be contiguous")
        check(all(t.dtype == cache_k.dtype for t in (q, k, v, cos, sin, cache_v)),
              "impl 'triton' needs q, k, v, cos, sin and the cache in one dtype")
        q, k, v = (t if token_stride(t) is not None else t.contiguous() for t in (q, k, v))
        return cached_attention_triton(q, k, v, cos.contiguous(), sin.contiguous(), positions.contiguous(), cache_k,
                                       cache_v, kv_len, sliding_window)
    if impl == "reference":
        return cached_attention_reference(q, k, v, cos, sin, positions, cache_k, cache_v, kv_len,
                                          attention_mask(positions, kv_len, sliding_window))
    tensors = dict(q=q, k=k, v=v, cos=cos, sin=sin, cache_k=cache_k, cache_v=cache_v)
    for name, t in tensors.items():
        check(t.dtype == torch.float32 and t.device.type == "cpu",
              f"impl 'cpp' needs float32 CPU tensors, got {name} {t.dtype} on {t.device}")
    check(cache_k.is_contiguous() and cache_v.is_contiguous(), "cache_k and cache_v must be contiguous")
    check(positions.device.type == "cpu", "positions must be a CPU tensor")
    q, k, v = (t if token_stride(t) is not None else t.contiguous() for t in (q, k, v))
    return cached_attention_cpp(q, k, v, cos.contiguous(), sin.contiguous(), positions.contiguous(), cache_k,
                                cache_v, kv_len, sliding_window)


def cached_attention_reference(q, k, v, cos, sin, positions, cache_k, cache_v, kv_len: int,
                               mask: torch.Tensor) -> torch.Tensor:
    """The torch composite; mask [B, 1, T, kv_len] from attention_mask (built once per forward)."""
    B, T, H, D = q.shape
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    slots = positions.clamp(max=cache_k.shape[1] - 1)
    rows = torch.arange(B, device=positions.device)[:, None]
    cache_k[rows, slots] = k
    cache_v[rows, slots] = v
    keys, values = cache_k[:B, :kv_len], cache_v[:B, :kv_len]
    # On CUDA, not cuDNN's attention: it builds an execution plan for every new shape, and decoding
    # changes kv_len every step (on an H200 that made an eager round 8x slower than its
    # fixed-shape forwards).
    with sdpa_kernel(_CUDA_SDPA_BACKENDS) if q.is_cuda else nullcontext():
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask, enable_gqa=k.shape[2] != H)
    return out.transpose(1, 2).reshape(B, T, H * D)


def token_stride(x: torch.Tensor) -> int | None:
    """Elements between consecutive tokens of x [B, T, heads, D], if its heads are contiguous and
    one stride steps through all B * T tokens (a contiguous tensor, or a column block of a packed
    [B, T, N] projection output); else None. (Size-1 dimensions may carry any stride.)"""
    B, T, heads, D = x.shape
    if (D > 1 and x.stride(3) != 1) or (heads > 1 and x.stride(2) != D):
        return None
    if T == 1:
        return x.stride(0)
    return x.stride(1) if B == 1 or x.stride(0) == T * x.stride(1) else None


def cached_attention_triton(q, k, v, cos, sin, positions, cache_k, cache_v, kv_len: int, sliding_window: int | None,
                            q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                            eps: float = 1e-6) -> torch.Tensor:
    """The Triton kernels without argument checks, for model layers: tensors of one dtype on one
    device, q, k and v with a token_stride, the rest contiguous; q_norm, k_norm [D] or None."""
    from ..kernels.attention import decode_attention_triton
    from ..kernels.rotary import rope_write_triton

    q_rotated = rope_write_triton(q, k, v, (token_stride(q), token_stride(k), token_stride(v)), cos, sin, positions,
                                  cache_k, cache_v, q_norm, k_norm, eps)
    return decode_attention_triton(q_rotated, cache_k, cache_v, positions, kv_len, sliding_window)


def cached_attention_cpp(q, k, v, cos, sin, positions, cache_k, cache_v, kv_len: int,
                         sliding_window: int | None) -> torch.Tensor:
    """The C++ op without argument checks, for model layers: float32 CPU tensors as above, q, k
    and v with a token_stride, the rest contiguous."""
    from .. import _C

    B, T, H, D = q.shape
    out = torch.empty((B, T, H * D), dtype=torch.float32)
    _C.cached_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), token_stride(q), token_stride(k), token_stride(v),
                        cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(),
                        out.data_ptr(), B, T, H, k.shape[2], D, cache_k.shape[1] - 1, cache_k.stride(0), kv_len,
                        sliding_window or 0)
    return out
