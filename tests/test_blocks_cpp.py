"""The C++ block-format ops (specengine.ops.blocks_cpp, csrc/blocks.cpp) against gguf's numpy
dequantization and ops.blocks' torch reference, on every instruction-set path."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from specengine import _C
from specengine.ops.attention import cached_attention
from specengine.ops.blocks import (BLOCK_LAYOUT, FLOAT_TYPES, LAYOUTS, BlockMatrix, MatrixPart, WeightType,
                                   dequantize_reference, embedding_rows, linear_blocks)
from specengine.ops.blocks_cpp import dequantize_rows_cpp, gemm_blocks_cpp, matrix_descriptor
from specengine.ops.product import GEMM_MIN_TOKENS_PER_ROW
from specengine.ops.decoder_layer import DecoderLayerWeights, decoder_layer
from specengine.ops.norm import rms_norm

from bounds import Float64Llama, assert_within, assert_within_product_bound, within_product_bound
from conftest import cpu_isa_limit
from gguf_util import random_k_blocks

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize  # noqa: E402

ISAS = ["avx512", "avx2", "portable"]
TYPES = list(WeightType)
K_QUANTS = {t for t in TYPES if BLOCK_LAYOUT[t][0] == 256}
FLOATS = FLOAT_TYPES
# Where each block keeps its float16 scale fields (ggml's block structs).
SCALE_OFFSETS = {t: LAYOUTS[t].half_fields for t in TYPES if t not in FLOATS}


def finite_halves(rng, shape) -> np.ndarray:
    """Random float16 bit patterns, every kind but inf and NaN (zeros, subnormals, both signs)."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    return np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits).astype(np.uint16)


def random_blocks(weight_type: WeightType, rows: int, cols: int, rng, kind: str = "bits") -> np.ndarray:
    """uint8 [rows, row bytes] of valid blocks. kind "bits": random bytes with finite float16 scales
    (every code and scale pattern); "gguf": gguf's own quantization of normal weights (the legacy
    types; the K-quants, which gguf cannot quantize, get tests/gguf_util's random blocks)."""
    block, size = BLOCK_LAYOUT[weight_type]
    if weight_type in FLOATS:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        if weight_type == WeightType.F16:
            w = w.astype(np.float16) if kind == "gguf" else finite_halves(rng, (rows, cols)).view(np.float16)
        elif weight_type == WeightType.BF16:
            bits = finite_halves(rng, (rows, cols)) if kind == "bits" else (w.view(np.uint32) >> 16).astype(np.uint16)
            w = bits.astype(np.uint16)
        elif kind == "bits":
            bits = rng.integers(0, 1 << 32, size=(rows, cols), dtype=np.uint32)
            w = np.where((bits & 0x7F800000) == 0x7F800000, bits & 0x807FFFFF, bits).view(np.float32)
        return np.ascontiguousarray(w).view(np.uint8).reshape(rows, -1)
    if kind == "gguf":
        if weight_type in K_QUANTS:
            return random_k_blocks(weight_type.name, rows, cols, rng)
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        w[0, :block] = 0.0  # an all-zero block (d = 0)
        if rows > 1:
            w[1, :block] = 0.5  # a constant block
        return gguf_quantize(w, gguf.GGMLQuantizationType[weight_type.name]).reshape(rows, -1)
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[weight_type]:
        data[:, :, offset:offset + 2] = finite_halves(rng, (rows, cols // block)).view(np.uint8).reshape(
            rows, cols // block, 2)
    return data.reshape(rows, -1)


def gguf_weights(weight_type: WeightType, data: np.ndarray) -> np.ndarray:
    """gguf's numpy dequantization: float32 [rows, K] (the oracle of every weight's value)."""
    if weight_type == WeightType.F32:
        return data.view(np.float32)
    return gguf_dequantize(data, gguf.GGMLQuantizationType[weight_type.name]).astype(np.float32)


def matrix(*parts: tuple[WeightType, np.ndarray]) -> BlockMatrix:
    return BlockMatrix(tuple(MatrixPart(t, torch.from_numpy(np.ascontiguousarray(d))) for t, d in parts))


def widths(weight_type: WeightType) -> list[int]:
    """In-features to test: one block, odd multiples of the block, a model's width; the float types
    also widths no multiple of the products' 32-weight steps (a tail)."""
    if weight_type in K_QUANTS:
        return [256, 768]
    if weight_type in FLOATS:
        return [1, 7, 45, 96, 576]
    return [32, 96, 160, 576]


# ---- dequantization: bit for bit gguf's ------------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["bits", "gguf"])
@pytest.mark.parametrize("weight_type", TYPES, ids=lambda t: t.name)
def test_dequantize_rows_is_gguf_bit_for_bit(weight_type, kind, isa):
    rng = np.random.default_rng(int(weight_type) * 7 + len(kind))
    K = 512 if weight_type in K_QUANTS else 96
    data = random_blocks(weight_type, 37, K, rng, kind)
    want = gguf_weights(weight_type, data)
    m = matrix((weight_type, data))
    with cpu_isa_limit(isa):
        got = dequantize_rows_cpp(m).numpy()
        middle = dequantize_rows_cpp(m, 5, 30).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(middle.view(np.uint32), want[5:30].view(np.uint32))


@pytest.mark.parametrize("isa", ISAS)
def test_dequantize_rows_across_parts_and_float_tails(isa):
    """Row ranges that straddle parts of different types; float rows whose K leaves a tail."""
    rng = np.random.default_rng(1)
    parts = [(WeightType.Q4_K, random_blocks(WeightType.Q4_K, 5, 512, rng)),
             (WeightType.Q4_K, random_blocks(WeightType.Q4_K, 3, 512, rng)),
             (WeightType.Q6_K, random_blocks(WeightType.Q6_K, 4, 512, rng))]
    want = np.concatenate([gguf_weights(t, d) for t, d in parts])
    floats = [(WeightType.F16, random_blocks(WeightType.F16, 3, 45, rng)),
              (WeightType.BF16, random_blocks(WeightType.BF16, 2, 45, rng)),
              (WeightType.F32, random_blocks(WeightType.F32, 2, 45, rng))]
    want_floats = np.concatenate([gguf_weights(t, d) for t, d in floats])
    with cpu_isa_limit(isa):
        for begin, end in [(0, 12), (4, 9), (5, 8), (7, 12), (11, 12), (3, 3)]:
            got = dequantize_rows_cpp(matrix(*parts), begin, end).numpy()
            np.testing.assert_array_equal(got.view(np.uint32), want[begin:end].view(np.uint32))
        got = dequantize_rows_cpp(matrix(*floats)).numpy()
        np.testing.assert_array_equal(got.view(np.uint32), want_floats.view(np.uint32))


def test_a_weight_one_ulp_off_would_fail_the_bit_for_bit_test():
    """The planted bug of exactness: one weight one ulp from gguf's (what a different rounding
    would give) fails the comparison above, which a tolerance would let pass."""
    rng = np.random.default_rng(3)
    data = random_blocks(WeightType.Q6_K, 8, 256, rng, "gguf")
    want = gguf_weights(WeightType.Q6_K, data)
    got = dequantize_rows_cpp(matrix((WeightType.Q6_K, data))).numpy().copy()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    got[3, 77] = np.nextafter(got[3, 77], np.float32(np.inf))
    assert np.allclose(got, want, rtol=1e-6, atol=0)
    assert not np.array_equal(got.view(np.uint32), want.view(np.uint32))


# ---- products: the reference, within float32 summation error ------------------------------------


def check_product(m: BlockMatrix, x: torch.Tensor, bias: torch.Tensor | None):
    want = linear_blocks(x, m, bias, impl="reference")
    got = linear_blocks(x, m, bias, impl="cpp")
    assert got.shape == want.shape and got.dtype == torch.float32
    # Both are float32 products of the same dequantized weights, in different summation orders:
    # each within a float32 sum's bound (tests/bounds.py) of the exact product.
    w = dequantize_reference(m)
    assert_within_product_bound(want, x, w, bias)
    assert_within_product_bound(got, x, w, bias)


ROWS = [1, 2, 3, 5, 8, 17, 31, 32, 33, 64, 65]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("weight_type", TYPES, ids=lambda t: t.name)
def test_linear_blocks_matches_the_reference(weight_type, isa):
    rng = np.random.default_rng(int(weight_type))
    g = torch.Generator().manual_seed(int(weight_type))
    with cpu_isa_limit(isa):
        for K in widths(weight_type):
            for N in (1, 7, 111):
                m = matrix((weight_type, random_blocks(weight_type, N, K, rng, "gguf")))
                bias = torch.randn(N, generator=g)
                for R in ROWS:
                    x = torch.randn(R, K, generator=g)
                    check_product(m, x, bias if R % 2 else None)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [(1, GEMM_MIN_TOKENS_PER_ROW), (1, 33), (2, 40), (1, 65), (3, 64)])
@pytest.mark.parametrize("weight_type", [WeightType.Q4_1, WeightType.Q8_0, WeightType.Q6_K, WeightType.F16],
                         ids=lambda t: t.name)
def test_prompt_sized_products_match_the_reference(weight_type, shape, isa):
    """GEMM_MIN_TOKENS_PER_ROW or more tokens per row: panels of rows dequantized, then float32 GEMM tiles."""
    rng = np.random.default_rng(5)
    g = torch.Generator().manual_seed(5)
    K = 512 if weight_type in K_QUANTS else 96
    m = matrix((weight_type, random_blocks(weight_type, 37, K, rng, "gguf")))
    with cpu_isa_limit(isa):
        check_product(m, torch.randn(*shape, K, generator=g), torch.randn(37, generator=g))


@pytest.mark.parametrize("isa", ISAS)
def test_prompt_sized_products_cross_panels_and_parts(isa):
    """Matrices of several 32-row panels whose edges fall inside parts of different types: every
    panel's rows land in their own columns."""
    rng = np.random.default_rng(6)
    m = matrix((WeightType.Q4_1, random_blocks(WeightType.Q4_1, 23, 96, rng, "gguf")),
               (WeightType.Q8_0, random_blocks(WeightType.Q8_0, 12, 96, rng, "gguf")),
               (WeightType.F16, random_blocks(WeightType.F16, 40, 96, rng, "gguf")))
    with cpu_isa_limit(isa):
        check_product(m, torch.randn(2, 40, 96), torch.randn(75))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("N", [(64, 16, 16), (7, 5, 3), (1, 1, 1)])
def test_mixed_type_parts_match_the_reference(N, isa):
    """A Q4_K_M file's packed q, k, v (Q4_K, Q4_K, Q6_K), a mix of legacy and float parts, and
    bfloat16 parts beside a float32 one."""
    rng = np.random.default_rng(sum(N))
    g = torch.Generator().manual_seed(sum(N))
    mixes = [((WeightType.Q4_K, 512), (WeightType.Q4_K, 512), (WeightType.Q6_K, 512)),
             ((WeightType.Q4_1, 96), (WeightType.Q8_0, 96), (WeightType.F16, 96)),
             ((WeightType.Q5_K, 256), (WeightType.Q4_K, 256), (WeightType.Q5_K, 256)),
             ((WeightType.BF16, 45), (WeightType.BF16, 45), (WeightType.F32, 45))]
    with cpu_isa_limit(isa):
        for mix in mixes:
            m = matrix(*((t, random_blocks(t, n, K, rng, "gguf")) for (t, K), n in zip(mix, N)))
            for R in (1, 3, 5, 17, 33):
                check_product(m, torch.randn(R, m.in_features, generator=g), torch.randn(sum(N), generator=g))
            check_product(m, torch.randn(2, 3, m.in_features, generator=g), None)  # [B, T, K]


@pytest.mark.parametrize("isa", ISAS)
def test_bfloat16_parts_give_the_bits_of_the_dense_bfloat16_product(isa):
    """A bfloat16 matrix has one product (the BF16 entry of blocks.cpp's type table): in one part,
    split in parts (a packed q, k, v) or as a dense tensor, on 1 and 2 threads, the same bits."""
    from specengine.ops.linear import linear_bf16_weight

    g = torch.Generator().manual_seed(5)
    threads = torch.get_num_threads()
    with cpu_isa_limit(isa):
        for N, K, R in ((7, 45, 1), (96, 576, 3), (130, 33, 5), (64, 1536, 17)):
            w, bias = (torch.randn(N, K, generator=g) * 0.1).bfloat16(), torch.randn(N, generator=g)
            x = torch.randn(R, K, generator=g)
            as_bytes = lambda rows: rows.view(torch.uint8).reshape(len(rows), 2 * K)  # noqa: E731
            one = BlockMatrix((MatrixPart(WeightType.BF16, as_bytes(w)),))
            split = BlockMatrix(tuple(MatrixPart(WeightType.BF16, as_bytes(rows)) for rows in w.split(N // 3 + 1)))
            try:
                torch.set_num_threads(1)
                want = linear_bf16_weight(x, w, bias, impl="cpp")
                assert within_product_bound(want, x, w.float(), bias)  # a product of these weights
                torch.set_num_threads(2)
                for m in (one, split):
                    assert torch.equal(linear_blocks(x, m, bias, impl="cpp"), want), (N, K, R, len(m.parts))
                assert torch.equal(linear_bf16_weight(x, w, bias, impl="cpp"), want)
            finally:
                torch.set_num_threads(threads)


# csrc/blocks.cpp's AVX-512 path reads these formats' weights in "lane order" (lane l of each 16 holds
# weight LANE_ORDER[l], and x is permuted to match); elsewhere, and for Q8_0, in order.
LANE_ORDER = [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15]
LANE_ORDER_TYPES = {t for t in TYPES if t not in FLOATS and t != WeightType.Q8_0}


def in_lane_order(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(*t.shape[:-1], -1, 16)[..., LANE_ORDER].reshape(t.shape).contiguous()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("weight_type", [t for t in TYPES if t not in FLOATS], ids=lambda t: t.name)
def test_block_products_equal_the_float32_products_of_their_weights(weight_type, isa):
    """Sharper than a tolerance: a block matrix's product is the F32 product of its dequantized
    weights bit for bit (the same sums in the same order; only where the weights come from
    differs), the F32 product taken in the lane order the block product uses."""
    rng = np.random.default_rng(11)
    K = 512 if weight_type in K_QUANTS else 160
    data = random_blocks(weight_type, 45, K, rng, "gguf")
    weights = torch.from_numpy(gguf_weights(weight_type, data).copy())
    m = matrix((weight_type, data))
    g = torch.Generator().manual_seed(11)
    with cpu_isa_limit(isa):
        lanes = isa == "avx512" and weight_type in LANE_ORDER_TYPES
        dense = BlockMatrix.from_dense(in_lane_order(weights) if lanes else weights)
        for R in (1, 2, 4, 5, 6, 7, 8, 9, 31):
            x = torch.randn(R, K, generator=g)
            want = linear_blocks(in_lane_order(x) if lanes else x, dense, impl="cpp")
            assert torch.equal(linear_blocks(x, m, impl="cpp"), want)


# ---- batch invariance ---------------------------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("weight_type", TYPES, ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_its_batch(weight_type, isa):
    """Each row of x gets the same bits alone, among any number of rows (registers or buffer), and
    whatever the other rows hold."""
    rng = np.random.default_rng(21)
    g = torch.Generator().manual_seed(21)
    K = 512 if weight_type in K_QUANTS else 96
    m = matrix((weight_type, random_blocks(weight_type, 13, K, rng, "gguf")))
    bias = torch.randn(13, generator=g)
    x = torch.randn(GEMM_MIN_TOKENS_PER_ROW + 1, K, generator=g)
    with cpu_isa_limit(isa):
        alone = torch.cat([linear_blocks(x[r:r + 1], m, bias, impl="cpp") for r in range(len(x))])
        for R in range(1, len(x) + 1):
            assert torch.equal(linear_blocks(x[:R], m, bias, impl="cpp"), alone[:R]), R
        others = x.clone()
        others[1::2] = torch.randn(others[1::2].shape, generator=g) * 100
        assert torch.equal(linear_blocks(others, m, bias, impl="cpp")[::2], alone[::2])
        # Decoding rows of a batch [B, T, K] (T < GEMM_MIN_TOKENS_PER_ROW): the same as alone.
        batch = x[:30].view(6, 5, K)
        assert torch.equal(linear_blocks(batch, m, bias, impl="cpp").view(30, -1), alone[:30])


@pytest.mark.parametrize("weight_type", [WeightType.Q4_1, WeightType.Q4_K], ids=lambda t: t.name)
def test_a_prompts_result_does_not_depend_on_its_batch(weight_type):
    """Prompt-sized products (gemm_blocks): a prompt's rows get the same bits alone and in a batch
    of prompts, whatever the other prompts hold."""
    rng = np.random.default_rng(22)
    g = torch.Generator().manual_seed(22)
    K = 512 if weight_type in K_QUANTS else 96
    m = matrix((weight_type, random_blocks(weight_type, 70, K, rng, "gguf")))
    prompts = torch.randn(3, 40, K, generator=g)
    alone = linear_blocks(prompts[1:2], m, impl="cpp")
    assert torch.equal(linear_blocks(prompts, m, impl="cpp")[1:2], alone)
    prompts[0] = 1000.0
    assert torch.equal(linear_blocks(prompts, m, impl="cpp")[1:2], alone)


# ---- a planted bug: the comparison can fail ----------------------------------------------------


def test_a_nibble_swap_would_fail_the_product_test():
    """A reference that read Q4_1's nibbles in the other order (high nibble first) disagrees with
    the op far beyond the tolerance check_product allows, so check_product would catch that bug."""
    rng = np.random.default_rng(31)
    data = random_blocks(WeightType.Q4_1, 20, 96, rng, "gguf")
    swapped = data.reshape(20, -1, 20).copy()
    swapped[:, :, 4:] = (swapped[:, :, 4:] << 4) | (swapped[:, :, 4:] >> 4)
    m, wrong = matrix((WeightType.Q4_1, data)), matrix((WeightType.Q4_1, swapped.reshape(20, -1)))
    x = torch.randn(3, 96)
    check_product(m, x, None)  # the right reference passes
    with pytest.raises(AssertionError):
        assert_within_product_bound(linear_blocks(x, m, impl="cpp"), x, dequantize_reference(wrong))


# ---- prompt-sized products (gemm_blocks): a float32 sum's error, and batch invariance --------------


def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, K] @ w [N, K]^T + bias by the prompt-sized op, at any R (a float32 w: one F32 part)."""
    return gemm_blocks_cpp(x, w, bias)


# K: one weight, none a multiple of the 16 lanes of a vector, SmolLM2's widths; N: one column, a
# panel's tail (32 rows a panel), several panels, and a vocabulary's many panels split over threads.
GEMM_SHAPES = [(33, 1, 3), (40, 17, 1), (64, 100, 49), (33, 576, 1536), (100, 1536, 37), (35, 45, 49157)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("R,K,N", GEMM_SHAPES)
def test_gemm_is_within_a_float32_sums_error(R, K, N, isa):
    g = torch.Generator().manual_seed(R * K + N)
    x, w, bias = torch.randn(R, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    with cpu_isa_limit(isa):
        for b in (bias, None):
            got = gemm(x, w, b)
            assert got.shape == (R, N) and within_product_bound(got, x, w, b)


def test_a_dropped_tail_would_fail_the_error_test():
    """Planted: a product that skips the last K % 16 weights (a forgotten tail) breaks the bound."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(33, 100, generator=g), torch.randn(5, 100, generator=g)
    assert within_product_bound(gemm(x, w), x, w, None)
    assert not within_product_bound(gemm(x[:, :96].contiguous(), w[:, :96].contiguous()), x, w, None)


@pytest.mark.parametrize("isa", ISAS)
def test_gemm_is_exact_on_integer_operands(isa):
    """Small integers make every product and partial sum exact in any order: a wrong lane, a
    dropped tail, a misplaced bias or a panel's row in the wrong column shows as an inequality."""
    g = torch.Generator().manual_seed(8)
    with cpu_isa_limit(isa):
        for R, K, N in [(33, 37, 11), (47, 16, 33), (15, 100, 70), (1, 1, 1)]:
            x = torch.randint(-8, 9, (R, K), generator=g).float()
            w = torch.randint(-8, 9, (N, K), generator=g).float()
            bias = torch.randint(-8, 9, (N,), generator=g).float()
            assert torch.equal(gemm(x, w, bias), x @ w.t() + bias)


@pytest.mark.parametrize("isa", ISAS)
def test_gemm_writes_only_its_columns_of_a_wider_output(isa):
    """out_stride > N: the N columns of each row are the product, the rest of the row untouched."""
    g = torch.Generator().manual_seed(9)
    x, w, bias = torch.randn(40, 100, generator=g), torch.randn(45, 100, generator=g), torch.randn(45, generator=g)
    wide = torch.full((40, 70), float("nan"))
    with cpu_isa_limit(isa):
        _C.gemm_blocks(x.data_ptr(), matrix_descriptor(w), bias.data_ptr(), wide.data_ptr(), 40, 70)
        assert torch.equal(wide[:, :45], gemm(x, w, bias))
    assert wide[:, 45:].isnan().all()
    with pytest.raises(ValueError, match="out_stride"):
        _C.gemm_blocks(x.data_ptr(), matrix_descriptor(w), 0, wide.data_ptr(), 40, 44)


def rows_keep_their_bits(product, x: torch.Tensor, noise: torch.Tensor) -> bool:
    """Whether product(rows) [R, N] gives each row of x [T, K] (T <= 33) the bits it gets alone: in
    batches of 33, 64 and 100 rows at different positions among other rows (noise [100, K]), under
    chunkings of the T rows, and with 1, 2 or 3 threads."""
    alone = torch.cat([product(x[t:t + 1]) for t in range(len(x))])
    same = True
    for size, at in [(33, 0), (33, 33 - len(x)), (64, 7), (100, 100 - len(x)), (100, 31)]:
        batch = noise[:size].clone()
        batch[at:at + len(x)] = x
        same &= torch.equal(product(batch)[at:at + len(x)], alone)
    for chunk in (2, 7, 16):
        same &= torch.equal(torch.cat([product(x[t:t + chunk]) for t in range(0, len(x), chunk)]), alone)
    threads = torch.get_num_threads()  # torch's OpenMP runtime is the one specengine._C runs on
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            batch = noise.clone()
            batch[50:50 + len(x)] = x
            same &= torch.equal(product(batch)[50:50 + len(x)], alone)
    finally:
        torch.set_num_threads(threads)
    return same


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("K,N", [(17, 3), (576, 200), (1536, 33), (100, 1)])
def test_a_rows_gemm_result_does_not_depend_on_its_batch(K, N, isa):
    g = torch.Generator().manual_seed(K + N)
    w, bias = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    x, noise = torch.randn(30, K, generator=g), torch.randn(100, K, generator=g) * 100
    with cpu_isa_limit(isa):
        assert rows_keep_their_bits(lambda rows: gemm(rows, w, bias), x, noise)


def test_a_sum_whose_order_follows_the_batch_would_fail_the_invariance_test():
    """Planted: the sum over k cut in pieces whose size follows the row count, as a BLAS picking
    its blocking by shape would: rows_keep_their_bits says so."""
    g = torch.Generator().manual_seed(10)
    w, x = torch.randn(9, 576, generator=g), torch.randn(30, 576, generator=g)
    noise = torch.randn(100, 576, generator=g)

    def by_count(rows):
        step = 64 * (1 + len(rows) % 3)
        return sum(gemm(rows[:, k:k + step].contiguous(), w[:, k:k + step].contiguous()) for k in range(0, 576, step))
    assert rows_keep_their_bits(lambda rows: gemm(rows, w), x, noise)
    assert not rows_keep_their_bits(by_count, x, noise)


def test_avx512_and_avx2_gemms_agree_bit_for_bit():
    """Both sum each output as the same chain of FMAs (gemm_blocks.h), so they agree exactly."""
    g = torch.Generator().manual_seed(11)
    x, w, bias = torch.randn(45, 100, generator=g), torch.randn(70, 100, generator=g), torch.randn(70, generator=g)
    results = {}
    for isa in ("avx512", "avx2"):
        with cpu_isa_limit(isa):
            results[isa] = gemm(x, w, bias)
    assert torch.equal(results["avx512"], results["avx2"])


# ---- embedding rows ----------------------------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
def test_embedding_rows_are_the_reference_rows(isa):
    rng = np.random.default_rng(41)
    parts = [(WeightType.Q8_0, random_blocks(WeightType.Q8_0, 50, 96, rng, "gguf")),
             (WeightType.Q4_1, random_blocks(WeightType.Q4_1, 30, 96, rng, "gguf")),
             (WeightType.F16, random_blocks(WeightType.F16, 20, 96, rng, "gguf"))]
    m = matrix(*parts)
    ids = torch.tensor([[0, 49, 50, 79], [80, 99, 3, 3], [60, 0, 99, 49]])
    with cpu_isa_limit(isa):
        got = embedding_rows(m, ids, impl="cpp")
        empty = embedding_rows(m, ids[:0], impl="cpp")
        single = embedding_rows(matrix(parts[0]), torch.tensor(7), impl="cpp")
    assert got.shape == (3, 4, 96) and empty.shape == (0, 4, 96) and single.shape == (96,)
    assert torch.equal(got, embedding_rows(m, ids, impl="reference"))
    assert torch.equal(single, dequantize_reference(matrix(parts[0]))[7])
    with pytest.raises(ValueError, match=r"id 100 is outside \[0, 100\)"):
        embedding_rows(m, torch.tensor([1, 100]), impl="cpp")


# ---- descriptors and the bindings' own checks -------------------------------------------------


def test_descriptors_describe_parts_in_order_and_are_kept_per_matrix():
    rng = np.random.default_rng(51)
    a, b = random_blocks(WeightType.Q4_1, 4, 64, rng), random_blocks(WeightType.Q8_0, 2, 64, rng)
    m = matrix((WeightType.Q4_1, a), (WeightType.Q8_0, b))
    d = matrix_descriptor(m)
    assert d == (64, 2, 3, m.parts[0].data.data_ptr(), 4, 8, m.parts[1].data.data_ptr(), 2)
    assert matrix_descriptor(m) is d
    dense = torch.zeros(3, 5, dtype=torch.bfloat16)
    assert matrix_descriptor(dense) == (5, 1, 30, dense.data_ptr(), 3)
    x, out = torch.zeros(1, 64), torch.zeros(1, 6)
    for bad, message in [((64, 0), "1 to 3 parts"), ((64, 1, 3, 0, 4), "no data"),
                         ((64, 1, 5, d[3], 4), "unknown type"), ((65, 1, 3, d[3], 4), "whole number"),
                         ((64, 2, 3, d[3], 4), "1 to 3 parts")]:
        with pytest.raises(ValueError, match=message):
            _C.linear_blocks(x.data_ptr(), bad, 0, out.data_ptr(), 1)


# ---- whole layers --------------------------------------------------------------------------------


def layer_weights(types: dict[str, tuple[WeightType, ...]], hidden, H, Hkv, D, inter, rng, bias=False):
    """A decoder layer's weights with each matrix as the given parts' types (q, k, v; gate, up)."""
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))

    def packed(name, rows, K):
        return matrix(*((t, random_blocks(t, n, K, rng, "gguf")) for t, n in zip(types[name], rows)))

    vec = (lambda n: torch.randn(n, generator=g) * 0.1) if bias else (lambda n: None)
    return DecoderLayerWeights(
        1 + 0.1 * torch.randn(hidden, generator=g), packed("qkv", (H * D, Hkv * D, Hkv * D), hidden),
        vec((H + 2 * Hkv) * D), None, None, packed("o", (hidden,), H * D), vec(hidden),
        1 + 0.1 * torch.randn(hidden, generator=g), packed("gate_up", (inter, inter), hidden), vec(2 * inter),
        packed("down", (hidden,), inter), vec(hidden))


def reference_layer(x, w: DecoderLayerWeights, H, Hkv, D, eps, cos, sin, positions, cache_k, cache_v, kv_len):
    """The layer from ops' torch references, each matrix dequantized by ops.blocks' reference."""
    B, T, hidden = x.shape
    qkv = F.linear(rms_norm(x, w.input_norm, eps, impl="reference"), dequantize_reference(w.qkv), w.qkv_bias)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    attn = cached_attention(q.reshape(B, T, H, D), k.reshape(B, T, Hkv, D), v.reshape(B, T, Hkv, D), cos, sin,
                            positions, cache_k, cache_v, kv_len, None, impl="reference")
    x = x + F.linear(attn.reshape(B, T, H * D), dequantize_reference(w.o), w.o_bias)
    gate, up = F.linear(rms_norm(x, w.post_norm, eps, impl="reference"), dequantize_reference(w.gate_up),
                        w.gate_up_bias).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, dequantize_reference(w.down), w.down_bias)


LAYER_TYPES = {
    "q4_k_m": ({"qkv": (WeightType.Q4_K, WeightType.Q4_K, WeightType.Q6_K), "o": (WeightType.Q4_K,),
                "gate_up": (WeightType.Q4_K, WeightType.Q4_K), "down": (WeightType.Q6_K,)}, 256, 4, 2, 64, 512),
    "q4_1": ({"qkv": (WeightType.Q4_1,) * 3, "o": (WeightType.Q4_1,), "gate_up": (WeightType.Q4_1,) * 2,
              "down": (WeightType.Q8_0,)}, 96, 3, 1, 32, 160),
}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("B,T,starts", [(1, 1, [9]), (3, 5, [0, 11, 4])])
@pytest.mark.parametrize("case", list(LAYER_TYPES))
def test_decoder_layer_with_block_matrices_matches_the_references(case, B, T, starts, isa):
    types, hidden, H, Hkv, D, inter = LAYER_TYPES[case]
    rng = np.random.default_rng(61)
    g = torch.Generator().manual_seed(61)
    w = layer_weights(types, hidden, H, Hkv, D, inter, rng, bias=B > 1)
    capacity = 24
    x = torch.randn(B, T, hidden, generator=g)
    positions = torch.tensor(starts)[:, None] + torch.arange(T)
    freqs = positions[..., None].float() / 10000 ** (torch.arange(0, D, 2) / D)
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
    cache_k, cache_v = torch.randn(2, B + 1, capacity + 1, Hkv, D, generator=g)
    kv_len = min(max(starts) + T, capacity)
    # The exact results on the dequantized weights (the float32 cos and sin as given) and their
    # float32 bounds (tests/bounds.py): output, and the k and v after the writes.
    dense = w._replace(**{name: dequantize_reference(getattr(w, name)) for name in ("qkv", "o", "gate_up", "down")})
    (exact, exact_k, exact_v), (bound, bound_k, bound_v) = Float64Llama.from_layer_weights(
        dense, H, Hkv, D, 1e-5).layer(0, x, positions, cos, sin, cache_k, cache_v, kv_len)
    want_k, want_v = cache_k.clone(), cache_v.clone()
    want = reference_layer(x, w, H, Hkv, D, 1e-5, cos, sin, positions, want_k, want_v, kv_len)
    with cpu_isa_limit(isa):
        got = decoder_layer(x.clone(), w, H, Hkv, D, 1e-5, cos, sin, positions, cache_k, cache_v, kv_len)
    for name, out, k, v in (("C++", got, cache_k, cache_v), ("torch", want, want_k, want_v)):
        assert_within(out, exact, bound, name)
        assert_within(k[:B], exact_k[:B], bound_k[:B], f"{name} keys")
        assert_within(v[:B], exact_v[:B], bound_v[:B], f"{name} values")
    assert torch.equal(cache_k[B:], want_k[B:]) and torch.equal(cache_v[B:], want_v[B:])  # the spare row


def test_decoder_layer_takes_bfloat16_tensors_and_block_matrices_alike():
    """A bfloat16 tensor and BlockMatrix.from_dense of it are the same matrix (the same bits out),
    and the checks name a BlockMatrix of the wrong shape."""
    hidden, H, Hkv, D, inter = 64, 4, 2, 16, 96
    g = torch.Generator().manual_seed(71)
    bf = lambda *s: (torch.randn(*s, generator=g) * 0.1).bfloat16()  # noqa: E731
    dense = DecoderLayerWeights(torch.ones(hidden), bf((H + 2 * Hkv) * D, hidden), None, None, None,
                                bf(hidden, H * D), None, torch.ones(hidden), bf(2 * inter, hidden), None,
                                bf(hidden, inter), None)
    blocks = dense._replace(qkv=BlockMatrix.from_dense(dense.qkv), down=BlockMatrix.from_dense(dense.down))
    x = torch.randn(2, 3, hidden, generator=g)
    positions = torch.tensor([[4, 5, 6], [0, 1, 2]])
    cos, sin = torch.randn(2, 2, 3, D, generator=g)
    cache = torch.zeros(2, 2, 9, Hkv, D)
    outs = [decoder_layer(x.clone(), w, H, Hkv, D, 1e-6, cos, sin, positions, *cache.clone(), 7)
            for w in (dense, blocks)]
    assert torch.equal(outs[0], outs[1])
    wrong = blocks._replace(down=BlockMatrix.from_dense(dense.down[:, 1:].contiguous()))
    with pytest.raises(ValueError, match=r"down must be \[64, 96\], got \(64, 95\)"):
        decoder_layer(x.clone(), wrong, H, Hkv, D, 1e-6, cos, sin, positions, *cache.clone(), 7)
    with pytest.raises(ValueError, match="shape does not match the layer's sizes"):  # unchecked: the binding's check
        decoder_layer(x.clone(), wrong, H, Hkv, D, 1e-6, cos, sin, positions, *cache.clone(), 7, check=False)
