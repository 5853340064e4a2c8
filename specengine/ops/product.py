"""The matrix product of every model layer: x [..., K] @ W^T + bias -> [..., N], W a dense tensor
[N, K] or a BlockMatrix kept as a GGUF file stores it (ops.blocks).

A model's backend (models.backend) carries its product, PRODUCTS[its ops' implementation], and
sets it into its layers (layers.linear.ProductLayer) when it is chosen, so that a forward asks no
backend flags:

  cpp_backend_product     "cpp-layers" and "cpp-ops": product_cpp
  triton_backend_product  "triton": product_triton
  product_reference       "torch"

While gradients are enabled (training) the first two run product_reference, as the model's other
ops run torch's then (models.backend): the C++ ops and the Triton kernels have no autograd.

  product_cpp        specengine._C, CPU, float32 activations: below GEMM_MIN_TOKENS_PER_ROW tokens
                     per row the few-row ops (ops.linear's bfloat16 op for dense bfloat16 weights,
                     ops.blocks_cpp's for the rest), from there on GEMMs (ops.linear's AMX op for
                     dense bfloat16 weights where the CPU has AMX, else ops.blocks_cpp's gemm_blocks)
  product_triton     specengine.kernels.blocks for a BlockMatrix, torch's for a dense W
  product_reference  F.linear on the weights dequantized, or widened, to x's dtype

Each row's result on the C++ paths depends only on its row of x and the weights, never on the
rows beside it (speculation's exactness rests on it: a row verified in a batch gets the bits it
gets alone).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .blocks import BlockMatrix, dequantize_reference
from .blocks_cpp import few_row_blocks_cpp, gemm_blocks_cpp
from .linear import amx_available, gemm_bf16_weight_amx_cpp, linear_bf16_weight_cpp

# From this many tokens per row (x [..., T, K] with T >= it: a prefill) the C++ products are GEMMs.
# The AMX op on CPUs with AMX (float32-accurate), else gemm_blocks: they reuse each dequantized
# panel of weights over many rows, while below it the few-row ops, which stream the weights once
# for all rows, are as fast or faster (measured: see bench/results/kernel-tuning-2026-11-29-to-12-03.md).
# Decided on tokens per row, not rows in all, so that a decoding row takes the same path in a
# batch of any size (verifications have at most max_gamma + 1 tokens per row, below it:
# engine.config.MAX_GAMMA; a 2-d x is rows of one token). The prefill's chunk
# (engine.prefill_budget.CHUNK), the prefix cache's block and the whole-layer ops' use
# (models.llama, models.t5) follow it.
GEMM_MIN_TOKENS_PER_ROW = 32


def gemm_sized(tokens_per_row: int) -> bool:
    """Whether a call of tokens_per_row tokens per row takes the GEMM path: the one place that
    decides, for the C++ products, the Triton products (kernels.blocks takes the decision), the
    whole-layer ops' use (models.llama, models.t5) and the prefill's calls (steps.feed)."""
    return tokens_per_row >= GEMM_MIN_TOKENS_PER_ROW


def product_gemm_sized(x: torch.Tensor) -> bool:
    """gemm_sized for a product's x [..., T, K]: T tokens per row; a 2-d x is rows of one token."""
    return gemm_sized(x.shape[-2] if x.dim() >= 3 else 1)


def product_cpp(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """The product on specengine._C's ops (x float32 on the CPU; weight a dense float32, float16 or
    bfloat16 tensor, or a BlockMatrix on the CPU)."""
    dense_bf16 = isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16
    if isinstance(weight, torch.Tensor) and not weight.is_contiguous():
        weight = weight.contiguous()
    if product_gemm_sized(x):
        if dense_bf16 and amx_available():
            return gemm_bf16_weight_amx_cpp(x, weight, bias)
        return gemm_blocks_cpp(x, weight, bias)
    if dense_bf16:
        return linear_bf16_weight_cpp(x, weight, bias)
    return few_row_blocks_cpp(x, weight, bias)


def product_triton(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """The product on specengine.kernels.blocks for a BlockMatrix (CUDA tensors, or CPU ones in
    Triton's interpreter), torch's for a dense weight."""
    if not isinstance(weight, BlockMatrix):
        return product_reference(x, weight, bias)
    from .blocks_triton import linear_blocks_triton

    return linear_blocks_triton(x, weight, bias)


def product_reference(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear on the weights as x's dtype: a BlockMatrix dequantized (ops.blocks'
    dequantize_reference), a dense weight of another dtype (bfloat16 weights of a float32 model)
    widened."""
    if isinstance(weight, BlockMatrix):
        weight = dequantize_reference(weight)
    return F.linear(x, weight.to(x.dtype), bias)


def cpp_backend_product(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """The "cpp-layers" and "cpp-ops" backends' product: product_cpp, or product_reference while
    gradients are enabled."""
    if torch.is_grad_enabled():
        return product_reference(x, weight, bias)
    return product_cpp(x, weight, bias)


def triton_backend_product(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """The "triton" backend's product: product_triton, or product_reference while gradients are enabled."""
    if torch.is_grad_enabled():
        return product_reference(x, weight, bias)
    return product_triton(x, weight, bias)


# The product a backend runs, by its ops' implementation (Backend.impl -> Backend.product).
PRODUCTS = {"cpp": cpp_backend_product, "triton": triton_backend_product, "reference": product_reference}
