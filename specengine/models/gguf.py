"""GGUF files (llama.cpp's format) as models: config, weights, tokenizer.

A GGUF file (parsed by gguf_file) holds what a Hugging Face folder holds: metadata (which we turn
into a config.json dict, so one ModelConfig parser validates both), tensors under llama.cpp's
names (mapped here to transformers' names; kept as stored, or dequantized to float32 by
`gguf.quants`), and the tokenizer with its chat template (converted by transformers' GGUF
tokenizer support). Nothing is executed.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .gguf_file import GGUFError, GGUFFile

# llama.cpp's architecture names -> ours. llama.cpp writes Mistral as "llama" (told apart by
# its general.name, as transformers does).
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# llama.cpp's per-layer tensor names -> transformers' (the part after model.layers.N.).
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Precomputed rotary frequency factors (Llama 3.1+): checked against the llama3 rope config
# they imply, then not loaded (the model computes its own table).
_ROPE_FREQS = "rope_freqs.weight"


def open_gguf(path: str | Path) -> GGUFFile:
    """The file's fields and tensors, every tensor's data checked to lie inside the file."""
    return GGUFFile(path)


def gguf_config(file: GGUFFile, path: str | Path) -> dict:
    """The file's metadata as a Hugging Face config.json dict (weights stored in bfloat16)."""
    arch = file.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                        f"{', '.join(GGUF_ARCHITECTURES)} (llama also covers Mistral)")
    architecture = GGUF_ARCHITECTURES[arch]
    if arch == "llama" and "mistral" in str(file.get("general.name", "")).lower():
        architecture = "MistralForCausalLM"

    def need(key):
        value = file.get(f"{arch}.{key}")
        if value is None:
            raise GGUFError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    tensors = {t.name: t for t in file.tensors}
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    vocab = file.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = file.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else int(tensors["token_embd.weight"].shape[-1])
    cfg = {
        "architectures": [architecture],
        "model_type": "mistral" if architecture == "MistralForCausalLM" else arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(file.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(file.get(f"{arch}.attention.key_length", hidden // heads)),
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(file.get(f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "dtype": "bfloat16",
    }
    rope_dims = file.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != cfg["head_dim"]:
        raise GGUFError(f"{path}: rotary over {rope_dims} of {cfg['head_dim']} head dimensions "
                        "(partial rotary) is not supported")
    scaling = file.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise GGUFError(f"{path}: rope scaling {scaling!r} is not supported (none, linear, llama3)")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    if _ROPE_FREQS in tensors:
        cfg["rope_scaling"] = _llama3_rope(tensors[_ROPE_FREQS], cfg, path)
    window = file.get(f"{arch}.attention.sliding_window")
    if window and architecture == "MistralForCausalLM":
        cfg["sliding_window"] = int(window)
    for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        value = file.get(name)
        if value is not None:
            cfg[key] = int(value)
    return cfg


def _llama3_rope(freqs_tensor, cfg: dict, path) -> dict:
    """llama.cpp stores Llama 3.1's rope scaling as per-frequency divisors; find the llama3
    parameters that give them (Meta's releases differ only in the factor)."""
    from gguf.quants import dequantize

    stored = dequantize(freqs_tensor.data, freqs_tensor.tensor_type).reshape(-1).astype(np.float64)
    dim, theta = cfg["head_dim"], cfg["rope_theta"]
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    for factor in (8.0, 16.0, 32.0, 4.0, 2.0):
        low, high, original = 1.0, 4.0, 8192
        wavelen = 2 * math.pi / inv_freq
        smooth = (original / wavelen - low) / (high - low)
        divisor = np.where(wavelen > original / low, factor,
                           np.where(wavelen < original / high, 1.0, 1.0 / ((1 - smooth) / factor + smooth)))
        if stored.shape == divisor.shape and np.allclose(stored, divisor, rtol=1e-4):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": original}
    raise GGUFError(f"{path}: its rope_freqs tensor matches no llama3 rope scaling we know")


def _hf_name(gguf_name: str) -> str | None:
    base, _, kind = gguf_name.rpartition(".")
    if base in _MODEL_TENSORS:
        return f"{_MODEL_TENSORS[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{kind}"
    return None


def _array_shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in row-major order (GGUF lists the fastest dimension first)."""
    return tuple(int(n) for n in reversed(tensor.shape))


def _unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter reorders each head's q/k rows from halves (transformers' rotary) to
    interleaved pairs (its own); this puts them back."""
    rows = weights.shape[0]
    return weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _weights(file: GGUFFile, cfg: dict, path: str | Path):
    """(transformers name, GGUF tensor) for every weight of the file (rope_freqs, read as the
    config, is none)."""
    for t in file.tensors:
        if t.name == _ROPE_FREQS:
            continue
        name = _hf_name(t.name)
        if name is None:
            raise GGUFError(f"{path}: tensor {t.name} is not part of a {cfg['architectures'][0]}")
        yield name, t


def gguf_tensors(file: GGUFFile, cfg: dict, path: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """(transformers name, float32 array) for every weight of the file."""
    from gguf.quants import dequantize

    permute = cfg["model_type"] in ("llama", "mistral")
    for name, t in _weights(file, cfg, path):
        try:
            weights = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise GGUFError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which the gguf package "
                            "cannot dequantize") from None
        # A copy: unquantized tensors come back as read-only views of the mapped file.
        weights = np.array(weights, dtype=np.float32).reshape(_array_shape(t))
        if permute and name.endswith("q_proj.weight"):
            weights = _unpermute(weights, cfg["num_attention_heads"])
        elif permute and name.endswith("k_proj.weight"):
            weights = _unpermute(weights, cfg["num_key_value_heads"])
        yield name, weights


def gguf_stored_tensors(file: GGUFFile, cfg: dict, path: str | Path) -> Iterator[tuple[str, object]]:
    """(transformers name, tensor) for every weight of the file, matrices kept as stored: a
    MatrixPart (ops.blocks) viewing the file's mapped bytes (q and k rows are put back in
    transformers' order, which copies them), vectors as float32 tensors. A matrix of a type the
    runtime has no kernels for is dequantized to float32 once here, with a log line naming it."""
    import logging
    import warnings

    import torch
    from gguf.quants import dequantize

    from ..ops.blocks import BLOCK_LAYOUT, BlockFormatError, MatrixPart, WeightType, row_bytes

    log = logging.getLogger("specengine")
    permute = cfg["model_type"] in ("llama", "mistral")
    stored_types = {int(t) for t in BLOCK_LAYOUT}
    for name, t in _weights(file, cfg, path):
        shape = _array_shape(t)
        if len(shape) == 1:
            yield name, torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
            continue
        if len(shape) != 2:
            raise GGUFError(f"{path}: tensor {t.name} has {len(shape)} dimensions; a weight matrix has 2")
        if int(t.tensor_type) in stored_types:
            weight_type = WeightType(int(t.tensor_type))
            try:
                width = row_bytes(weight_type, shape[1])
            except BlockFormatError as e:
                raise GGUFError(f"{path}: tensor {t.name}: {e}") from None
            raw = t.data.view(np.uint8).reshape(shape[0], -1)
            if raw.shape[1] != width:
                raise GGUFError(f"{path}: tensor {t.name} holds rows of {raw.shape[1]} bytes; {shape[1]} "
                                f"{weight_type.name} weights take {width}")
        else:
            log.info("%s: tensor %s is %s, which runs dequantized to float32", Path(path).name, t.name,
                     t.tensor_type.name)
            try:
                values = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            except NotImplementedError:
                raise GGUFError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which neither this engine "
                                "nor the gguf package can dequantize") from None
            weight_type, raw = WeightType.F32, values.view(np.uint8)
        if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads" if name.endswith("q_proj.weight") else "num_key_value_heads"]
            raw = _unpermute(raw, heads)  # whole rows move: each row's blocks stay as they are
        with warnings.catch_warnings():  # the mapped file is read-only, and nothing writes to it
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            data = torch.from_numpy(np.ascontiguousarray(raw))
        yield name, MatrixPart(weight_type, data)


def gguf_tokenizer(path: str | Path):
    """The file's tokenizer (chat template included), converted by transformers."""
    from transformers import AutoTokenizer

    path = Path(path)
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise GGUFError(f"{path}: cannot build a tokenizer from its metadata: {e}") from None


def convert_gguf(path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Write a GGUF file as a Hugging Face folder: config.json, model.safetensors (bfloat16),
    tokenizer files with the chat template, generation_config.json. The folder appears whole
    or not at all (written beside it, then renamed)."""
    import json
    import os
    import shutil
    import tempfile

    import torch
    from safetensors.torch import save_file

    from .config import ModelConfig

    path, out_dir = Path(path), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty")
    file = open_gguf(path)
    cfg = gguf_config(file, path)
    ModelConfig.from_dict(cfg)  # refuse what we could not run before writing anything
    tokenizer = gguf_tokenizer(path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        tensors = {}
        items = gguf_tensors(file, cfg, path)
        if progress:
            from tqdm.auto import tqdm

            items = tqdm(items, total=len(file.tensors), desc=f"converting {path.name}", unit="tensor")
        for name, array in items:
            if not (cfg["tie_word_embeddings"] and name == "lm_head.weight"):
                tensors[name] = torch.from_numpy(array).to(torch.bfloat16)
        save_file(tensors, work / "model.safetensors", metadata={"format": "pt", "source": path.name})
        (work / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        generation = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg}
        (work / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        tokenizer.save_pretrained(str(work))
        # mkdtemp made the folder private and safetensors writes its file 0600 (through a temporary
        # file): give everything the mode a plain write would, as the other files have.
        umask = os.umask(0o022)  # reading the umask means setting it
        os.umask(umask)
        for item in work.rglob("*"):
            os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~umask)
        os.chmod(work, 0o777 & ~umask)
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(work, out_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out_dir


def requantize_gguf(path: str | Path, out: str | Path, type_name: str = "BF16") -> Path:
    """A copy of a GGUF file with every matrix dequantized and stored as `type_name` (1-D tensors
    stay as they are): the same weights for llama.cpp at another precision, e.g. the bfloat16
    that specengine holds a quantized file in."""
    import gguf
    from gguf.quants import dequantize, quantize

    file = open_gguf(path)
    qtype = gguf.GGMLQuantizationType[type_name]
    writer = gguf.GGUFWriter(str(out), str(file.get("general.architecture")))
    for field in file.fields.values():
        if field.name == "general.architecture":
            continue  # written by the writer itself
        value = field.value
        if field.name == "general.file_type":
            value = {"F32": 0, "F16": 1, "BF16": 32, "Q8_0": 7}.get(type_name, value)
        writer.add_key_value(field.name, value, field.value_type, sub_type=field.item_type)
    for t in file.tensors:
        if len(t.shape) < 2 or t.tensor_type == qtype:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
            continue
        rows = dequantize(t.data, t.tensor_type).reshape(_array_shape(t))
        writer.add_tensor(t.name, quantize(np.ascontiguousarray(rows, dtype=np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)
