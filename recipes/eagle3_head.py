"""An EAGLE-3 draft head as a plain torch module whose state_dict keys are the published names
(the Hugging Face folder vLLM and SGLang load as `LlamaForCausalLMEagle3`), with the training-time
test forward recipes/train_eagle3.py trains it with. See train_eagle3.py's docstring for the format
and the scheme."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's default capture layers for a target of num_layers (low, middle, high): the inputs of
    layers 2, num_layers // 2 and num_layers - 3."""
    return [2, num_layers // 2, num_layers - 3]


@dataclass
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int                 # the target's
    draft_vocab_size: int
    aux_layers: list[int]           # the target layers whose inputs are captured, low to high
    target_num_layers: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    eos_token_id: int | None = None
    bos_token_id: int | None = None
    extra: dict = field(default_factory=dict)  # written into config.json as they are (data notes)

    def __post_init__(self):
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                     "vocab_size", "draft_vocab_size", "target_num_layers", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} exceeds the target's vocab_size {self.vocab_size}")
        if len(self.aux_layers) != 3 or sorted(self.aux_layers) != list(self.aux_layers):
            raise ValueError(f"aux_layers must be three target layers, low to high, got {self.aux_layers}")
        if not all(0 <= i < self.target_num_layers for i in self.aux_layers):
            raise ValueError(f"aux_layers {self.aux_layers} outside the target's {self.target_num_layers} layers")

    def to_json(self) -> dict:
        """config.json of the published format."""
        ids = list(self.aux_layers)
        return dict(
            architectures=[ARCHITECTURE], model_type="llama", hidden_act="silu", num_hidden_layers=1,
            hidden_size=self.hidden_size, target_hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, intermediate_size=self.intermediate_size, vocab_size=self.vocab_size,
            draft_vocab_size=self.draft_vocab_size, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=False,
            attention_bias=False, mlp_bias=False, norm_before_residual=False,
            bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id, torch_dtype="bfloat16",
            # vLLM reads the capture layers at the top level first, then inside eagle_config.
            eagle_aux_hidden_state_layer_ids=ids,
            eagle_config=dict(eagle_aux_hidden_state_layer_ids=ids, use_aux_hidden_state=True),
            **self.extra)


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
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
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


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding (halves rotated). x [B, heads, T, d]; positions [T] or [B, T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = positions.to(torch.float32)[..., None] * inv  # [..., T, d/2]
    if angles.dim() == 3:
        angles = angles[:, None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class Eagle3Head(nn.Module):
    """fc [H, 3H] fuses the target's three captured states; one decoder layer (`midlayer`) whose
    attention reads [input_layernorm(token embedding), hidden_norm(hidden)] (2H); `norm`; `lm_head`
    over the draft vocabulary; d2t (draft id -> target id offset) and t2d (target id in the draft
    vocabulary). The token embedding is the target's, frozen and not part of the head's file."""

    def __init__(self, cfg: Eagle3Config, embed_tokens: torch.Tensor):
        super().__init__()
        if embed_tokens.shape != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"embedding {tuple(embed_tokens.shape)} does not fit the head's "
                             f"({cfg.vocab_size}, {cfg.hidden_size})")
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("embed_tokens", embed_tokens.float(), persistent=False)

    def set_vocab(self, draft_ids: torch.Tensor):
        """draft_ids [draft_vocab] sorted target ids: d2t[i] = draft_ids[i] - i, t2d marks them."""
        if draft_ids.shape != (self.cfg.draft_vocab_size,) or not bool((draft_ids[1:] > draft_ids[:-1]).all()):
            raise ValueError(f"draft ids must be {self.cfg.draft_vocab_size} distinct sorted target ids")
        self.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        self.t2d.zero_()
        self.t2d[draft_ids] = True

    @property
    def draft_ids(self) -> torch.Tensor:
        """[draft_vocab] the target id of each draft id."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, T, 2H] -> q [B, heads, T, d], k, v [B, heads, T, d] (kv heads repeated), roped at positions [T]."""
        attn, (B, T, _) = self.midlayer.self_attn, x.shape
        q = attn.q_proj(x).view(B, T, attn.heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(B, T, attn.kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(B, T, attn.kv_heads, attn.head_dim).transpose(1, 2)
        groups = attn.heads // attn.kv_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        return rope(q, positions, self.cfg.rope_theta), rope(k, positions, self.cfg.rope_theta), v

    def ttt(self, aux: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The training-time test: `steps` draft steps unrolled for every start position at once.

        aux [B, T, 3H]: the target's captured states at positions 0..T-1; tokens [B, T] the
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


def save_head(head: Eagle3Head, out: Path, dtype=torch.bfloat16):
    """config.json and model.safetensors of the published format (float tensors in dtype, d2t
    int64, t2d bool; no embedding: the target's is used)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: (t.detach().to(dtype) if t.is_floating_point() else t.detach()).contiguous().cpu()
               for name, t in head.state_dict().items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(head.cfg.to_json(), indent=2) + "\n")
