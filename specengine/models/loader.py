"""Load local Hugging Face checkpoint folders through safetensors only.

Nothing from a checkpoint is executed or unpickled: weights come from *.safetensors
files (never torch.load), the config is JSON, and tokenizers load without remote code.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ..layers.parallel import TensorParallel, TensorParallelError
from .config import T5_ARCHITECTURE, CheckpointError, ConfigError, ModelConfig, read_config
from .llama import LlamaForCausalLM
from .t5 import T5ForConditionalGeneration
from .t5_config import T5Config

Model = LlamaForCausalLM | T5ForConditionalGeneration
AnyConfig = ModelConfig | T5Config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
log = logging.getLogger("specengine")
# Keys some checkpoints carry that hold nothing we need (recomputed buffers).
# (T5's cross-attention never had a relative bias; old checkpoints saved an unused one.)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "EncDecAttention.relative_attention_bias.weight")


def resolve_dtype(dtype: str | torch.dtype | None, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """None: float32 on CPU (fast, exact), the checkpoint's own dtype on GPU."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; choose one of {', '.join(DTYPES)}")
        return dtype
    if dtype is None:
        return DTYPES.get(cfg.dtype, torch.float32) if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_weight_dtype(weight_dtype: str | torch.dtype | None, compute_dtype: torch.dtype, cfg: ModelConfig,
                        device: torch.device) -> torch.dtype:
    """The storage dtype of the matrices (linear layers, embeddings).

    None: bfloat16 when a bfloat16 checkpoint computes in float32 on a CPU: a decode step
    streams every weight, and bfloat16 halves the bytes while holding the checkpoint's exact
    values (widening to float32 is exact). Otherwise the compute dtype.
    """
    if weight_dtype is None:
        keep_bf16 = device.type == "cpu" and compute_dtype == torch.float32 and cfg.dtype == "bfloat16"
        return torch.bfloat16 if keep_bf16 else compute_dtype
    resolved = resolve_dtype(weight_dtype, cfg, device)
    if resolved != compute_dtype and not (device.type == "cpu" and resolved == torch.bfloat16
                                          and compute_dtype == torch.float32):
        raise ValueError(f"weight_dtype {resolved} with compute dtype {compute_dtype} on {device} is not supported: "
                         "weights narrower than the compute dtype means bfloat16 weights, float32 compute, CPU")
    return resolved


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: model.safetensors or the shards of its index."""
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
    hint = f" (found {', '.join(pickled)}: pickled weights are never loaded; convert them to safetensors)" if pickled else ""
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {folder}{hint}")


def load_config(folder: str | Path) -> AnyConfig:
    """The config of a checkpoint folder: a decoder-only Llama-family model's or T5's."""
    path, raw = read_config(folder)
    parse = T5Config.from_dict if T5_ARCHITECTURE in (raw.get("architectures") or []) else ModelConfig.from_dict
    try:
        return parse(raw)
    except KeyError as e:
        raise ConfigError(f"{path} lacks the required field {e.args[0]!r}") from None


def empty_model(cfg: AnyConfig, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
                weight_dtype: str | torch.dtype | None = None, tp: TensorParallel | None = None,
                stored_matrices: bool = False) -> Model:
    """The model of `cfg` (this rank's share of it with tp) with uninitialised weights in the
    dtypes load_model would give them, on its default backend (models.backend). stored_matrices:
    its matrices are left empty, to be filled as a GGUF file stores them (computing in float32)."""
    device = torch.device(device)
    torch_dtype = torch.float32 if stored_matrices else resolve_dtype(dtype, cfg, device)
    matrix_dtype = torch_dtype if stored_matrices else resolve_weight_dtype(weight_dtype, torch_dtype, cfg, device)
    if isinstance(cfg, T5Config) and tp is not None:
        raise TensorParallelError("tensor parallelism splits decoder-only models; T5 runs in one process")
    with torch.device("meta"):
        model = (T5ForConditionalGeneration(cfg) if isinstance(cfg, T5Config)
                 else LlamaForCausalLM(cfg, tp, stored_matrices=stored_matrices))
    model = model.to_empty(device=device).to(torch_dtype)
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data = module.weight.data.to(matrix_dtype)
    if cfg.tie_word_embeddings and cfg.output_vocab_size is None and not stored_matrices:
        # to_empty allocates each module's parameters apart: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    if tp is not None:  # rows past the vocabulary on the last rank: never looked up, logits dropped
        with torch.no_grad():
            model.model.embed_tokens.weight.zero_()
            model.lm_head.weight.zero_()
    model.use_backend()  # the default for its device and dtypes, matrices included (models.backend)
    return model


def return_freed_memory():
    """Give the C heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere).
    Reading a GGUF file's metadata or converting a tokenizer makes ~100 MB of short-lived objects,
    whose freed pages glibc would otherwise keep: more than a small model's own size."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def is_gguf(path: str | Path) -> bool:
    """A GGUF file is told apart by its name, as llama.cpp's tools do."""
    return Path(path).suffix.lower() == ".gguf"


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
               weight_dtype: str | torch.dtype | None = None, tp: TensorParallel | None = None) -> Model:
    """A Hugging Face checkpoint folder, or a GGUF file (models.gguf).
    dtype: the compute dtype (None: float32 on CPU, the checkpoint's on GPU; a GGUF file's
    matrices kept as stored compute in float32).
    weight_dtype: the matrices' storage dtype (None: see resolve_weight_dtype). For a GGUF file,
    None keeps each matrix as the file stores it (its blocks, mapped from the file on a CPU: the
    file's own model at its own precision); a dtype dequantizes the matrices into that dtype.
    tp: this rank's share of a tensor-parallel split; from safetensors it reads only its slices
    (a GGUF file splits dequantized, as with a weight_dtype: each tensor whole, then sliced)."""
    path = Path(path)
    if is_gguf(path):
        return _load_gguf(path, device, dtype, weight_dtype, tp)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint folder {path} does not exist")
    cfg = load_config(path)
    model = empty_model(cfg, device, dtype, weight_dtype, tp)
    return fill_model(model, safetensors_tensors(path), path)


def _load_gguf(path: Path, device, dtype, weight_dtype, tp: TensorParallel | None) -> Model:
    from .gguf import gguf_config, gguf_stored_tensors, gguf_tensors, open_gguf

    file = open_gguf(path)
    raw = gguf_config(file, path)
    cfg = ModelConfig.from_dict(raw)
    if weight_dtype is not None or tp is not None:  # dequantized into dense matrices (of that dtype)
        if weight_dtype is None:  # the file's exact values, in float32
            log.info("%s: tensor parallelism splits dense matrices: the file's are dequantized to float32", path.name)
            weight_dtype, dtype = "float32", dtype or "float32"
        tensors = ((name, torch.from_numpy(array)) for name, array in gguf_tensors(file, raw, path))
        return fill_model(empty_model(cfg, device, dtype, weight_dtype, tp), tensors, path)
    if dtype is not None and resolve_dtype(dtype, cfg, torch.device(device)) != torch.float32:
        raise ValueError(f"{path}: matrices kept as the GGUF file stores them compute in float32, not {dtype}; "
                         "pass a weight_dtype to dequantize them instead")
    model = empty_model(cfg, device, dtype, weight_dtype, stored_matrices=True)
    model = fill_stored_model(model, gguf_stored_tensors(file, raw, path), path)
    del file
    return_freed_memory()
    return model


def fill_stored_model(model: LlamaForCausalLM, tensors, source: Path) -> LlamaForCausalLM:
    """A stored-matrix model filled from (name, MatrixPart or vector tensor) pairs: each matrix
    module gets its parts (copied to the model's device, where set_parts merges each run of one
    weight type: layers.blocks), the vectors load as fill_model loads them."""
    from ..ops.blocks import MatrixPart

    parts, vectors = {}, []
    for name, tensor in tensors:
        if isinstance(tensor, MatrixPart):
            parts[name] = tensor
        else:
            vectors.append((name, tensor))
    device = model.device
    modules = dict(model.named_modules())
    for module_name, names in model.stored_matrix_sources().items():
        missing = [n for n in names if n not in parts]
        if missing:
            raise CheckpointError(f"{source}: weights missing from the checkpoint: {', '.join(missing)}")
        module_parts = [parts.pop(n) for n in names]
        if device.type != "cpu":
            module_parts = [MatrixPart(p.weight_type, p.data.to(device)) for p in module_parts]
        try:
            modules[module_name].set_parts(module_parts)
        except ValueError as e:
            raise CheckpointError(f"{source}: {', '.join(names)}: {e}") from None
    if parts:
        raise CheckpointError(f"{source}: matrices not used by {model.config.architecture}: "
                              f"{', '.join(sorted(parts)[:5])}")
    model = fill_model(model, vectors, source)
    model.use_backend()  # the default now that the matrices are there (cpp-layers needs them)
    return model


def safetensors_tensors(folder: Path):
    """(name, slice) for every weight of a checkpoint folder's safetensors files: a slice reads
    from the file only the part it is indexed with."""
    for file in weight_files(folder):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if not name.endswith(_IGNORED_SUFFIXES):
                        yield name, f.get_slice(name)
        except SafetensorError as e:  # a truncated or corrupt file: header or data out of bounds
            raise CheckpointError(f"{file} is not a readable safetensors file (truncated or corrupt?): {e}") from None


def _shape(source) -> tuple[int, ...]:
    """The shape of a tensor or of a safetensors slice."""
    return tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())


def fill_model(model: Model, tensors, source: Path) -> Model:
    """Copy (name, tensor or safetensors slice) pairs into `model` by checkpoint name; every
    weight exactly once, and of a split model only this rank's part of it."""
    cfg = model.config
    params = model.checkpoint_tensors()
    parts = model.checkpoint_slices()
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in tensors:
        if name not in params:
            unexpected.append(name)
            continue
        target = params[name]
        shape, index = _shape(tensor), (slice(None),)
        expected = tuple(target.shape)
        if name in parts:
            dim, start, length, full = parts[name]
            expected = expected[:dim] + (full,) + expected[dim + 1:]
            index = (slice(None),) * dim + (slice(start, start + length),)
        if shape != expected:
            raise CheckpointError(f"{source}: weight {name} has shape {shape} but the config implies {expected}")
        with torch.no_grad():
            target.copy_(tensor[index])
        loaded.add(name)
    if unexpected and not (cfg.tie_word_embeddings and unexpected == ["lm_head.weight"]):
        raise CheckpointError(
            f"{source}: weights not used by {cfg.architecture}: {', '.join(sorted(unexpected)[:5])}"
            + (" ..." if len(unexpected) > 5 else "")
        )
    if cfg.tie_word_embeddings:
        loaded.add("lm_head.weight")  # shares embed_tokens.weight
    optional = getattr(model, "OPTIONAL_CHECKPOINT_TENSORS", frozenset())
    missing = sorted(set(params) - loaded - optional)
    if missing:
        raise CheckpointError(
            f"{source}: weights missing from the checkpoint: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else "")
        )
    if cfg.output_vocab_size is not None:
        ids = model.output_token_ids
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size or ids.unique().numel() != ids.numel():
            raise CheckpointError(f"{source}: lm_head.token_ids must be {cfg.output_vocab_size} distinct ids in "
                                  f"[0, {cfg.vocab_size})")
        if cfg.tie_word_embeddings:
            model.gather_output_rows()
    if hasattr(model, "finish_load"):
        model.finish_load(loaded)
    return model.eval().requires_grad_(False)
