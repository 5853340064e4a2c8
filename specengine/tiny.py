"""Tiny randomly initialised Hugging Face checkpoints, saved with transformers.

Used by the tests (our model against transformers' on every supported architecture) and by
the pycode recipe's tokenizer. Random weights make gibberish: whoever shows their output must
say so.
"""
from __future__ import annotations

import sysconfig
from collections.abc import Iterable
from pathlib import Path

import torch

EOS_TOKEN = "<|endoftext|>"

_CONFIG_CLASSES = {
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
}


def stdlib_text(max_chars: int = 200_000) -> str:
    """Python source from the running interpreter's standard library: offline on every machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "\n".join(parts)[:max_chars]


def train_tokenizer(vocab_size: int = 512, texts: Iterable[str] | None = None, model_max_length: int | None = None,
                    show_progress: bool = False):
    """A byte-level BPE tokenizer (transformers PreTrainedTokenizerFast) with an end-of-text token,
    trained on `texts` (default: a slice of the standard library). The shipped pair's recipe uses it too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=show_progress,
    )
    tok.train_from_iterator(texts if texts is not None else [stdlib_text()], trainer=trainer)
    extra = {} if model_max_length is None else {"model_max_length": model_max_length}
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, **extra)


def make_config(architecture: str = "LlamaForCausalLM", vocab_size: int = 512, hidden_size: int = 64,
                num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int | None = None,
                max_position_embeddings: int = 512, eos_token_id: int | None = 0, **overrides):
    import transformers

    if architecture not in _CONFIG_CLASSES:
        raise ValueError(f"unknown architecture {architecture!r}; known: {', '.join(_CONFIG_CLASSES)}")
    config_cls = getattr(transformers, _CONFIG_CLASSES[architecture])
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size or 2 * hidden_size, max_position_embeddings=max_position_embeddings,
        eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None, architectures=[architecture],
    )
    if architecture == "Qwen3ForCausalLM":
        kwargs["head_dim"] = hidden_size // num_heads
    kwargs.update(overrides)
    return config_cls(**kwargs)


def save_random_checkpoint(folder: str | Path, config, tokenizer=None, seed: int = 0,
                           init_std: float | None = None, dtype: torch.dtype = torch.float32):
    """Save a randomly initialised AutoModelForCausalLM (safetensors) and optionally a tokenizer."""
    from transformers import AutoModelForCausalLM

    if init_std is not None:
        config.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    folder = Path(folder)
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return model
