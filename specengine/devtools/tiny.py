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


def make_t5_config(vocab_size: int = 512, d_model: int = 64, d_kv: int = 16, d_ff: int = 128, num_layers: int = 2,
                   num_decoder_layers: int | None = None, num_heads: int = 4, feed_forward_proj: str = "relu",
                   tie_word_embeddings: bool = True, eos_token_id: int = 1, **overrides):
    """A transformers T5Config (original T5 with "relu", v1.1 / Flan-T5 with "gated-gelu" and
    tie_word_embeddings=False)."""
    import transformers

    kwargs = dict(vocab_size=vocab_size, d_model=d_model, d_kv=d_kv, d_ff=d_ff, num_layers=num_layers,
                  num_decoder_layers=num_decoder_layers, num_heads=num_heads, feed_forward_proj=feed_forward_proj,
                  tie_word_embeddings=tie_word_embeddings, eos_token_id=eos_token_id, pad_token_id=0,
                  decoder_start_token_id=0, architectures=["T5ForConditionalGeneration"])
    kwargs.update(overrides)
    return transformers.T5Config(**kwargs)


def save_random_t5_checkpoint(folder: str | Path, config, tokenizer=None, seed: int = 0,
                              dtype: torch.dtype = torch.float32, init_scale: float = 1.0):
    """Save a randomly initialised T5ForConditionalGeneration (safetensors) and optionally a tokenizer.

    A config with tie_word_embeddings=False (v1.1) gets an lm_head of its own in the file, as
    v1.1 checkpoints hold: transformers 5 builds the model tied and unties it on loading only
    when the file holds a distinct head. init_scale multiplies transformers' initialisation (it
    makes random T5 logits nearly flat; larger weights make peaked, draft-like distributions)."""
    import json

    from safetensors.torch import save_file
    from transformers import T5ForConditionalGeneration

    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(config).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(init_scale)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()
               if not name.endswith("embed_tokens.weight")}
    untied = config.to_dict().get("tie_word_embeddings") is False or not getattr(config, "scale_decoder_outputs", True)
    if untied:
        tensors["lm_head.weight"] = (torch.randn(config.vocab_size, config.d_model) * init_scale).to(dtype)
    else:
        tensors.pop("lm_head.weight", None)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    raw = config.to_dict()
    raw["tie_word_embeddings"] = not untied
    raw["dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder
