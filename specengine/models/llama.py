"""One decoder-only Llama-family model: Llama (incl. Llama 3 rope scaling), Mistral, Qwen2, Qwen3.

Forward takes tokens [B, T] and per-row start positions [B], writes K/V into a static
cache at those positions and lets each row attend only to its own prefix. The module
names match transformers', so checkpoint keys load one to one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.kv_cache import StaticKVCache
from ..layers.linear import Linear
from ..layers.norm import RMSNorm
from ..layers.rotary import apply_rope, rope_cos_sin, rope_inv_freq
from .config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, positions, mask, cache: StaticKVCache, kv_len: int):
        # x [B, T, D]; cos, sin [B, T, head_dim]; positions [B, T]; mask [B, 1, T, kv_len] bool
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(self.layer_idx, positions, k, v)
        keys, values = cache.read(self.layer_idx, kv_len)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, positions, mask, cache, kv_len):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, mask, cache, kv_len)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Kept out of the module's buffers so that model.to(bfloat16) cannot round it.
        self._inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: activations, KV cache and norms. Matrices may be stored narrower
        (bfloat16 weights with float32 compute on a CPU, see models.loader)."""
        return self.model.norm.weight.dtype

    def new_cache(self, batch_size: int, capacity: int) -> StaticKVCache:
        c = self.config
        return StaticKVCache(c.num_layers, batch_size, capacity, c.num_kv_heads, c.head_dim, self.dtype, self.device)

    def forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, cache: StaticKVCache,
                kv_len: int | None = None) -> torch.Tensor:
        """Hidden states [B, T, D] after the final norm.

        tokens [B, T] int64; start_pos [B] int64, the position of each row's first token
        (normally its cache length). kv_len, if given, must be max(start_pos) + T: the host
        usually knows it, and passing it avoids a device sync.
        """
        B, T = tokens.shape
        positions = start_pos[:, None] + torch.arange(T, device=tokens.device)  # [B, T]
        if kv_len is None:
            kv_len = int(positions.max()) + 1
        kv_len = min(kv_len, cache.capacity)
        key_pos = torch.arange(kv_len, device=tokens.device)
        # Each query sees keys at or before its own position: the row's valid prefix plus the
        # tokens of this call; stale entries of rolled-back drafts lie beyond and stay hidden.
        mask = key_pos <= positions[..., None]  # [B, T, kv_len]
        if self.config.sliding_window is not None:
            mask &= key_pos > positions[..., None] - self.config.sliding_window
        mask = mask[:, None]
        if self._inv_freq.device != tokens.device:
            self._inv_freq = self._inv_freq.to(tokens.device)
        cos, sin = rope_cos_sin(self._inv_freq, positions, self.dtype)
        x = self.model.embed_tokens(tokens).to(self.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, positions, mask, cache, kv_len)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 for hidden states [..., D]."""
        return self.lm_head(hidden).float()
