"""An EAGLE-3 draft head as a plain, differentiable torch module whose state_dict keys are the
published names (the Hugging Face folder vLLM and SGLang load as `LlamaForCausalLMEagle3`), with
the training-time test forward recipes/train_eagle3.py trains it with. See train_eagle3.py's
docstring for the format and the scheme.

The runtime's code is the one description of the format: its config (specengine.models.eagle3.
Eagle3Config), the folder's writer (save_eagle3, which refuses a tensor it does not name), the
draft vocabulary's d2t/t2d (draft_vocab_maps) and the rotary frequencies (layers.rotary). This
module holds only what training needs of its own: a forward with gradients that unrolls every
chain of drafts at once."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from specengine.layers.rotary import rope_cos_sin, rope_inv_freq
from specengine.models.eagle3 import Eagle3Config, draft_vocab_maps, save_eagle3

class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        H, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(2 * H, self.heads * d, bias=False)
        self.k_proj = nn.Linear(2 * H, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * H, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, H, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding (halves rotated), its tables the runtime's (rope_cos_sin).
    x [B, heads, T, d]; positions [T] or [B, T]; inv_freq [d / 2] (rope_inv_freq)."""
    cos, sin = rope_cos_sin(inv_freq.to(x.device), positions, torch.float32)  # [T, d] or [B, T, d]
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class Eagle3Head(nn.Module):
    """fc [H, k * H_target] fuses the target's k captured states; one decoder layer (`midlayer`)
    whose attention reads [input_layernorm(token embedding), hidden_norm(hidden)] (2H); `norm`;
    `lm_head` over the draft vocabulary; d2t (draft id -> target id offset) and t2d (target id in
    the draft vocabulary). The token embedding is the target's, frozen and not part of the head's
    file."""

    def __init__(self, cfg: Eagle3Config, embed_tokens: torch.Tensor):
        """cfg: the runtime's config of the head; embed_tokens [vocab_size, H]: the target's embedding."""
        super().__init__()
        if embed_tokens.shape != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"embedding {tuple(embed_tokens.shape)} does not fit the head's "
                             f"({cfg.vocab_size}, {cfg.hidden_size})")
        if cfg.norm_before_residual:
            raise ValueError("this recipe trains heads whose residual is the hidden itself (norm_before_residual false)")
        self.config = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.feature_layers) * cfg.target_hidden_size, H, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("embed_tokens", embed_tokens.float(), persistent=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.head_dim), persistent=False)

    def set_vocab(self, draft_ids: torch.Tensor):
        """draft_ids [draft_vocab]: the target id each draft id scores (the runtime's d2t, t2d)."""
        if draft_ids.shape != (self.config.draft_vocab_size,):
            raise ValueError(f"a draft vocabulary of {self.config.draft_vocab_size} ids, got {tuple(draft_ids.shape)}")
        d2t, t2d = draft_vocab_maps(draft_ids, self.config.vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_ids(self) -> torch.Tensor:
        """[draft_vocab] the target id of each draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, T, 2H] -> q [B, heads, T, d], k, v [B, heads, T, d] (kv heads repeated), roped at positions [T]."""
        attn, (B, T, _) = self.midlayer.self_attn, x.shape
        q = attn.q_proj(x).view(B, T, attn.heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(B, T, attn.kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(B, T, attn.kv_heads, attn.head_dim).transpose(1, 2)
        groups = attn.heads // attn.kv_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        return rope(q, positions, self.inv_freq), rope(k, positions, self.inv_freq), v

    def ttt(self, aux: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The training-time test: `steps` draft steps unrolled for every start position at once.

        aux [B, T, k * H_target]: the target's captured states at positions 0..T-1; tokens [B, T] the
        sequence; valid [B, T] bool, real (not padding) positions. Chain t starts from the
        target's states of position t and the token t + 1; its step j (0-based) reads the token
        t + j + 1 (teacher forced: the target's own text) and, for j > 0, the head's previous
        output hidden (before `norm`), sits at rope position t + j and attends to the step-0 keys
        of positions 0..t and to its own steps 1..j, as a chain drafted at inference does.
        Returns per step the head's output hidden [B, T, H] (position t: chain t's step j, whose
        logits, `logits(hidden)`, predict token t + j + 2; positions whose input token is past the
        end are garbage and masked by the caller)."""
        B, T, _ = aux.shape
        device = aux.device
        layer, attn = self.midlayer, self.midlayer.self_attn
        hidden = self.fc(aux)
        positions = torch.arange(T, device=device)
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        mask0 = causal[None, None] & valid[:, None, None, :]  # [B, 1, T, T]
        scale = attn.head_dim ** -0.5
        keys0 = values0 = None
        own_keys, own_values = [], []  # steps 1..j of each chain: [B, heads, T, d]
        outputs = []
        for j in range(steps):
            nxt = torch.zeros_like(tokens)
            nxt[:, : T - j - 1] = tokens[:, j + 1:]
            x = torch.cat([layer.input_layernorm(self.embed_tokens[nxt]), layer.hidden_norm(hidden)], -1)
            q, k, v = self._qkv(x, positions + j)
            if j == 0:
                keys0, values0 = k, v
            else:
                own_keys.append(k)
                own_values.append(v)
            scores0 = (q @ keys0.transpose(-1, -2)) * scale
            scores0 = scores0.masked_fill(~mask0, float("-inf"))
            own = [(q * kk).sum(-1, keepdim=True) * scale for kk in own_keys]  # [B, heads, T, 1] each
            probs = torch.cat([scores0, *own], -1).softmax(-1)
            out = probs[..., :T] @ values0
            for i, vv in enumerate(own_values):
                out = out + probs[..., T + i: T + i + 1] * vv
            out = attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))
            residual = hidden + out
            hidden = residual + layer.mlp(layer.post_attention_layernorm(residual))
            outputs.append(hidden)
        return outputs

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (the layer's output, before `norm`) -> draft logits [..., draft_vocab]."""
        return self.lm_head(self.norm(hidden))


def save_head(head: Eagle3Head, out: Path, dtype=torch.bfloat16) -> Path:
    """The published folder (the runtime's writer): config.json and model.safetensors, float
    tensors in dtype, d2t int64, t2d bool; no embedding (the target's is used)."""
    return save_eagle3(out, head.config, head.state_dict(), dtype)
