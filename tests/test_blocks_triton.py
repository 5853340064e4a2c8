"""GGUF matrices as stored, computed by the Triton kernels (kernels/blocks.py; in the interpreter on
CPU, compiled on a GPU) against the torch reference (ops.blocks.dequantize_reference, then
F.linear) and gguf's own numpy dequantization: every weight type; row lookups bit for bit;
products within float32 summation error on hostile shapes (1 to 64 activation rows, 1 to 8193
output rows, one block to odd numbers of blocks, split K); parts of mixed types; a row's product
the same bits alone and in batches of any size (decode and verification steps; prompts); a
matrix's runs of parts of one type merged (as a GPU holds them): the same bits in fewer launches;
planted bugs that the exactness checks catch; and, compiled for sm_90, dequantization free of
fused multiply-adds."""
import itertools
import os
import subprocess
import sys
from pathlib import Path

import torch

# Without a GPU the kernels run in Triton's interpreter; it must be chosen before a kernel module
# is imported (conftest.py does the same).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from specengine.kernels import blocks as kernels  # noqa: E402
from specengine.ops.product import gemm_sized  # noqa: E402
from specengine.ops.blocks import (BLOCK_LAYOUT, FLOAT_TYPES, LAYOUTS, BlockMatrix, MatrixPart, WeightType,  # noqa: E402
                                   dequantize_reference, embedding_rows, linear_blocks)

from bounds import assert_within_product_bound  # noqa: E402
from kernel_util import count_launches  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
T = WeightType
TYPES = list(WeightType)
# Each block type's float16 scale fields: (offset of the first, how many side by side).
HALF_FIELDS = {t: (LAYOUTS[t].half_fields[0], len(LAYOUTS[t].half_fields)) for t in TYPES if t not in FLOAT_TYPES}


def hostile_floats(n: int, g: torch.Generator) -> torch.Tensor:
    """n float32 values over many magnitudes, signed, with zeros (float16 subnormals included)."""
    values = torch.randn(n, generator=g) * torch.exp2(torch.randint(-26, 6, (n,), generator=g).float())
    values[torch.rand(n, generator=g) < 0.05] = 0.0
    return values


def random_part(weight_type: WeightType, rows: int, K: int, seed: int) -> MatrixPart:
    """rows of K weights: random bytes (every quant, sub-block scale and high bit), finite scales."""
    g = torch.Generator().manual_seed(seed)
    if weight_type in FLOAT_TYPES:
        dtype = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[weight_type]
        return MatrixPart(weight_type, hostile_floats(rows * K, g).to(dtype).reshape(rows, K).view(torch.uint8))
    block_size, block_bytes = BLOCK_LAYOUT[weight_type]
    blocks = torch.randint(0, 256, (rows * K // block_size, block_bytes), dtype=torch.uint8, generator=g)
    offset, count = HALF_FIELDS[weight_type]
    halves = (hostile_floats(blocks.shape[0] * count, g) / 64).to(torch.float16).view(torch.uint8)
    blocks[:, offset:offset + 2 * count] = halves.reshape(-1, 2 * count)
    return MatrixPart(weight_type, blocks.reshape(rows, -1).contiguous())


def matrix_of(*parts: MatrixPart) -> BlockMatrix:
    return BlockMatrix(parts).to(DEVICE)


def assert_bit_exact(got: torch.Tensor, want: torch.Tensor):
    assert got.shape == want.shape and got.dtype == want.dtype == torch.float32
    differ = got.cpu().view(torch.int32) != want.cpu().view(torch.int32)
    assert not differ.any(), (f"{int(differ.sum())} of {differ.numel()} weights differ, first at "
                              f"{differ.nonzero()[0].tolist()}: {got.cpu()[differ][:4]} != {want.cpu()[differ][:4]}")


def gguf_dequantized(part: MatrixPart) -> torch.Tensor:
    values = gguf.quants.dequantize(part.data.cpu().numpy(), gguf.GGMLQuantizationType(int(part.weight_type)))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(part.rows, part.in_features)


def test_the_kernels_know_ggmls_layouts():
    assert kernels.LAYOUT == {int(t): layout for t, layout in BLOCK_LAYOUT.items()}
    assert set(kernels.FLOAT_TYPES) == {int(t) for t in FLOAT_TYPES}


@pytest.mark.parametrize("weight_type", TYPES, ids=lambda t: t.name)
def test_row_lookups_are_gguf_bit_for_bit(weight_type):
    """Every weight of the rows looked up, against gguf's numpy and the torch reference, bit for bit:
    ids repeated, out of order, the first and last rows, in a [2, 3] batch; rows of odd numbers of
    blocks (float types: K not a multiple of the 32 columns a program writes)."""
    block_size = BLOCK_LAYOUT[weight_type][0]
    K = 3 * block_size if block_size > 1 else 45
    part = random_part(weight_type, 9, K, seed=int(weight_type))
    matrix = matrix_of(part)
    ids = torch.tensor([[8, 0, 3], [3, 7, 8]], device=DEVICE)
    got = embedding_rows(matrix, ids, impl="triton")
    assert_bit_exact(got, dequantize_reference(matrix)[ids])
    assert_bit_exact(got, gguf_dequantized(part).to(DEVICE)[ids])


# (activation rows, output rows, blocks per row, tokens per row): every tile kind and BLOCK_R (more
# than 8 rows of few tokens: the decode kernel's row tiles; from 32 tokens per row: the prompt
# kernel), N from one row to past a multiple of every tile, K of one block and of odd numbers of
# blocks (17: split K).
SHAPES = [(1, 8193, 1, 1), (2, 7, 3, 1), (3, 111, 1, 1), (5, 1, 17, 1), (8, 7, 2, 1), (12, 130, 1, 1),
          (20, 33, 3, 5), (32, 7, 1, 32), (96, 1, 2, 48)]
FLOAT_K = (1, 7, 45, 33, 545, 100, 2, 31, 64)  # the float types' K for each shape
WIDE = (T.F16, T.Q4_1, T.Q8_0)  # the types run at N = 8193 (the interpreter takes about 3 s each)


def activations(R: int, T: int, K: int, g: torch.Generator) -> torch.Tensor:
    """R rows of K: a 2-d x (rows of one token) when T is 1, else [R // T, T, K]."""
    x = torch.randn(R, K, generator=g)
    return (x if T == 1 else x.view(R // T, T, K)).to(DEVICE)


@pytest.mark.parametrize("weight_type", TYPES, ids=lambda t: t.name)
def test_products_on_hostile_shapes(weight_type):
    block_size = BLOCK_LAYOUT[weight_type][0]
    plans = set()
    for i, (R, N, blocks, tokens) in enumerate(SHAPES):
        if block_size == 256:  # K-quant rows are long: fewer of them in the interpreter
            N, blocks = min(N, 257), min(blocks, 5)
        elif N > 1000 and weight_type not in WIDE:
            N = 1025
        K = blocks * block_size if block_size > 1 else FLOAT_K[i]
        part = random_part(weight_type, N, K, seed=1000 * i + int(weight_type))
        matrix = matrix_of(part)
        g = torch.Generator().manual_seed(i)
        x = activations(R, tokens, K, g)
        bias = torch.randn(N, generator=g).to(DEVICE) if i % 2 else None
        got = linear_blocks(x, matrix, bias, impl="triton")
        assert got.shape == (*x.shape[:-1], N)
        assert_within_product_bound(got, x, dequantize_reference(matrix), bias)
        plan = kernels.plan(R, N, K, gemm_sized(tokens))
        plans.add((plan["kernel"], plan["BLOCK_R"], plan["splits"] > 1))
    assert {p[:2] for p in plans} == {("gemv", 1), ("gemv", 2), ("gemv", 4), ("gemv", 8), ("gemm", 64)}
    assert any(split for *_, split in plans)  # some K was split (and combined)


@pytest.mark.parametrize("shape", [(40, 64), (1, 31, 64), (2, 31, 64), (1, 32, 64), (3, 33, 64)])
def test_the_kernel_follows_the_products_gemm_decision(shape, monkeypatch):
    """The Triton product runs the GEMM kernel exactly where the C++ path runs GEMMs
    (ops.product.gemm_sized: by tokens per row, a 2-d x counting as rows of one token), whatever
    the number of rows."""
    matrix = matrix_of(random_part(T.Q8_0, 5, shape[-1], seed=3))
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    launches = count_launches(monkeypatch)
    linear_blocks(x, matrix, None, impl="triton")
    gemm = gemm_sized(shape[-2] if len(shape) == 3 else 1)
    assert gemm == (len(shape) == 3 and shape[1] >= 32)
    assert (launches["_gemm_kernel"], launches["_gemv_kernel"]) == ((1, 0) if gemm else (0, 1))


def test_the_split_follows_the_matrix():
    """The split of K depends on the matrix's shape only: never on the number of rows."""
    for N, K in [(576, 576), (3072, 2048), (2048, 5632), (49152, 2048), (7, 32)]:
        decode = [kernels.plan(R, N, K, False) for R in (1, 5, 9, 40, 8 * 65, 4096)]
        assert {p["kernel"] for p in decode} == {"gemv"}
        assert len({(p["splits"], p["groups_per_split"]) for p in decode}) == 1, (N, K)
        assert {p["grid"][1] for p in decode} == {decode[0]["splits"]}
        prompts = [kernels.plan(R, N, K, True) for R in (32, 64, 4096, 65 * 3)]
        assert {(p["kernel"], p["splits"]) for p in prompts} == {("gemm", 1)}


# The weight types of the batch-invariance test: a K-quant, a 32-weight block type, a float type.
INVARIANT_TYPES = [T.Q4_K, T.Q8_0, T.F16]


@pytest.mark.parametrize("weight_type", INVARIANT_TYPES, ids=lambda t: t.name)
def test_a_row_gets_the_same_bits_in_any_batch(weight_type):
    """A row's product, with a bias, is the same bits alone and in a call of 1, 5, 9 or 40 rows of
    one token (2-d, or [R, 1, K]), or as a token of a verification ([8, 5, K]): the engine samples
    a request alike in any batch, and greedy verification (gamma + 1 tokens a row) equals
    target-only decoding. A prompt's row, likewise, alone and beside another prompt (compiled;
    the interpreter's tl.dot is numpy's matmul, whose rounding of a row can change with its place
    in the tile: there only a prompt at the same place). The matrix has two parts and a split K
    (combined in order)."""
    K, N = 512, 16
    matrix = matrix_of(random_part(weight_type, N, K, seed=11), random_part(weight_type, 3, K, seed=12))
    g = torch.Generator().manual_seed(int(weight_type))
    bias = torch.randn(N + 3, generator=g).to(DEVICE)
    x = torch.randn(40, K, generator=g).to(DEVICE)
    assert kernels.plan(1, N, K, False)["splits"] > 1 and kernels.plan(40, N, K, False)["BLOCK_R"] == 8
    rows = [0, 8, 39]  # the first row of the first and second row tiles, the last row of a batch
    alone = torch.cat([linear_blocks(x[i:i + 1], matrix, bias, impl="triton") for i in rows])
    assert_within_product_bound(alone, x[rows], dequantize_reference(matrix), bias)
    for R in (1, 5, 9, 40):
        inside = [i for i, r in enumerate(rows) if r < R]
        assert_bit_exact(linear_blocks(x[:R], matrix, bias, impl="triton")[[rows[i] for i in inside]], alone[inside])
    assert_bit_exact(linear_blocks(x[:9, None], matrix, bias, impl="triton")[rows[:2], 0], alone[:2])
    verification = linear_blocks(x.view(8, 5, K), matrix, bias, impl="triton")
    assert_bit_exact(verification.reshape(40, N + 3)[rows], alone)
    prompts = torch.randn(2, 32, K, generator=g).to(DEVICE)
    both = linear_blocks(prompts, matrix, bias, impl="triton")
    assert_within_product_bound(both, prompts, dequantize_reference(matrix), bias)
    assert_bit_exact(linear_blocks(prompts[:1], matrix, bias, impl="triton"), both[:1])
    if DEVICE == "cuda":
        assert_bit_exact(linear_blocks(prompts[1:], matrix, bias, impl="triton"), both[1:])


def test_mixed_parts_fill_their_columns():
    """A packed projection of parts of different types (Q4_K_M's q and k in Q4_K, v in Q6_K; and the
    float and 32-weight types beside each other), with a bias, in a [2, R, K] batch; the lookup of
    ids across every part."""
    for types, K in [((T.Q4_K, T.Q4_K, T.Q6_K), 512), ((T.F32, T.Q8_0, T.BF16, T.Q5_1, T.F16, T.Q4_0), 96)]:
        parts = [random_part(t, rows, K, seed=7 * i) for i, (t, rows) in enumerate(zip(types, (33, 1, 17, 64, 2, 9)))]
        matrix = matrix_of(*parts)
        N = matrix.out_features
        weights = dequantize_reference(matrix)
        g = torch.Generator().manual_seed(K)
        bias = torch.randn(N, generator=g).to(DEVICE)
        for R in (1, 3, 33):  # tokens per row: the decode kernel, then the prompt kernel
            x = torch.randn(2, R, K, generator=g).to(DEVICE)
            got = linear_blocks(x, matrix, bias, impl="triton")
            assert got.shape == (2, R, N)
            assert_within_product_bound(got, x, weights, bias)
        ids = torch.randint(0, N, (40,), generator=g).to(DEVICE)
        assert_bit_exact(embedding_rows(matrix, ids, impl="triton"), weights[ids])


# Packed projections as files store them, (weight type, rows) per part over K, and the types of
# their merged parts: q/k/v of one type (one part); Q4_K_M's q and k in Q4_K, v in Q6_K (two);
# float and 32-weight types in runs of one and two, a part of one row among them.
PACKED = [(((T.Q8_0, 40), (T.Q8_0, 7), (T.Q8_0, 7)), 256, (T.Q8_0,)),
          (((T.Q4_K, 33), (T.Q4_K, 7), (T.Q6_K, 17)), 512, (T.Q4_K, T.Q6_K)),
          (((T.F16, 5), (T.F16, 1), (T.Q4_1, 31), (T.F16, 9), (T.Q4_1, 2), (T.Q4_1, 64)), 96,
           (T.F16, T.Q4_1, T.F16, T.Q4_1))]


def merged_and_not(parts, K: int, merged_types) -> tuple[BlockMatrix, BlockMatrix]:
    """(the matrix of these parts as stored, the same merged), the merged one checked: its parts'
    types, its weights the stored ones, and a part alone in its run kept (not copied)."""
    matrix = matrix_of(*[random_part(t, rows, K, seed=7 * i) for i, (t, rows) in enumerate(parts)])
    merged = matrix.merged()
    assert merged.weight_types == merged_types and merged.shape == matrix.shape
    assert_bit_exact(dequantize_reference(merged), dequantize_reference(matrix))
    alone = {p.data.data_ptr() for p in matrix.parts} & {p.data.data_ptr() for p in merged.parts}
    assert len(alone) == sum(len(list(run)) == 1 for _, run in itertools.groupby(matrix.weight_types))
    return matrix, merged


@pytest.mark.parametrize("parts, K, merged_types", PACKED, ids=["Q8_0", "Q4_K_M", "mixed"])
def test_merged_parts_compute_the_same_bits_in_fewer_launches(parts, K, merged_types, monkeypatch):
    """A matrix whose consecutive parts of one type are merged (as a GPU holds it: layers.blocks)
    computes the same bits as the file's parts, one launch per merged part (and with K split one
    combine for the matrix, whatever its parts): decode and verification
    steps (one and more row tiles), prompts (compiled; the interpreter's tl.dot is numpy's matmul,
    whose rounding of an output can change with its column in the tile: there within summation
    error), and lookups. A small split target makes a part of 7 rows alone split K otherwise than
    the matrix (8 splits against 4): a row's sums follow the matrix's split, never its part's
    (test_a_split_planned_per_part_would_change_the_bits: the other way, other bits)."""
    monkeypatch.setattr(kernels, "TARGET_PROGRAMS", 8)
    monkeypatch.setattr(kernels, "MIN_SPLIT_GROUPS", 1)
    matrix, merged = merged_and_not(parts, K, merged_types)
    N = matrix.out_features
    g = torch.Generator().manual_seed(K)
    bias = torch.randn(N, generator=g).to(DEVICE)
    steps = [torch.randn(1, K, generator=g), torch.randn(9, K, generator=g), torch.randn(2, 3, K, generator=g)]
    launches = count_launches(monkeypatch)
    for x in steps:
        x = x.to(DEVICE)
        launches.clear()
        stored = linear_blocks(x, matrix, bias, impl="triton")
        stored_launches = dict(launches)
        launches.clear()
        got = linear_blocks(x, merged, bias, impl="triton")
        assert_bit_exact(got, stored)
        assert_within_product_bound(got, x, dequantize_reference(matrix), bias)
        # one product per part, and (K split here) one combine for the matrix
        assert launches == {"_gemv_kernel": len(merged.parts), "_combine_kernel": 1}
        assert stored_launches == {"_gemv_kernel": len(matrix.parts), "_combine_kernel": 1}
    prompts = torch.randn(2, 33, K, generator=g).to(DEVICE)
    stored = linear_blocks(prompts, matrix, bias, impl="triton")
    launches.clear()
    got = linear_blocks(prompts, merged, bias, impl="triton")
    assert launches == {"_gemm_kernel": len(merged.parts)}
    assert_within_product_bound(got, prompts, dequantize_reference(matrix), bias)
    if DEVICE == "cuda":
        assert_bit_exact(got, stored)
    ids = torch.randint(0, N, (40,), generator=g).to(DEVICE)
    stored = embedding_rows(matrix, ids, impl="triton")
    launches.clear()
    assert_bit_exact(embedding_rows(merged, ids, impl="triton"), stored)
    assert launches == {"_rows_kernel": len(merged.parts)}


def test_a_split_planned_per_part_would_change_the_bits(monkeypatch):
    """The check above can fail: each part of the Q8_0 q/k/v computed as a matrix of its own, its
    split of K planned for its rows (8 splits for k's and v's 7 rows, 4 in the matrix), gives
    other bits than the merged matrix, which gives the stored parts' bits."""
    monkeypatch.setattr(kernels, "TARGET_PROGRAMS", 8)
    monkeypatch.setattr(kernels, "MIN_SPLIT_GROUPS", 1)
    matrix, merged = merged_and_not(*PACKED[0])
    x = torch.randn(9, matrix.in_features, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    got = linear_blocks(x, merged, impl="triton")
    assert_bit_exact(got, linear_blocks(x, matrix, impl="triton"))
    per_part = torch.cat([linear_blocks(x, BlockMatrix((p,)), impl="triton") for p in matrix.parts], dim=-1)
    with pytest.raises(AssertionError, match="weights differ"):
        assert_bit_exact(got, per_part)


def test_empty_and_bias_only_products():
    matrix = matrix_of(random_part(T.Q8_0, 5, 64, seed=0))
    assert linear_blocks(torch.zeros(0, 64, device=DEVICE), matrix, impl="triton").shape == (0, 5)
    assert embedding_rows(matrix, torch.zeros(0, dtype=torch.int64, device=DEVICE), impl="triton").shape == (0, 64)
    no_columns = matrix_of(MatrixPart(T.Q8_0, torch.zeros(5, 0, dtype=torch.uint8)))  # K = 0: the bias alone
    bias = torch.randn(5, device=DEVICE)
    assert torch.equal(linear_blocks(torch.zeros(3, 0, device=DEVICE), no_columns, bias, impl="triton"),
                       bias.expand(3, 5))


# ---- planted bugs: the exactness check fails on each ----------------------------------------


@triton.jit
def _bytes_nibble_swapped(p, mask):
    """_byte_at with each byte's nibbles swapped (low and high quants exchanged)."""
    b = tl.load(p, mask=mask, other=0).to(tl.int32)
    return ((b & 0x0F) << 4) | (b >> 4)


@triton.jit
def _f16_big_endian(p, mask):
    """_f16_at reading the float16's bytes in the wrong order."""
    hi = tl.load(p, mask=mask, other=0).to(tl.int32)
    lo = tl.load(p + 1, mask=mask, other=0).to(tl.int32)
    return (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scale_min_high_bits_lost(block, s, mask):
    """_scale_min_k4 without the top 2 bits of sub-blocks 4-7's scales."""
    i = s % 4
    d = tl.load(block + 4 + i, mask=mask, other=0).to(tl.int32)
    m = tl.load(block + 8 + i, mask=mask, other=0).to(tl.int32)
    m_d = tl.load(block + 12 + i, mask=mask, other=0).to(tl.int32)
    sc = tl.where(s < 4, d & 0x3F, m_d & 0x0F)
    mn = tl.where(s < 4, m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30))
    return sc.to(tl.float32), mn.to(tl.float32)


# helper of kernels.blocks -> (its copy with a bug, the weight types that use it)
PLANTED = {"_byte_at": (_bytes_nibble_swapped, [T.Q4_0, T.Q5_1, T.Q4_K, T.Q6_K]),
           "_f16_at": (_f16_big_endian, [T.Q8_0, T.Q4_1, T.Q5_K, T.Q6_K]),
           "_scale_min_k4": (_scale_min_high_bits_lost, [T.Q4_K, T.Q5_K])}


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # a wrong float16 can be inf: inf * 0
@pytest.mark.skipif(DEVICE != "cpu", reason="patches helpers into the interpreted kernels (compiled ones are cached)")
@pytest.mark.parametrize("helper", ["_byte_at", "_f16_at", "_scale_min_k4"])
def test_the_exactness_check_catches_planted_bugs(helper, monkeypatch):
    """A copy of a dequantization helper with a bug, patched into the kernels (the interpreter calls
    them through the module): every type that uses it fails the bit-for-bit check, and the same
    lookups pass again once it is removed.

    A fused multiply-add is not among them: in these formats every product of the dequantization
    is exact in float32 (an 11-bit float16 scale times a 6-bit scale times a quant of at most 6
    bits fits in 24 bits), so fused or not, only the final add rounds. The kernels still never
    fuse (test_compiled_dequantization_never_fuses), so that holds without relying on it."""
    buggy, types = PLANTED[helper]
    matrices = {t: matrix_of(random_part(t, 6, 2 * BLOCK_LAYOUT[t][0], seed=3)) for t in types}
    ids = torch.arange(6)
    with monkeypatch.context() as patch:
        patch.setattr(kernels, helper, buggy)
        for t, matrix in matrices.items():
            with pytest.raises(AssertionError, match="weights differ"):
                assert_bit_exact(embedding_rows(matrix, ids, impl="triton"), dequantize_reference(matrix)[ids])
    for matrix in matrices.values():
        assert_bit_exact(embedding_rows(matrix, ids, impl="triton"), dequantize_reference(matrix)[ids])


# ---- compiled: no fused multiply-add in the dequantization ------------------------------------

_COMPILE = r"""
import sys
sys.path.insert(0, sys.argv[1])
import compile_triton as ct
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
blocks = ct.load_kernels()[ct.MODULES.index("blocks")]
fn = blocks._rows_kernel
for weight_type in (3, 13):  # Q4_1: (d * q) + m; Q5_K: (d * scale) * q - (dmin * min)
    for exact in (True, False):
        constexprs = dict(TYPE=weight_type, BLOCK_IDS=16, GROUPS=4, EXACT=exact)
        source = ASTSource(fn=fn, signature=ct.signature(fn, constexprs, "*u8"),
                           constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        print(weight_type, exact, ptx.count("fma.rn.f32"), ptx.count("mul.rn.f32"))
"""


def test_compiled_dequantization_never_fuses():
    """The row lookup kernel is dequantization alone: compiled for sm_90 with EXACT (as a GPU runs
    it) its PTX has the explicitly rounded multiply and no FMA (ptxas never fuses an instruction
    with an explicit rounding mode); the same source with plain operations is fused, which is why
    EXACT exists."""
    pytest.importorskip("triton.backends.nvidia", reason="this Triton has no CUDA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tests = Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, "-c", _COMPILE, str(tests)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = {(int(t), e == "True"): (int(f), int(m)) for t, e, f, m in map(str.split, done.stdout.splitlines())}
    for weight_type in (3, 13):
        fused, rounded = counts[weight_type, True]
        assert fused == 0 and rounded > 0, counts
        assert counts[weight_type, False][0] > 0, counts  # plain a * b + c: contracted into an FMA
