"""Tiny randomly initialised Hugging Face checkpoints, saved with transformers (and EAGLE-3
heads in the published layout).

Used by the tests (our model against transformers' on every supported architecture) and by
the pycode recipe's tokenizer. Random weights make gibberish: whoever shows their output must
say so.
"""
from __future__ import annotations

import dataclasses
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import torch

from ..kernels.weight_types import WEIGHT_TYPES

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


def save_random_eagle3_head(folder: str | Path, target_config, seed: int = 0, layer_ids: tuple[int, ...] = (0, 1, 2),
                            init_std: float = 0.3) -> Path:
    """Save a randomly initialised EAGLE-3 head for a target (its ModelConfig) in the published
    layout, by the runtime's writer (models.eagle3.save_eagle3): the target's width, heads, rope
    and norm epsilon, an MLP twice its width, an lm_head over the whole vocabulary, float32."""
    from ..models.eagle3 import Eagle3Config, draft_vocab_maps, published_shapes, save_eagle3

    tc = target_config
    cfg = dataclasses.replace(Eagle3Config.for_target(tc, tuple(layer_ids), tc.vocab_size),
                              intermediate_size=2 * tc.hidden_size)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in published_shapes(cfg).items():
        if name.endswith("norm.weight"):
            tensors[name] = 1 + torch.randn(shape, generator=g) * init_std
        elif len(shape) == 2:
            tensors[name] = torch.randn(shape, generator=g) * (2.0 if name == "lm_head.weight" else init_std)
    tensors["d2t"], tensors["t2d"] = draft_vocab_maps(torch.arange(tc.vocab_size), tc.vocab_size)
    return save_eagle3(folder, cfg, tensors, torch.float32)


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


# Where each K-quant block keeps its float16 scales (ggml's block_q*_K structs): the gguf package
# cannot quantize to these types, so their blocks are random codes under sane scales. Those run as
# stored from the weight-type table; Q2_K and Q3_K, which run dequantized to float32, here.
K_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,),
                   **{t.name: t.half_fields for t in WEIGHT_TYPES if t.name.endswith("_K")}}


def random_k_blocks(weight_type: str, rows: int, cols: int, rng, low: float, high: float):
    """Random blocks of a K-quant type, uint8 [rows, row_bytes] (numpy): random codes, each float16
    scale drawn uniformly from [low, high)."""
    return random_blocks(weight_type, rows, cols, rng, {offset: (low, high) for offset in K_SCALE_OFFSETS[weight_type]})


def random_blocks(weight_type: str, rows: int, cols: int, rng, scale_ranges: dict[int, tuple[float, float]]):
    """Random blocks of a GGUF block type, uint8 [rows, row_bytes] (numpy): random codes, and at each
    byte offset of scale_ranges a float16 scale drawn uniformly from its [low, high). Valid blocks of
    the type at any size (codes need no quantizing), for a type whose scales have different sizes
    (Q4_K's d and dmin) or that is not a K-quant (Q8_0's d at offset 0)."""
    import gguf
    import numpy as np

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[weight_type]]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset, (low, high) in scale_ranges.items():
        scales = rng.uniform(low, high, size=(rows, cols // block)).astype(np.float16)
        data[:, :, offset: offset + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def blocks_of(weights: torch.Tensor, weight_type: str, seed: int = 0) -> torch.Tensor:
    """A float matrix [N, K] in a GGUF weight type's bytes, uint8 [N, row_bytes]: quantized by the
    gguf package where it can (floats and the legacy block types), else (the K-quants) random
    blocks whose scales give weights of about the matrix's size (their values then are not it)."""
    import gguf
    import numpy as np
    from gguf.quants import quantize

    qtype = gguf.GGMLQuantizationType[weight_type]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if weights.dim() != 2 or weights.shape[1] % block:
        raise ValueError(f"{weight_type} rows are blocks of {block} weights; a matrix {list(weights.shape)} is not")
    w = weights.detach().float().numpy()
    if weight_type == "F32":
        return torch.from_numpy(np.ascontiguousarray(w).view(np.uint8).copy())
    if weight_type == "F16":
        return torch.from_numpy(w.astype(np.float16).view(np.uint8).copy())
    if weight_type in K_SCALE_OFFSETS:
        scale = float(np.abs(w).mean()) / 16 + 1e-6
        return torch.from_numpy(random_k_blocks(weight_type, *w.shape, np.random.default_rng(seed), 0.2 * scale, scale))
    return torch.from_numpy(np.ascontiguousarray(quantize(np.ascontiguousarray(w), qtype)))


def stored_copy(model, weight_type: str, seed: int = 0):
    """A copy of a dense LlamaForCausalLM whose matrices are kept in `weight_type` as a GGUF file
    would store them (models.llama's stored_matrices; see blocks_of for the K-quants), float32
    compute, on the CPU and its default backend."""
    from ..models.llama import LlamaForCausalLM
    from ..ops.blocks import MatrixPart, WeightType

    stored = LlamaForCausalLM(model.config, stored_matrices=True)
    dense = model.checkpoint_tensors()
    modules = dict(stored.named_modules())
    for i, (module_name, names) in enumerate(stored.stored_matrix_sources().items()):
        parts = [MatrixPart(WeightType[weight_type], blocks_of(dense[n], weight_type, seed + i)) for n in names]
        modules[module_name].set_parts(parts)
    with torch.no_grad():
        for name, tensor in stored.checkpoint_tensors().items():
            tensor.copy_(dense[name].float())
    stored.use_backend()
    return stored.eval().requires_grad_(False)
