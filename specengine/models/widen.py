"""Embed a trained Llama in a larger one that computes the same function.

Benchmarks need a target whose decode step is memory-bound (about 1B parameters on a GPU) AND a
real acceptance rate against the shipped draft; a randomly initialised model has the first but
accepts nothing. The widened model has both: it reads as many weight bytes per step as any model
of its shape (dense kernels do not look at values), and its logits are the source's.

How: the source's residual stream lives in the first hidden dimensions and the rest stay exactly
zero, because every matrix writing into the residual (embedding, o_proj, down_proj) has zero rows
there. Source heads keep their kv head (a wider GQA group holds the source's group in its first
slots); source MLP units are the first intermediate units. The extra heads, units and layers get
random weights on everything that reads the residual, but the matrices that would write their
output back are zero, so they cost time and change nothing. RMSNorm over the wider hidden size
sees the same sum of squares over more dimensions: scaling eps and the norm weights by
d_source / d_wide (the weights by its square root) gives the source's normalisation exactly.
"""
from __future__ import annotations

import dataclasses

import torch

from .llama import LlamaForCausalLM
from .loader import empty_model


def widen(source: LlamaForCausalLM, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int,
          num_layers: int, seed: int = 0) -> LlamaForCausalLM:
    """A LlamaForCausalLM of the given shape (the source's vocabulary, head_dim, rotary embedding,
    device and dtypes) whose logits equal the source's up to float rounding."""
    src = source.config
    problems = []
    if src.attention_bias or src.o_bias or src.mlp_bias or src.qk_norm or src.sliding_window is not None:
        problems.append("the source must be a plain Llama (no biases, no q/k norm, no sliding window)")
    for name, wide, small in (("hidden_size", hidden_size, src.hidden_size),
                              ("intermediate_size", intermediate_size, src.intermediate_size),
                              ("num_kv_heads", num_kv_heads, src.num_kv_heads), ("num_layers", num_layers, src.num_layers)):
        if wide < small:
            problems.append(f"{name} {wide} is smaller than the source's {small}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        problems.append(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    elif num_heads // num_kv_heads < src.num_heads // src.num_kv_heads:
        problems.append(f"query heads per kv head ({num_heads // num_kv_heads}) must be at least the source's "
                        f"({src.num_heads // src.num_kv_heads})")
    if problems:
        raise ValueError("widen: " + "; ".join(problems))

    ratio = src.hidden_size / hidden_size
    cfg = dataclasses.replace(src, hidden_size=hidden_size, intermediate_size=intermediate_size, num_heads=num_heads,
                              num_kv_heads=num_kv_heads, num_layers=num_layers, rms_norm_eps=src.rms_norm_eps * ratio)
    matrix_dtype = source.model.layers[0].mlp.down_proj.weight.dtype
    wide = empty_model(cfg, source.device, source.dtype, matrix_dtype)
    generator = torch.Generator(source.device).manual_seed(seed)
    D, I, hd = src.hidden_size, src.intermediate_size, src.head_dim
    src_group, wide_group = src.num_heads // src.num_kv_heads, num_heads // num_kv_heads
    # source query head h -> the same slot in its kv head's (wider) group
    head_map = [(h, (h // src_group) * wide_group + h % src_group) for h in range(src.num_heads)]

    def random_(t: torch.Tensor):
        t.copy_(torch.randn(t.shape, generator=generator, device=t.device) * 0.02)

    def norm_(wide_norm, src_norm):
        wide_norm.weight.fill_(ratio ** 0.5)
        wide_norm.weight[:D] = src_norm.weight * ratio ** 0.5

    with torch.no_grad():
        for p in wide.parameters():
            random_(p)
        wide.model.embed_tokens.weight.zero_()
        wide.model.embed_tokens.weight[:, :D] = source.model.embed_tokens.weight
        if not cfg.tie_word_embeddings:
            wide.lm_head.weight[:, :D] = source.lm_head.weight
        norm_(wide.model.norm, source.model.norm)
        for i, layer in enumerate(wide.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj.weight.zero_()
            mlp.down_proj.weight.zero_()
            if i >= src.num_layers:
                continue  # an extra layer: it computes, and adds zero to the residual
            s = source.model.layers[i]
            norm_(layer.input_layernorm, s.input_layernorm)
            norm_(layer.post_attention_layernorm, s.post_attention_layernorm)
            q, kv = attn.q_size, attn.kv_size
            wq = attn.qkv_proj.weight[:q].view(num_heads, hd, hidden_size)
            wk = attn.qkv_proj.weight[q:q + kv].view(num_kv_heads, hd, hidden_size)
            wv = attn.qkv_proj.weight[q + kv:].view(num_kv_heads, hd, hidden_size)
            sq, skv = s.self_attn.q_size, s.self_attn.kv_size
            src_qkv = s.self_attn.qkv_proj.weight
            src_q = src_qkv[:sq].view(src.num_heads, hd, D)
            wk[:src.num_kv_heads, :, :D] = src_qkv[sq:sq + skv].view(src.num_kv_heads, hd, D)
            wv[:src.num_kv_heads, :, :D] = src_qkv[sq + skv:].view(src.num_kv_heads, hd, D)
            wo = attn.o_proj.weight.view(hidden_size, num_heads, hd)
            src_o = s.self_attn.o_proj.weight.view(D, src.num_heads, hd)
            for h_src, h_wide in head_map:
                wq[h_wide, :, :D] = src_q[h_src]
                wo[:D, h_wide] = src_o[:, h_src]
            gate_up = mlp.gate_up_proj.weight
            gate_up[:I, :D] = s.mlp.gate_up_proj.weight[:I]
            gate_up[intermediate_size:intermediate_size + I, :D] = s.mlp.gate_up_proj.weight[I:]
            mlp.down_proj.weight[:D, :I] = s.mlp.down_proj.weight
    return wide.eval().requires_grad_(False)
