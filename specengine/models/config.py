"""Model configuration parsed from a Hugging Face config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..layers.rotary import RopeConfig

# Architecture name in config.json -> the per-architecture switches of our one Llama-family model.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": dict(qkv_bias=None, qk_norm=False),
    "MistralForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias=None, qk_norm=True),
}
# The encoder-decoder architecture (models.t5, configured by models.t5_config).
T5_ARCHITECTURE = "T5ForConditionalGeneration"


class ConfigError(ValueError):
    """A checkpoint's config.json asks for something this engine does not implement."""


class CheckpointError(ValueError):
    """A checkpoint folder is missing, incomplete or does not match its config."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q, k, v (and o for Llama's attention_bias) projections
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None  # Mistral: keys within the last `sliding_window` positions
    dtype: str = "float32"  # the checkpoint's stored dtype
    eos_token_ids: tuple[int, ...] = ()
    # A head over only this many token ids (the checkpoint's lm_head.token_ids), every other id's
    # logit -inf: a draft's cheap head (q = 0 elsewhere, which speculative sampling allows). Tied,
    # its rows are the embedding's rows of those ids. specengine's own key: transformers ignores it
    # and runs the full tied head.
    output_vocab_size: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.output_vocab_size is not None and not 1 <= self.output_vocab_size <= self.vocab_size:
            raise ConfigError(f"output_vocab_size must be in [1, vocab_size={self.vocab_size}], "
                              f"got {self.output_vocab_size}")

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join([*SUPPORTED_ARCHITECTURES, T5_ARCHITECTURE])}"
            )
        switches = SUPPORTED_ARCHITECTURES[arch]
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        if raw.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError("partial_rotary_factor != 1 is not supported")

        sliding_window = None
        if arch == "MistralForCausalLM":
            sliding_window = raw.get("sliding_window")
        elif raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or []):
            raise ConfigError(f"{arch} with sliding-window layers is not supported")

        attention_bias = bool(raw.get("attention_bias", False))
        if switches["qkv_bias"] is not None:
            attention_bias = switches["qkv_bias"]
        # Llama and Qwen3 put attention_bias on all four projections, Qwen2 on q, k, v only.
        o_bias = attention_bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM")

        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope=parse_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=switches["qk_norm"],
            sliding_window=sliding_window,
            dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            eos_token_ids=eos_ids,
            output_vocab_size=raw.get("output_vocab_size"),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path, raw = read_config(folder)
        try:
            return cls.from_dict(raw)
        except KeyError as e:
            raise ConfigError(f"{path} lacks the required field {e.args[0]!r}") from None


def read_config(folder: str | Path) -> tuple[Path, dict]:
    """(the path of a checkpoint folder's config.json, its contents)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return path, raw


def parse_rope(raw: dict) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); older checkpoints write
    # `rope_theta` and an optional `rope_scaling` dict.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    fields = {k: params[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                     "original_max_position_embeddings") if k in params}
    try:
        return RopeConfig(theta=float(theta), rope_type=rope_type, **fields)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def rope_fields(rope: RopeConfig) -> dict:
    """A rope's config.json fields, as parse_rope reads them back: rope_theta, and rope_scaling
    for a scaled one (the form transformers 4 writes, which vLLM and SGLang read)."""
    if rope.rope_type == "default":
        return {"rope_theta": rope.theta}
    scaling = {"rope_type": rope.rope_type, "factor": rope.factor}
    if rope.rope_type == "llama3":
        scaling.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
                       original_max_position_embeddings=rope.original_max_position_embeddings)
    return {"rope_theta": rope.theta, "rope_scaling": scaling}
