"""A whole Llama decoder layer (or T5 decoder block, t5_decoder_block) in one C++ call, for float32
decoding on a CPU with stored matrices: bfloat16 (how the loader keeps a bfloat16 checkpoint there)
or, for the Llama layer, a GGUF file's blocks as stored (ops.blocks.BlockMatrix).

  x += o_proj(attention(rope(qkv_proj(rms_norm(x)))))
  x += down_proj(silu(gate) * up),  [gate, up] = gate_up_proj(rms_norm(x))

The same arithmetic as the model's per-op CPU path (ops.norm, ops.linear, ops.attention), which
is this op's oracle (tests/test_models.py checks both against transformers). Why one call: the
shipped models' layers are so small that the Python and torch calls between those ops cost as
much as the ops (measured: see bench/results/kernel-tuning-2026-11-29-to-12-03.md).
"""
from __future__ import annotations

from typing import NamedTuple, Union

import torch

from .blocks import BlockMatrix
from .blocks_cpp import matrix_descriptor

# A layer's matrix: a bfloat16 tensor [out, in] (one BF16 part, as BlockMatrix.from_dense would
# view it) or a BlockMatrix.
Matrix = Union[torch.Tensor, BlockMatrix]


class DecoderLayerWeights(NamedTuple):
    """One layer's parameters: matrices [out, in] as bfloat16 tensors or BlockMatrix (each matrix
    either; a packed one's parts may differ in type), vectors float32, all CPU and contiguous. A
    bias or q/k norm the architecture lacks is None."""

    input_norm: torch.Tensor           # [hidden]
    qkv: Matrix                        # [(H + 2 * Hkv) * D, hidden], q, k and v rows packed
    qkv_bias: torch.Tensor | None      # [(H + 2 * Hkv) * D]
    q_norm: torch.Tensor | None        # [D], per-head RMSNorm of q before the rotary (Qwen3)
    k_norm: torch.Tensor | None        # [D]
    o: Matrix                          # [hidden, H * D]
    o_bias: torch.Tensor | None        # [hidden]
    post_norm: torch.Tensor            # [hidden]
    gate_up: Matrix                    # [2 * intermediate, hidden], gate rows then up rows
    gate_up_bias: torch.Tensor | None  # [2 * intermediate]
    down: Matrix                       # [hidden, intermediate]
    down_bias: torch.Tensor | None     # [hidden]


_MATRICES = frozenset({"qkv", "o", "gate_up", "down"})


def _check(cond: bool, message: str):
    if not cond:
        raise ValueError(f"decoder_layer: {message}")


def decoder_layer(
    x: torch.Tensor,          # [B, T, hidden] float32, updated in place
    weights: DecoderLayerWeights,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    cos: torch.Tensor,        # [B, T, head_dim] rotary tables at the tokens' positions
    sin: torch.Tensor,        # [B, T, head_dim]
    positions: torch.Tensor,  # [B, T] int64, absolute position of each token
    cache_k: torch.Tensor,    # [B_alloc >= B, capacity + 1, Hkv, D] float32, this layer's keys (written)
    cache_v: torch.Tensor,    # [B_alloc, capacity + 1, Hkv, D] (written)
    kv_len: int,              # keys that may be visible: max(positions) + 1, clipped to capacity
    sliding_window: int | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Run the layer in place on x; returns x. Checks its arguments first, unless check is False
    (the model's calls: the loader checked the weights, the model built the rest contiguous)."""
    if check:
        cos, sin, positions = _checked_layer(x, weights, num_heads, num_kv_heads, head_dim, eps, cos, sin, positions,
                                             cache_k, cache_v, kv_len, sliding_window)
    return decoder_layer_cpp(x, weights, num_heads, num_kv_heads, head_dim, eps, cos, sin, positions, cache_k, cache_v,
                             kv_len, sliding_window)


def _checked_layer(x, weights, num_heads, num_kv_heads, head_dim, eps, cos, sin, positions, cache_k, cache_v, kv_len,
                   sliding_window):
    """decoder_layer's arguments checked: (cos, sin, positions) contiguous."""
    _check(x.dim() == 3 and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous(),
           f"x must be a contiguous float32 CPU tensor [B, T, hidden], got {tuple(x.shape)} {x.dtype} on {x.device}")
    B, T, hidden = x.shape
    H, Hkv, D = num_heads, num_kv_heads, head_dim
    _check(H >= 1 and Hkv >= 1 and H % Hkv == 0, f"num_heads ({H}) must be a multiple of num_kv_heads ({Hkv})")
    _check(D >= 2 and D % 2 == 0, f"head_dim must be even for the rotary embedding, got {D}")
    _check(eps > 0, f"eps must be > 0, got {eps}")
    _check(len(weights.gate_up.shape) == 2 and weights.gate_up.shape[0] % 2 == 0,
           f"gate_up must be [2 * intermediate, {hidden}], got {tuple(weights.gate_up.shape)}")
    inter = weights.gate_up.shape[0] // 2
    qkv_rows = (H + 2 * Hkv) * D
    expected = {"input_norm": (hidden,), "post_norm": (hidden,), "qkv": (qkv_rows, hidden), "qkv_bias": (qkv_rows,),
                "q_norm": (D,), "k_norm": (D,), "o": (hidden, H * D), "o_bias": (hidden,),
                "gate_up": (2 * inter, hidden), "gate_up_bias": (2 * inter,), "down": (hidden, inter),
                "down_bias": (hidden,)}
    for name, shape in expected.items():
        t = getattr(weights, name)
        if t is None:
            _check(name.endswith("bias") or name in ("q_norm", "k_norm"), f"{name} is required")
            continue
        if name in _MATRICES and isinstance(t, BlockMatrix):
            _check(tuple(t.shape) == shape, f"{name} must be {list(shape)}, got {tuple(t.shape)}")
            _check(t.device.type == "cpu", f"{name} must be on the CPU, got {t.device}")
            continue
        dtype = torch.bfloat16 if name in _MATRICES else torch.float32
        _check(tuple(t.shape) == shape, f"{name} must be {list(shape)}, got {tuple(t.shape)}")
        _check(t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous(),
               f"{name} must be a contiguous {dtype} CPU tensor, got {t.dtype} on {t.device}")
    _check((weights.q_norm is None) == (weights.k_norm is None), "q_norm and k_norm come together")
    for name, t in (("cos", cos), ("sin", sin)):
        _check(t.shape == (B, T, D) and t.dtype == torch.float32 and t.device.type == "cpu",
               f"{name} must be float32 CPU [{B}, {T}, {D}], got {tuple(t.shape)} {t.dtype} on {t.device}")
    _check(positions.shape == (B, T) and positions.dtype == torch.int64 and positions.device.type == "cpu",
           f"positions must be int64 CPU [{B}, {T}], got {tuple(positions.shape)} {positions.dtype}")
    _check(B == 0 or int(positions.min()) >= 0, "positions must be >= 0")
    for name, t in (("cache_k", cache_k), ("cache_v", cache_v)):
        _check(t.dim() == 4 and t.shape[0] >= B and t.shape[2:] == (Hkv, D) and t.dtype == torch.float32
               and t.device.type == "cpu" and t.is_contiguous(),
               f"{name} must be a contiguous float32 CPU tensor [>= {B}, capacity + 1, {Hkv}, {D}], got "
               f"{tuple(t.shape)} {t.dtype} on {t.device}")
    _check(cache_v.shape == cache_k.shape, f"cache_v must be {tuple(cache_k.shape)}, got {tuple(cache_v.shape)}")
    capacity = cache_k.shape[1] - 1
    _check(1 <= kv_len <= capacity, f"kv_len must be in [1, capacity={capacity}], got {kv_len}")
    _check(sliding_window is None or sliding_window >= 1, f"sliding_window must be >= 1, got {sliding_window}")
    return cos.contiguous(), sin.contiguous(), positions.contiguous()


def decoder_layer_cpp(x, weights: DecoderLayerWeights, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                      cos, sin, positions, cache_k, cache_v, kv_len: int, sliding_window: int | None) -> torch.Tensor:
    """The C++ op: decoder_layer after its checks."""
    from .. import _C

    def address(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr()

    (input_norm, qkv, qkv_bias, q_norm, k_norm, o, o_bias, post_norm, gate_up, gate_up_bias, down,
     down_bias) = weights
    B, T, hidden = x.shape
    gate_up = matrix_descriptor(gate_up)  # (in_features, parts, type, data, rows, ...)
    _C.decoder_layer(x.data_ptr(), address(input_norm), matrix_descriptor(qkv), address(qkv_bias), address(q_norm),
                     address(k_norm), matrix_descriptor(o), address(o_bias), address(post_norm), gate_up,
                     address(gate_up_bias), matrix_descriptor(down), address(down_bias), hidden, num_heads,
                     num_kv_heads, head_dim, sum(gate_up[4::3]) // 2, eps, cos.data_ptr(), sin.data_ptr(),
                     positions.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(), B, T, cache_k.shape[1] - 1,
                     cache_k.stride(0), kv_len, sliding_window or 0)
    return x


# ---- T5 ----------------------------------------------------------------------------------------

T5_ACTIVATION_CODES = {"relu": 0, "gelu_new": 1, "gelu": 2, "silu": 3}  # csrc/decoder.h T5Activation


class T5BlockWeights(NamedTuple):
    """One T5 decoder block's parameters: matrices [out, in] bfloat16, norms float32, CPU, contiguous."""

    self_norm: torch.Tensor   # [hidden]
    qkv: torch.Tensor         # [3 * H * D, hidden], q, k and v rows packed
    self_o: torch.Tensor      # [hidden, H * D]
    cross_norm: torch.Tensor  # [hidden]
    cross_q: torch.Tensor     # [H * D, hidden]
    cross_o: torch.Tensor     # [hidden, H * D]
    ff_norm: torch.Tensor     # [hidden]
    wi: torch.Tensor          # [(2 if gated else 1) * d_ff, hidden], wi_0 rows then wi_1 rows
    wo: torch.Tensor          # [hidden, d_ff]


def t5_decoder_block(
    x: torch.Tensor,             # [B, T, hidden] float32, updated in place
    weights: T5BlockWeights,
    num_heads: int,
    head_dim: int,
    activation: str,             # a key of T5_ACTIVATION_CODES
    gated: bool,
    eps: float,
    positions: torch.Tensor,     # [B, T] int64, each new token's position
    cache_k: torch.Tensor,       # [B_alloc >= B, capacity + 1, H, D] float32, this layer's keys (written)
    cache_v: torch.Tensor,       # [B_alloc, capacity + 1, H, D] (written)
    kv_len: int,                 # self-attention keys that may be visible (<= capacity)
    bias_table: torch.Tensor,    # [> max(positions), H] float32, the bias of a key d positions back
    source_last: torch.Tensor,   # [B, T] int64, each row's last encoder token
    cross_k: torch.Tensor,       # [B_alloc, source capacity, H, D] float32, this layer's encoder keys
    cross_v: torch.Tensor,       # [B_alloc, source capacity, H, D]
    check: bool = True,
) -> torch.Tensor:
    """Run the block in place on x; returns x. Checks its arguments first, unless check is False
    (the model's calls, as decoder_layer's)."""
    if check:
        positions, source_last = _checked_block(x, weights, num_heads, head_dim, activation, gated, positions, cache_k,
                                                cache_v, kv_len, bias_table, source_last, cross_k, cross_v)
    return t5_decoder_block_cpp(x, weights, num_heads, head_dim, activation, gated, eps, positions, cache_k, cache_v,
                                kv_len, bias_table, source_last, cross_k, cross_v)


def _checked_block(x, weights, num_heads, head_dim, activation, gated, positions, cache_k, cache_v, kv_len, bias_table,
                   source_last, cross_k, cross_v):
    """t5_decoder_block's arguments checked: (positions, source_last) contiguous."""
    _check(x.dim() == 3 and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous(),
           f"x must be a contiguous float32 CPU tensor [B, T, hidden], got {tuple(x.shape)} {x.dtype} on {x.device}")
    B, T, hidden = x.shape
    H, D, inner = num_heads, head_dim, num_heads * head_dim
    _check(activation in T5_ACTIVATION_CODES, f"activation must be one of {list(T5_ACTIVATION_CODES)}, "
                                              f"got {activation!r}")
    rows = 2 if gated else 1
    _check(weights.wi.dim() == 2 and weights.wi.shape[0] % rows == 0,
           f"wi must be [{rows} * d_ff, {hidden}], got {tuple(weights.wi.shape)}")
    d_ff = weights.wi.shape[0] // rows
    expected = {"self_norm": (hidden,), "qkv": (3 * inner, hidden), "self_o": (hidden, inner), "cross_norm": (hidden,),
                "cross_q": (inner, hidden), "cross_o": (hidden, inner), "ff_norm": (hidden,),
                "wi": (rows * d_ff, hidden), "wo": (hidden, d_ff)}
    for name, shape in expected.items():
        t = getattr(weights, name)
        dtype = torch.bfloat16 if t.dim() == 2 else torch.float32
        _check(tuple(t.shape) == shape, f"{name} must be {list(shape)}, got {tuple(t.shape)}")
        _check(t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous(),
               f"{name} must be a contiguous {dtype} CPU tensor, got {t.dtype} on {t.device}")
    for name, t in (("positions", positions), ("source_last", source_last)):
        _check(t.shape == (B, T) and t.dtype == torch.int64 and t.device.type == "cpu",
               f"{name} must be int64 CPU [{B}, {T}], got {tuple(t.shape)} {t.dtype}")
    for name, t, slots in (("cache_k", cache_k, "capacity + 1"), ("cache_v", cache_v, "capacity + 1"),
                           ("cross_k", cross_k, "source capacity"), ("cross_v", cross_v, "source capacity")):
        _check(t.dim() == 4 and t.shape[0] >= B and t.shape[2:] == (H, D) and t.dtype == torch.float32
               and t.device.type == "cpu" and t.is_contiguous(),
               f"{name} must be a contiguous float32 CPU tensor [>= {B}, {slots}, {H}, {D}], got "
               f"{tuple(t.shape)} {t.dtype} on {t.device}")
    _check(cache_v.shape == cache_k.shape and cross_v.shape == cross_k.shape, "values must be shaped as their keys")
    capacity = cache_k.shape[1] - 1
    _check(1 <= kv_len <= capacity, f"kv_len must be in [1, capacity={capacity}], got {kv_len}")
    if B and T:
        _check(int(positions.min()) >= 0 and bias_table.shape[0] > int(positions.max()),
               f"positions must be >= 0 and below the bias table's {bias_table.shape[0]} rows")
        _check(int(source_last.min()) >= 0 and int(source_last.max()) < cross_k.shape[1],
               f"source_last must be in [0, {cross_k.shape[1]})")
    _check(bias_table.dim() == 2 and bias_table.shape[1] == H and bias_table.dtype == torch.float32
           and bias_table.is_contiguous(), f"bias_table must be contiguous float32 [n, {H}]")
    return positions.contiguous(), source_last.contiguous()


def t5_decoder_block_cpp(x, weights: T5BlockWeights, num_heads: int, head_dim: int, activation: str, gated: bool,
                         eps: float, positions, cache_k, cache_v, kv_len: int, bias_table, source_last, cross_k,
                         cross_v) -> torch.Tensor:
    """The C++ op: t5_decoder_block after its checks."""
    from .. import _C

    B, T, hidden = x.shape
    d_ff = weights.wo.shape[1]
    _C.t5_decoder_block(x.data_ptr(), *(t.data_ptr() for t in weights), hidden, num_heads, head_dim, d_ff,
                        T5_ACTIVATION_CODES[activation], gated, eps, positions.data_ptr(), cache_k.data_ptr(),
                        cache_v.data_ptr(), bias_table.data_ptr(), source_last.data_ptr(), cross_k.data_ptr(),
                        cross_v.data_ptr(), B, T, cache_k.shape[1] - 1, cache_k.stride(0), kv_len, cross_k.stride(0),
                        cross_k.shape[1])
    return x
