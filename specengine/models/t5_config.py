"""T5 encoder-decoder configuration parsed from a Hugging Face config.json
(T5ForConditionalGeneration: original T5 with ReLU, v1.1 and Flan-T5 with gated GELU)."""
from __future__ import annotations

from dataclasses import dataclass

from .config import T5_ARCHITECTURE, ConfigError

# feed_forward_proj's activation -> how the MLP applies it (transformers' ACT2FN names).
T5_ACTIVATIONS = ("relu", "gelu", "gelu_new", "silu")


@dataclass(frozen=True)
class T5Config:
    vocab_size: int
    d_model: int
    d_kv: int                      # per-head width of q, k, v
    d_ff: int
    num_layers: int                # encoder blocks
    num_decoder_layers: int
    num_heads: int
    activation: str                # one of T5_ACTIVATIONS
    gated: bool                    # v1.1: act(wi_0 x) * wi_1 x; original: act(wi x)
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    # Original T5 scales the decoder output by d_model**-0.5 before a head tied to the embedding;
    # v1.1 (config tie_word_embeddings false) neither scales nor, in its checkpoints, ties.
    scale_decoder_outputs: bool = True
    decoder_start_token_id: int = 0
    eos_token_ids: tuple[int, ...] = (1,)
    # Relative positions put no hard limit on either side; these bound what a request may hold
    # (n_positions where the config has it: the length the model was trained at).
    max_source_positions: int = 512
    max_position_embeddings: int = 512   # decoder tokens, the decoder start token included
    dtype: str = "float32"
    architecture: str = T5_ARCHITECTURE
    # What code that also loads decoder-only models reads of a config.
    tie_word_embeddings: bool = False    # the head is tied only when a checkpoint lacks lm_head.weight
    output_vocab_size: None = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
                     "relative_attention_num_buckets", "relative_attention_max_distance", "max_source_positions",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"T5 config {name} must be >= 1, got {getattr(self, name)}")
        if self.activation not in T5_ACTIVATIONS:
            raise ConfigError(f"T5 feed_forward_proj activation {self.activation!r} is not supported; "
                              f"supported: {', '.join(T5_ACTIVATIONS)} (optionally 'gated-')")
        if self.relative_attention_num_buckets < 4:
            raise ConfigError("relative_attention_num_buckets must be >= 4 (half exact, half logarithmic, "
                              f"per direction), got {self.relative_attention_num_buckets}")
        if not 0 <= self.decoder_start_token_id < self.vocab_size:
            raise ConfigError(f"decoder_start_token_id {self.decoder_start_token_id} is outside the vocabulary "
                              f"[0, {self.vocab_size})")

    @property
    def hidden_size(self) -> int:
        return self.d_model

    @classmethod
    def from_dict(cls, raw: dict) -> "T5Config":
        proj = str(raw.get("feed_forward_proj", "relu"))
        parts = proj.split("-")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
            raise ConfigError(f"T5 feed_forward_proj {proj!r} is not 'ACT' or 'gated-ACT'")
        gated, activation = len(parts) == 2, parts[-1]
        if proj == "gated-gelu":  # transformers' reading: the tanh approximation
            activation = "gelu_new"
        eos = raw.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        pad = raw.get("pad_token_id", 0)
        start = raw.get("decoder_start_token_id")
        if start is None:
            start = pad if pad is not None else 0
        positions = int(raw.get("n_positions") or 512)
        return cls(
            vocab_size=raw["vocab_size"], d_model=raw["d_model"], d_kv=raw["d_kv"], d_ff=raw["d_ff"],
            num_layers=raw["num_layers"], num_decoder_layers=raw.get("num_decoder_layers") or raw["num_layers"],
            num_heads=raw["num_heads"], activation=activation, gated=gated,
            relative_attention_num_buckets=raw.get("relative_attention_num_buckets", 32),
            relative_attention_max_distance=raw.get("relative_attention_max_distance", 128),
            layer_norm_epsilon=raw.get("layer_norm_epsilon", 1e-6),
            scale_decoder_outputs=raw.get("tie_word_embeddings", True) is not False,
            decoder_start_token_id=start, eos_token_ids=eos_ids,
            max_source_positions=positions, max_position_embeddings=positions,
            dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        )
