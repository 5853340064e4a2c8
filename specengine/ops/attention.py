"""One attention layer over a static KV cache, after the q/k/v projections.

For a batch of rows that each append T tokens at their own positions (decode, verification
or prefill): rotate q and k (Llama rotate-half), write k and v into the cache at the tokens'
positions, and let every query attend to the cache keys at or before its own position
(within the sliding window, if any). Rolled-back drafts need nothing: their stale entries lie
past the row's length and no query sees them until they are overwritten. Positions a row never
wrote hold whatever memory the cache was given (layers.kv_cache): "cpp" and "triton" never use a
key past a query's position, and "reference", which attends over a rectangle, zeroes what no
query of a row sees first (seen_entries).

  "cpp"        specengine._C.cached_attention: float32 on a CPU, one call instead of ~10 torch
               ops whose dispatch, not arithmetic, dominates at the shipped models' sizes
               (measured: see bench/results/kernel-tuning-2026-11-29-to-12-03.md); each
               query's bits are the same whatever call it comes in (csrc/layers.h)
  "triton"     specengine.kernels: rotary and the cache write in one launch, then split-KV
               attention and its merge (three launches; the model's path on CUDA)
  "reference"  torch ops and scaled_dot_product_attention (the oracle; every other device/dtype)

Qwen3's per-head q/k norms (q_norm, k_norm) go before the rotary embedding: the Triton path
applies them inside its rotary launch, the others with ops.norm's op of the same impl first.

T5 (relative_attention) has no rotary embedding and no scale: a learned bias by the key's distance
back is added to each score instead, and its cross-attention reads the encoder's cached keys up to
each row's last source token. "cpp" (specengine._C.relative_attention) or "reference" (torch).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .norm import rms_norm

IMPLEMENTATIONS = ("cpp", "triton", "reference")
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _checker(op: str):
    """check(cond, message): a ValueError naming the op and the problem unless cond holds."""
    def check(cond: bool, message: str):
        if not cond:
            raise ValueError(f"{op}: {message}")
    return check


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
    *,
    q_norm: torch.Tensor | None = None,  # [D]: Qwen3's per-head RMSNorm of q and k before the rotary
    k_norm: torch.Tensor | None = None,  # [D]
    norm_eps: float = 1e-6,
    mask: torch.Tensor | None = None,    # "reference": attention_mask(positions, kv_len, sliding_window), if built
    check: bool = True,
) -> torch.Tensor:
    """Attention output [B, T, H * D]. Positions at or past capacity (padding) write to the spill
    slot `capacity`, which no query reads. Without check (the models' calls), q, k and v must
    have a token_stride and cos, sin and positions be contiguous; "triton" needs one dtype."""
    if check:
        q, k, v, cos, sin, positions = _checked_attention(q, k, v, cos, sin, positions, cache_k, cache_v, kv_len,
                                                          sliding_window, impl, q_norm, k_norm)
    if impl == "triton":  # the q/k norms inside the rotary launch
        return cached_attention_triton(q, k, v, cos, sin, positions, cache_k, cache_v, kv_len, sliding_window,
                                       q_norm, k_norm, norm_eps)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, norm_eps, impl, check=False), rms_norm(k, k_norm, norm_eps, impl, check=False)
    if impl == "cpp":
        return cached_attention_cpp(q, k, v, cos, sin, positions, cache_k, cache_v, kv_len, sliding_window)
    if mask is None:
        mask = attention_mask(positions, kv_len, sliding_window)
    return cached_attention_reference(q, k, v, cos, sin, positions, cache_k, cache_v, kv_len, mask)


def _checked_attention(q, k, v, cos, sin, positions, cache_k, cache_v, kv_len, sliding_window, impl, q_norm, k_norm):
    """cached_attention's arguments checked and in the layout impl needs: (q, k, v, cos, sin, positions)."""
    check = _checker("cached_attention")
    check(impl in IMPLEMENTATIONS, f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
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
    check((q_norm is None) == (k_norm is None), "q_norm and k_norm come together")
    check(q_norm is None or (tuple(q_norm.shape) == (D,) and tuple(k_norm.shape) == (D,)),
          f"q_norm and k_norm must be [{D}]")
    if impl == "reference":
        return q, k, v, cos, sin, positions
    if impl == "triton":
        check(all(t.dtype == cache_k.dtype for t in (q, k, v, cos, sin, cache_v)),
              "impl 'triton' needs q, k, v, cos, sin and the cache in one dtype")
    else:
        tensors = dict(q=q, k=k, v=v, cos=cos, sin=sin, cache_k=cache_k, cache_v=cache_v, q_norm=q_norm, k_norm=k_norm)
        for name, t in tensors.items():
            if t is not None:
                check(t.dtype == torch.float32 and t.device.type == "cpu",
                      f"impl 'cpp' needs float32 CPU tensors, got {name} {t.dtype} on {t.device}")
        check(positions.device.type == "cpu", "positions must be a CPU tensor")
    check(cache_k.is_contiguous() and cache_v.is_contiguous(), "cache_k and cache_v must be contiguous")
    q, k, v = (t if token_stride(t) is not None else t.contiguous() for t in (q, k, v))
    return q, k, v, cos.contiguous(), sin.contiguous(), positions.contiguous()


def cached_attention_reference(q, k, v, cos, sin, positions, cache_k, cache_v, kv_len: int,
                               mask: torch.Tensor) -> torch.Tensor:
    """The torch composite; mask [B, 1, T, kv_len] from attention_mask (built once per forward)."""
    B, T, H, D = q.shape
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    slots = positions.clamp(max=cache_k.shape[1] - 1)
    rows = torch.arange(B, device=positions.device)[:, None]
    cache_k[rows, slots] = k
    cache_v[rows, slots] = v
    keys, values = seen_entries(cache_k[:B, :kv_len], mask), seen_entries(cache_v[:B, :kv_len], mask)
    # On CUDA, not cuDNN's attention: it builds an execution plan for every new shape, and decoding
    # changes kv_len every step (bench/results/gpu-h200-2026-11-29.md, "cuDNN attention and
    # changing shapes").
    with sdpa_kernel(_CUDA_SDPA_BACKENDS) if q.is_cuda else nullcontext():
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask, enable_gqa=k.shape[2] != H)
    return out.transpose(1, 2).reshape(B, T, H * D)


def seen_entries(entries: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """entries [B, S, heads, D] of a cache's rows, zero at the positions no query of the row sees;
    visible [B or 1, H or 1, T, S] bool. The torch paths attend over every row's first S positions
    (a rectangle, S the call's longest) and mask the rest, but a masked entry that holds NaN or inf
    still counts: its score comes out NaN (NaN - inf, inf - inf), and a weight of 0 times a NaN
    value is NaN. A cache's memory is not zeroed, so what a row has not written may hold anything
    (layers.kv_cache); zeroed, a masked entry adds exactly nothing, as a stale one did."""
    seen = visible.flatten(1, 2).any(1)  # [B, S]
    return entries.masked_fill(~seen[:, :, None, None], 0)


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


# ---- T5: relative position bias, no rotary embedding, no scale -----------------------------------

def relative_attention(
    q: torch.Tensor,                  # [B, T, H, D] queries
    k: torch.Tensor | None,           # [B, T, H, D] new keys to write at `positions` (None: cross-attention)
    v: torch.Tensor | None,           # [B, T, H, D] new values (None with k)
    positions: torch.Tensor,          # [B, T] int64: each query sees keys 0..positions[b, t]
    cache_k: torch.Tensor,            # [B_alloc >= B, slots, H, D] one layer's keys, rows in use first
    cache_v: torch.Tensor,            # [B_alloc, slots, H, D] one layer's values
    kv_len: int,                      # keys that may be visible (<= slots; with k, <= capacity = slots - 1)
    bias_table: torch.Tensor | None,  # [n > max(positions), H]: the bias of a key d positions back (None: none)
    impl: str = "reference",
    *,
    bias: torch.Tensor | None = None,  # "reference": relative_bias(positions, kv_len, bias_table, q.dtype), if built
    check: bool = True,
) -> torch.Tensor:
    """T5 attention output [B, T, H * D]: softmax(q . k_j + bias_table[p - j]) over keys j <= p,
    j < kv_len (scores unscaled: T5 folds the scale into its weights). With k and v, the new
    tokens' keys and values are first written at their positions (positions at or past the
    capacity go to the spill slot), so a query also sees its own call's keys. Implementations:
    "cpp" or "reference" (check=False: the models' calls, with q (k, v) of a token_stride and
    the rest contiguous)."""
    if check:
        q, k, v, positions, bias_table = _checked_relative_attention(q, k, v, positions, cache_k, cache_v, kv_len,
                                                                     bias_table, impl)
    if impl == "cpp":
        return relative_attention_cpp(q, k, v, positions, cache_k, cache_v, kv_len, bias_table)
    if bias is None:
        bias = relative_bias(positions, kv_len, bias_table, q.dtype)
    return relative_attention_reference(q, k, v, positions, cache_k, cache_v, kv_len, bias)


def _checked_relative_attention(q, k, v, positions, cache_k, cache_v, kv_len, bias_table, impl):
    """relative_attention's arguments checked and in the layout impl needs: (q, k, v, positions, bias_table)."""
    check = _checker("relative_attention")
    check(impl in ("cpp", "reference"), f"impl must be 'cpp' or 'reference', got {impl!r}")
    check(q.dim() == 4, f"q must be [B, T, H, D], got {tuple(q.shape)}")
    B, T, H, D = q.shape
    check((k is None) == (v is None), "give both k and v, or neither")
    for name, t in (("k", k), ("v", v)):
        if t is not None:
            check(t.shape == q.shape, f"{name} must be {tuple(q.shape)}, got {tuple(t.shape)}")
    check(positions.shape == (B, T) and positions.dtype == torch.int64,
          f"positions must be [{B}, {T}] int64, got {tuple(positions.shape)} {positions.dtype}")
    check(cache_k.dim() == 4 and cache_k.shape[0] >= B and cache_k.shape[2:] == (H, D),
          f"cache_k must be [>= {B}, slots, {H}, {D}], got {tuple(cache_k.shape)}")
    check(cache_v.shape == cache_k.shape, f"cache_v must be {tuple(cache_k.shape)}, got {tuple(cache_v.shape)}")
    limit = cache_k.shape[1] - (1 if k is not None else 0)
    check(1 <= kv_len <= limit, f"kv_len must be in [1, {limit}], got {kv_len}")
    if B and T:
        check(int(positions.min()) >= 0, "positions must be >= 0")
        check(bias_table is None or (bias_table.dim() == 2 and bias_table.shape[1] == H
                                     and bias_table.shape[0] > int(positions.max())),
              f"bias_table must be [> max(positions), {H}], got {None if bias_table is None else tuple(bias_table.shape)}")
    if impl == "reference":
        return q, k, v, positions, bias_table
    tensors = dict(q=q, k=k, v=v, cache_k=cache_k, cache_v=cache_v, bias_table=bias_table)
    for name, t in tensors.items():
        if t is not None:
            check(t.dtype == torch.float32 and t.device.type == "cpu",
                  f"impl 'cpp' needs float32 CPU tensors, got {name} {t.dtype} on {t.device}")
    check(cache_k.is_contiguous() and cache_v.is_contiguous(), "cache_k and cache_v must be contiguous")
    q, k, v = (t if t is None or token_stride(t) is not None else t.contiguous() for t in (q, k, v))
    return q, k, v, positions.contiguous(), None if bias_table is None else bias_table.contiguous()


def relative_bias(positions: torch.Tensor, kv_len: int, bias_table: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """[B, H or 1, T, kv_len]: bias_table[p - j] for key j <= p, -inf for keys after the query
    (the reference path's bias, built once per forward and shared by a stack's layers)."""
    distance = positions[:, :, None] - torch.arange(kv_len, device=positions.device)  # [B, T, kv_len]
    hidden = (distance < 0)[:, None]
    if bias_table is None:
        bias = torch.zeros(hidden.shape, dtype=dtype, device=positions.device)
    else:
        bias = bias_table.to(dtype)[distance.clamp(min=0)].permute(0, 3, 1, 2)
    return bias.masked_fill(hidden, float("-inf"))


def relative_attention_reference(q, k, v, positions, cache_k, cache_v, kv_len: int, bias: torch.Tensor) -> torch.Tensor:
    """The torch composite (transformers' order of operations); bias from relative_bias, or any
    [B or 1, H or 1, T, kv_len] additive bias (-inf: hidden)."""
    B, T, H, D = q.shape
    if k is not None:
        slots = positions.clamp(max=cache_k.shape[1] - 1)
        rows = torch.arange(B, device=positions.device)[:, None]
        cache_k[rows, slots] = k
        cache_v[rows, slots] = v
    visible = bias != float("-inf")
    keys, values = seen_entries(cache_k[:B, :kv_len], visible), seen_entries(cache_v[:B, :kv_len], visible)
    return biased_attention(q, keys, values, bias)


def biased_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T + bias) v, unscaled, in transformers' order of operations. q [B, T, H, D];
    k, v [B, S, H, D]; bias [B or 1, H or 1, T, S] in q's dtype (-inf: hidden). Returns [B, T, H*D].
    (Three products and a softmax: for a decoding step's few queries, half the time of
    scaled_dot_product_attention on a CPU.)"""
    B, T, H, D = q.shape
    scores = torch.matmul(q.transpose(1, 2), k.permute(0, 2, 3, 1)).add_(bias)  # [B, H, T, S]
    out = torch.matmul(scores.softmax(-1), v.transpose(1, 2))  # [B, H, T, D]
    return out.transpose(1, 2).reshape(B, T, H * D)


def relative_attention_cpp(q, k, v, positions, cache_k, cache_v, kv_len: int,
                           bias_table: torch.Tensor | None) -> torch.Tensor:
    """The C++ op without argument checks, for model layers: float32 CPU tensors, q (k, v) with a
    token_stride, the rest contiguous."""
    from .. import _C

    B, T, H, D = q.shape
    out = torch.empty((B, T, H * D), dtype=torch.float32)
    _C.relative_attention(q.data_ptr(), token_stride(q), 0 if k is None else k.data_ptr(),
                          0 if v is None else v.data_ptr(), 0 if k is None else token_stride(k),
                          0 if v is None else token_stride(v), positions.data_ptr(), cache_k.data_ptr(),
                          cache_v.data_ptr(), cache_k.shape[1] - 1, cache_k.stride(0), kv_len,
                          0 if bias_table is None else bias_table.data_ptr(), out.data_ptr(), B, T, H, D)
    return out
