"""Tiny GGUF files written the way llama.cpp's converter writes them, for the GGUF tests."""
from __future__ import annotations

import numpy as np
import torch

from specengine.devtools.tiny import K_SCALE_OFFSETS as _K_SCALES
from specengine.devtools.tiny import random_k_blocks as tiny_random_k_blocks

# Our architecture -> llama.cpp's (Mistral is written as llama, named in general.name).
GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3"}
_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    base, _, kind = hf_name.rpartition(".")
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if base in top:
        return f"{top[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}.{kind}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (pairs interleaved per head)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(qtype_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with small scales (0.002-0.01): weights of a few hundredths."""
    return tiny_random_k_blocks(qtype_name, rows, cols, rng, 0.002, 0.01)


def write_gguf(path, config, state_dict: dict[str, torch.Tensor], types: dict[str, str] | None = None,
               name: str = "tiny", architecture: str | None = None, seed: int = 0,
               rope_freqs: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Write an HF state dict as llama.cpp would. types: tensor-name substring -> GGML type name
    for the matrices (default F32; 1-D tensors stay F32 as llama.cpp keeps them). K-quant
    matrices get random blocks instead of the given weights. Returns the arrays written."""
    import gguf
    from gguf.quants import quantize

    arch = architecture or GGUF_ARCH[config.architectures[0]]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "sliding_window", None) and config.architectures[0] == "MistralForCausalLM":
        writer.add_sliding_window(config.sliding_window)
    if config.eos_token_id is not None:
        writer.add_eos_token_id(config.eos_token_id)
    rng = np.random.default_rng(seed)
    written = {}
    if rope_freqs is not None:  # llama.cpp's form of Llama 3.1's rope scaling: per-frequency divisors
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for hf_name, tensor in state_dict.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = tensor.detach().float().numpy()
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            w = permute(w, config.num_attention_heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            w = permute(w, config.num_key_value_heads)
        qname = "F32"
        if w.ndim == 2:
            qname = next((t for key, t in (types or {}).items() if key in hf_name), "F32")
        qtype = gguf.GGMLQuantizationType[qname]
        if qname in _K_SCALES:
            data = random_k_blocks(qname, *w.shape, rng)
        else:
            data = quantize(np.ascontiguousarray(w), qtype)
        writer.add_tensor(gguf_name(hf_name), data, raw_dtype=qtype)
        written[hf_name] = data
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


# The committed GGUF files of every stored type (made by recipes/make_test_gguf.py; README.md there).
GGUF_FILES_DIR = __import__("pathlib").Path(__file__).resolve().parent / "data" / "gguf"


def gguf_files_manifest() -> dict:
    """tests/data/gguf/manifest.json: per file, its model, llama-quantize type, bytes, sha256 and
    every tensor's ggml type."""
    import json

    return json.loads((GGUF_FILES_DIR / "manifest.json").read_text())


def gguf_file(name: str):
    """A committed test file's path, e.g. gguf_file("tiny-llama.Q4_K_M.gguf")."""
    return GGUF_FILES_DIR / name


def tensor_types(path) -> dict[str, str]:
    """Tensor name -> ggml type name, as the file stores them."""
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
