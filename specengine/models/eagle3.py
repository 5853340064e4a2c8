"""An EAGLE-3 draft head (Li et al., 2025) and its loader from the published checkpoint format.

The head is one decoder layer at the draft's width H that reads the target's own residual stream.
What the published format is (as vLLM's `Eagle3LlamaForCausalLM` / `LlamaForCausalLMEagle3`
and the EAGLE and SpecForge training code load and save it), in our words:

config.json
  - architectures: "LlamaForCausalLMEagle3" (EAGLE, SpecForge) or "Eagle3LlamaForCausalLM";
    num_hidden_layers 1; Llama's fields for the layer (hidden_size, num_attention_heads,
    num_key_value_heads, head_dim or hidden_size / heads, intermediate_size, rms_norm_eps,
    rope_theta / rope_scaling, max_position_embeddings, hidden_act silu).
  - vocab_size: the target's vocabulary; draft_vocab_size: the head's trimmed one (absent: the
    same). target_hidden_size (optional): the target's width, when the head's differs.
  - The target layers read: eagle_aux_hidden_state_layer_ids (top level, or inside an
    eagle_config dict); absent, (2, L // 2, L - 3) for an L-layer target. Id i is the residual
    stream entering target layer i (hidden + residual before layer i; 0 would be the
    embedding): what transformers' output_hidden_states[i] holds.
  - norm_before_residual (optional, default false): the layer's residual is the normed hidden.

Weights (safetensors; names without a "model." prefix)
  - fc.weight [H, k * H_target]: fuses the k captured states, concatenated in id order.
  - the layer, as midlayer.* (EAGLE, SpecForge) or layers.0.* (vLLM maps the first onto the
    second and takes both): hidden_norm.weight [H] (on the fused features), input_layernorm.weight
    [H] (on the token's embedding), self_attn.{q,k,v}_proj.weight [out, 2H] (their input is the
    normed embedding then the normed hidden, concatenated in that order), self_attn.o_proj.weight
    [H, heads * head_dim], post_attention_layernorm.weight [H], mlp.{gate,up,down}_proj.weight.
  - norm.weight [H]; lm_head.weight [draft_vocab_size, H].
  - d2t int64 [draft_vocab_size]: draft id d scores target id d + d2t[d]; t2d bool [vocab_size]
    (which target ids the draft has; vLLM ignores it, so do we beyond its shape).
  - embed_tokens.weight [vocab_size, H], optional: absent, the target's embedding is used.

The computation, for the pair (hidden h, token x) at a position:
  residual = h (or hidden_norm(h) with norm_before_residual)
  a = attention(concat(input_layernorm(embed(x)), hidden_norm(h)))   at the pair's position
  y = residual + a;  out = y + mlp(post_attention_layernorm(y))
  logits over the draft vocabulary = lm_head(norm(out))
Features enter as h = fc(target states) for positions the target has verified; a draft step
instead feeds back the head's own `out` of the step before (the layer's output before the final
norm). Pairing: the target's states at position t go with the token at t + 1 (vLLM's positions:
the pair sits at position t); its output predicts the token at t + 2. The head keeps its own KV
cache of one layer.

Writing: Eagle3Config.to_dict is the config.json, save_eagle3 the folder (the layer's tensors under
midlayer.*, as EAGLE and SpecForge write them; published_shapes names every tensor and its shape),
draft_vocab_maps the d2t and t2d of a trimmed vocabulary: what recipes/train_eagle3.py exports
with, so the layout is written and read here alone.

Models know nothing of speculation: drafters.eagle3 runs this head.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import ops
from ..layers.kv_cache import StaticKVCache
from ..layers.linear import Linear
from ..layers.norm import RMSNorm
from ..layers.rotary import RopeConfig, rope_cos_sin, rope_inv_freq
from ..ops.activation import silu_mul
from ..ops.attention import attention_mask, cached_attention
from .backend import RunsOnBackend
from .config import CheckpointError, ConfigError, ModelConfig, parse_rope, read_config, rope_fields
from .loader import safetensors_tensors

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# The layer's tensors' prefixes: EAGLE's and SpecForge's (the one written here), vLLM's.
LAYER_PREFIXES = ("midlayer.", "layers.0.")


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers a head reads when its config names none (vLLM's): low, middle, high."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    vocab_size: int                   # the target's
    draft_vocab_size: int
    target_hidden_size: int
    feature_layers: tuple[int, ...]   # target layer ids whose input states fc fuses, in order
    norm_before_residual: bool = False
    max_position_embeddings: int = 2048

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
                     "draft_vocab_size", "target_hidden_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"EAGLE-3 config {name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"EAGLE-3 config: num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"EAGLE-3 config: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(f"EAGLE-3 config: draft_vocab_size {self.draft_vocab_size} exceeds vocab_size "
                              f"{self.vocab_size}")
        if not self.feature_layers:
            raise ConfigError("EAGLE-3 config: no target layers to read (eagle_aux_hidden_state_layer_ids)")
        if not all(isinstance(i, int) for i in self.feature_layers):
            raise ConfigError(f"EAGLE-3 config: feature layers must be integers, got {self.feature_layers!r}")

    @classmethod
    def for_target(cls, target: ModelConfig, feature_layers: tuple[int, ...], draft_vocab_size: int) -> "Eagle3Config":
        """A head at a target's width, with its heads, MLP size, norm epsilon, rope and context
        (what recipes/train_eagle3.py trains), reading feature_layers, scoring draft_vocab_size ids."""
        return cls(hidden_size=target.hidden_size, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
                   head_dim=target.head_dim, intermediate_size=target.intermediate_size,
                   rms_norm_eps=target.rms_norm_eps, rope=target.rope, vocab_size=target.vocab_size,
                   draft_vocab_size=draft_vocab_size, target_hidden_size=target.hidden_size,
                   feature_layers=tuple(int(i) for i in feature_layers),
                   max_position_embeddings=target.max_position_embeddings)

    def to_dict(self, torch_dtype: str = "bfloat16") -> dict:
        """config.json of the published format (from_dict reads it back whatever the target's
        depth: the layers read are written, at the top level and inside eagle_config, where vLLM
        looks for them in that order). torch_dtype: the dtype the weights are saved in."""
        ids = list(self.feature_layers)
        return dict(
            architectures=[ARCHITECTURES[0]], model_type="llama", hidden_act="silu", num_hidden_layers=1,
            hidden_size=self.hidden_size, target_hidden_size=self.target_hidden_size,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size, vocab_size=self.vocab_size,
            draft_vocab_size=self.draft_vocab_size, rms_norm_eps=self.rms_norm_eps, **rope_fields(self.rope),
            max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=False, attention_bias=False,
            mlp_bias=False, norm_before_residual=self.norm_before_residual, torch_dtype=torch_dtype,
            eagle_aux_hidden_state_layer_ids=ids,
            eagle_config=dict(eagle_aux_hidden_state_layer_ids=ids, use_aux_hidden_state=True))

    @classmethod
    def from_dict(cls, raw: dict, target_layers: int) -> "Eagle3Config":
        """From a head's config.json, for a target of `target_layers` decoder layers (the default
        layer ids depend on it)."""
        archs = raw.get("architectures") or []
        if not any(a in ARCHITECTURES for a in archs):
            raise ConfigError(f"not an EAGLE-3 head: architectures {archs!r} (expected one of {ARCHITECTURES})")
        if raw.get("num_hidden_layers", 1) != 1:
            raise ConfigError(f"an EAGLE-3 head has one decoder layer; this config has num_hidden_layers "
                              f"{raw['num_hidden_layers']}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"EAGLE-3 head hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        if raw.get("attention_bias") or raw.get("mlp_bias"):
            raise ConfigError("EAGLE-3 heads with attention or MLP biases are not supported")
        eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        if not ids:
            ids = default_feature_layers(target_layers)
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        return cls(hidden_size=hidden, num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads,
                   head_dim=raw.get("head_dim") or hidden // heads, intermediate_size=raw["intermediate_size"],
                   rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope=parse_rope(raw), vocab_size=raw["vocab_size"],
                   draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
                   target_hidden_size=raw.get("target_hidden_size") or hidden,
                   feature_layers=tuple(int(i) for i in ids),
                   norm_before_residual=bool(raw.get("norm_before_residual", False)),
                   max_position_embeddings=raw.get("max_position_embeddings", 2048))


def published_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of a head in the published layout, by its name as written here (the layer's
    under midlayer.), and its shape; embed_tokens.weight [vocab_size, H], a head's own embedding,
    is optional and not listed."""
    H, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = {"hidden_norm.weight": (H,), "input_layernorm.weight": (H,),
             "self_attn.q_proj.weight": (q, 2 * H), "self_attn.k_proj.weight": (kv, 2 * H),
             "self_attn.v_proj.weight": (kv, 2 * H), "self_attn.o_proj.weight": (H, q),
             "post_attention_layernorm.weight": (H,), "mlp.gate_proj.weight": (inter, H),
             "mlp.up_proj.weight": (inter, H), "mlp.down_proj.weight": (H, inter)}
    return {"fc.weight": (H, len(cfg.feature_layers) * cfg.target_hidden_size),
            **{LAYER_PREFIXES[0] + name: shape for name, shape in layer.items()},
            "norm.weight": (H,), "lm_head.weight": (cfg.draft_vocab_size, H),
            "d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)}


def draft_vocab_maps(target_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A trimmed vocabulary's maps: draft id d scores target id target_ids[d] ([Vd] distinct ids
    in [0, vocab_size)). Returns d2t [Vd] int64 (target id = d + d2t[d]) and t2d [vocab_size]
    bool (the target ids the draft has)."""
    ids = target_ids.long().cpu()
    if ids.dim() != 1 or not len(ids):
        raise ValueError(f"a draft vocabulary is a non-empty list of target ids, got shape {tuple(ids.shape)}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != ids.numel():
        raise ValueError(f"a draft vocabulary's target ids must be distinct ids in [0, {vocab_size})")
    return ids - torch.arange(len(ids)), torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, ids, True)


def save_eagle3(folder: str | Path, cfg: Eagle3Config, tensors: dict[str, torch.Tensor],
                dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a head in the published layout: config.json (cfg.to_dict) and model.safetensors with
    exactly the tensors published_shapes names (an optional embed_tokens.weight too), the floating
    ones in dtype, d2t int64, t2d bool. A tensor missing, unknown or of another shape is refused
    by name, before anything is written."""
    from safetensors.torch import save_file

    shapes = published_shapes(cfg)
    optional = {"embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    problems = [f"missing {name}" for name in shapes if name not in tensors]
    problems += [f"unknown {name}" for name in tensors if name not in shapes and name not in optional]
    problems += [f"{name} has shape {tuple(t.shape)}, the config implies {(shapes | optional)[name]}"
                 for name, t in tensors.items() if name in shapes | optional
                 and tuple(t.shape) != (shapes | optional)[name]]
    if problems:
        raise CheckpointError("not an EAGLE-3 head in the published layout: " + "; ".join(problems))
    out = {name: (t.detach().to(dtype) if t.is_floating_point() else t.detach()).contiguous().cpu()
           for name, t in tensors.items()}
    out["d2t"], out["t2d"] = out["d2t"].long(), out["t2d"].bool()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    dtype_name = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(cfg.to_dict(dtype_name), indent=2) + "\n")
    return folder


def is_eagle3_folder(path: str | Path) -> bool:
    """Whether a folder's config.json says it holds an EAGLE-3 head."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        raw = json.loads(config.read_text())
    except json.JSONDecodeError:
        return False
    return isinstance(raw, dict) and any(a in ARCHITECTURES for a in raw.get("architectures") or [])


class Eagle3Head(RunsOnBackend):
    """The head (see the module): forward feeds (hidden, token) pairs through its one layer and
    its own KV cache, logits scores the target's vocabulary."""

    SUPPORTED_BACKENDS = ("cpp-ops", "triton", "torch")
    is_encoder_decoder = False
    tp = None

    def __init__(self, cfg: Eagle3Config, target_embed=None):
        """target_embed: the target's embedding (tokens [B, T] -> [B, T, H] in the compute dtype),
        used when the head has none of its own (embed_tokens is None then)."""
        super().__init__()
        self.config = cfg
        H, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q, kv
        self.fc = Linear(len(cfg.feature_layers) * cfg.target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        # q, k and v in one matrix over [embedding, hidden] (the checkpoint's three fill its rows).
        self.qkv_proj = Linear(2 * H, q + 2 * kv, bias=False)
        self.o_proj = Linear(q, H, bias=False)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.gate_up_proj = Linear(H, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, H, bias=False)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = Linear(H, cfg.draft_vocab_size, bias=False)
        self.embed_tokens: nn.Embedding | None = None
        self._target_embed = target_embed
        # The target id each draft id scores (arange + the checkpoint's d2t).
        self.register_buffer("target_ids", torch.arange(cfg.draft_vocab_size))
        self._inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
        self.use_backend()

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def whole_layer_weights(self):
        return None  # runs op by op (models.backend)

    def new_cache(self, batch_size: int, capacity: int, growable: bool = True) -> StaticKVCache:
        c = self.config
        return StaticKVCache(1, batch_size, capacity, c.num_kv_heads, c.head_dim, self.dtype, self.device, growable)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings [B, T, H] in the compute dtype: the head's own, else the target's."""
        if self.embed_tokens is not None:
            return self.embed_tokens.weight[tokens].to(self.dtype)
        return self._target_embed(tokens)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's captured states [B, T, k * H_target] (float32) -> the hidden [B, T, H] a pair takes."""
        return self.fc(features.to(self.dtype))

    def forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, cache: StaticKVCache,
                kv_len: int | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output before the final norm [B, T, H] for the pairs (hidden[b, t], tokens[b, t])
        at positions start_pos[b] + t, their keys and values written into the cache's one layer.

        tokens [B, T] int64; start_pos [B] int64; kv_len as LlamaForCausalLM.forward's.
        hidden [B, T, H]: fuse(target features), or the head's own output of the step before; None
        takes zeros (what timing a draft step needs: the same work, engine.costs)."""
        return self.run_on_backend(self._forward, tokens, start_pos, cache, kv_len, hidden)

    def _forward(self, tokens, start_pos, cache, kv_len, hidden, backend):
        c, impl = self.config, backend.impl
        B, T = tokens.shape
        positions = start_pos[:, None] + torch.arange(T, device=tokens.device)  # [B, T]
        if kv_len is None:
            kv_len = int(positions.max()) + 1
        kv_len = min(kv_len, cache.capacity)
        if hidden is None:
            hidden = torch.zeros(B, T, c.hidden_size, dtype=self.dtype, device=tokens.device)
        normed = self.hidden_norm(hidden, impl)
        residual = normed if c.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(self.embed(tokens), impl), normed], dim=-1)  # [B, T, 2H]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        if self._inv_freq.device != tokens.device:  # moved once: a copy from the host cannot be captured in a CUDA graph
            self._inv_freq = self._inv_freq.to(tokens.device)
        cos, sin = rope_cos_sin(self._inv_freq, positions, self.dtype)
        mask = attention_mask(positions, kv_len, None) if impl == "reference" else None
        cache_k, cache_v = cache.layer(0)
        attn = cached_attention(q.view(B, T, c.num_heads, c.head_dim), k.view(B, T, c.num_kv_heads, c.head_dim),
                                v.view(B, T, c.num_kv_heads, c.head_dim), cos, sin, positions.contiguous(),
                                cache_k, cache_v, kv_len, None, impl, mask=mask, check=ops.CHECK_MODEL_CALLS)
        # (a + residual: the add writes into the fresh attention output, never into the caller's hidden)
        y, h = self.post_attention_layernorm.add_and_norm(self.o_proj(attn), residual, impl)
        mlp = self.down_proj(silu_mul(self.gate_up_proj(h), impl, check=ops.CHECK_MODEL_CALLS))
        return y + mlp

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits [..., vocab_size] (the target's vocabulary) in float32 for outputs [..., H]: the
        draft vocabulary's scores at their target ids, -inf at every other id."""
        scores = self.lm_head(self.norm(out, self.backend.impl)).float()
        full = scores.new_full((*scores.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.target_ids, scores)


def _checkpoint_name(name: str) -> str:
    """A tensor's name without the layer's prefix (midlayer. or layers.0.)."""
    for prefix in LAYER_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def load_eagle3(folder: str | Path, target) -> Eagle3Head:
    """An EAGLE-3 head from a Hugging Face folder (config.json and safetensors), for `target` (a
    LlamaForCausalLM): on its device, in its compute dtype. A head that does not fit the target
    (widths, vocabulary, d2t's range, layer ids past its layers) is refused by name."""
    folder = Path(folder)
    path, raw = read_config(folder)
    if getattr(target, "is_encoder_decoder", False) or not hasattr(target, "capture_features"):
        raise ConfigError(f"an EAGLE-3 head reads a decoder-only Llama-family target's layers; "
                          f"{type(target).__name__} has none to read")
    tc = target.config
    try:
        cfg = Eagle3Config.from_dict(raw, tc.num_layers)
    except KeyError as e:
        raise ConfigError(f"{path} lacks the required field {e.args[0]!r}") from None
    problems = []
    if cfg.vocab_size != tc.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} is not the target's {tc.vocab_size}")
    if cfg.target_hidden_size != tc.hidden_size:
        problems.append(f"it reads states of width {cfg.target_hidden_size} (target_hidden_size or hidden_size), "
                        f"the target's are {tc.hidden_size}")
    outside = [i for i in cfg.feature_layers if not 0 <= i <= tc.num_layers]
    if outside or len(set(cfg.feature_layers)) != len(cfg.feature_layers):
        problems.append(f"eagle_aux_hidden_state_layer_ids {list(cfg.feature_layers)} must be distinct ids of the "
                        f"target's {tc.num_layers} layers (0 to {tc.num_layers})")
    if problems:
        raise ConfigError(f"the EAGLE-3 head {folder} does not fit the target: " + "; ".join(problems))

    tensors = {_checkpoint_name(name): part[:] for name, part in safetensors_tensors(folder)}
    head = Eagle3Head(cfg, target_embed=target.embed)
    H, q, kv, inter = cfg.hidden_size, head.q_size, head.kv_size, cfg.intermediate_size
    expected = {
        "fc.weight": (head.fc.weight, None), "hidden_norm.weight": (head.hidden_norm.weight, None),
        "input_layernorm.weight": (head.input_layernorm.weight, None),
        "self_attn.q_proj.weight": (head.qkv_proj.weight, (0, q)),
        "self_attn.k_proj.weight": (head.qkv_proj.weight, (q, kv)),
        "self_attn.v_proj.weight": (head.qkv_proj.weight, (q + kv, kv)),
        "self_attn.o_proj.weight": (head.o_proj.weight, None),
        "post_attention_layernorm.weight": (head.post_attention_layernorm.weight, None),
        "mlp.gate_proj.weight": (head.gate_up_proj.weight, (0, inter)),
        "mlp.up_proj.weight": (head.gate_up_proj.weight, (inter, inter)),
        "mlp.down_proj.weight": (head.down_proj.weight, None),
        "norm.weight": (head.norm.weight, None), "lm_head.weight": (head.lm_head.weight, None),
    }
    # The published names and shapes (save_eagle3 writes the same), the layer's prefix dropped.
    shapes = {_checkpoint_name(name): shape for name, shape in published_shapes(cfg).items()}
    assert set(expected) == set(shapes) - {"d2t", "t2d"}, "the loader and published_shapes disagree on the names"
    unknown = sorted(set(tensors) - set(shapes) - {"embed_tokens.weight"})
    if unknown:
        raise CheckpointError(f"{folder}: tensors an EAGLE-3 head does not have: {', '.join(unknown[:5])}")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"{folder}: EAGLE-3 head tensors missing: {', '.join(missing[:5])}")
    with torch.no_grad():
        for name, (param, rows) in expected.items():
            if tuple(tensors[name].shape) != shapes[name]:
                raise CheckpointError(f"{folder}: {name} has shape {tuple(tensors[name].shape)} but the config "
                                      f"implies {shapes[name]}")
            (param if rows is None else param.narrow(0, *rows)).copy_(tensors[name])
        if "embed_tokens.weight" in tensors:
            embed = tensors["embed_tokens.weight"]
            if tuple(embed.shape) != (cfg.vocab_size, H):
                raise CheckpointError(f"{folder}: embed_tokens.weight has shape {tuple(embed.shape)}, not "
                                      f"({cfg.vocab_size}, {H})")
            head.embed_tokens = nn.Embedding(cfg.vocab_size, H)
            head.embed_tokens.weight.copy_(embed)
        elif H != tc.hidden_size:
            raise ConfigError(f"the EAGLE-3 head {folder} has no embed_tokens and its width {H} is not the "
                              f"target's {tc.hidden_size}: it cannot use the target's embedding")
        if "d2t" in tensors:
            d2t = tensors["d2t"]
            if tuple(d2t.shape) != (cfg.draft_vocab_size,) or d2t.dtype.is_floating_point:
                raise CheckpointError(f"{folder}: d2t must be integers of shape ({cfg.draft_vocab_size},), got "
                                      f"{d2t.dtype} {tuple(d2t.shape)}")
            ids = torch.arange(cfg.draft_vocab_size) + d2t.long()
            if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size or ids.unique().numel() != ids.numel():
                raise ConfigError(f"the EAGLE-3 head {folder} does not fit the target: d2t maps draft ids to "
                                  f"target ids outside [0, {cfg.vocab_size}) or to one id twice")
            head.target_ids.copy_(ids)
        elif cfg.draft_vocab_size != cfg.vocab_size:
            raise CheckpointError(f"{folder}: a draft vocabulary of {cfg.draft_vocab_size} ids needs d2t")
        if "t2d" in tensors and tuple(tensors["t2d"].shape) != (cfg.vocab_size,):
            raise CheckpointError(f"{folder}: t2d has shape {tuple(tensors['t2d'].shape)}, not ({cfg.vocab_size},)")
    head = head.to(device=target.device, dtype=target.dtype)  # (casts floating tensors only: target_ids stay int64)
    if tensors["fc.weight"].dtype == torch.bfloat16 and head.device.type == "cpu" and head.dtype == torch.float32:
        # As models.loader keeps a bfloat16 checkpoint's matrices on a CPU: stored in bfloat16, widened
        # (exactly) by the products, half the bytes a draft step reads (its lm_head is most of them).
        with torch.no_grad():
            for layer in (head.fc, head.qkv_proj, head.o_proj, head.gate_up_proj, head.down_proj, head.lm_head):
                layer.weight = nn.Parameter(layer.weight.to(torch.bfloat16), requires_grad=False)
        head.use_backend()
    return head.eval().requires_grad_(False)
