"""Every launch the engine can make of a Triton kernel fits what the compiled backend accepts.

The interpreter runs launches that a GPU refuses: a tl.dot with a side under 16, a grid's second
or third dimension over 65535, a block that is not a power of two or holds more than 2^20
elements. Here the host wrappers run on meta tensors (nothing is computed, nothing allocated)
with each kernel's launch recorded instead of run, for the shapes the engine produces: the model
architectures' head sizes and groups, batches up to 256, steps of 1 to 65 tokens (verifications
up to MAX_GAMMA + 1 = 31) and prompts up to the context, the verify kernel's rounds over
vocabularies up to 256k, and the products and lookups of GGUF matrices as stored (kernels/blocks.py) in every weight type.
"""
import inspect
import re
from pathlib import Path

import pytest
import torch

from specengine.kernels import activation, attention, blocks, norm, philox, rotary, verify
from specengine.models.config import ModelConfig, RopeConfig
from specengine.models.llama import LlamaForCausalLM
from specengine.ops.blocks import BLOCK_LAYOUT, BlockMatrix, MatrixPart, WeightType, row_bytes
from specengine.ops.blocks_triton import embedding_rows_triton, linear_blocks_triton

KERNEL_MODULES = (activation, attention, blocks, norm, philox, rotary, verify)
MAX_GRID = (2**31 - 1, 65535, 65535)   # CUDA's grid limits: x, y, z
MAX_NUMEL = 2**20                       # Triton's largest block (TRITON_MAX_TENSOR_NUMEL)
MIN_DOT = 16                            # tl.dot's smallest M, N and K, compiled

# The blocks each kernel builds (tl.arange sizes and the tiles made of them), by launch argument
# name; a number stands for itself.
BLOCKS = {
    "_split_kernel": [("Q_ROWS", "BLOCK_D"), ("BLOCK_N", "BLOCK_D"), ("Q_ROWS", "BLOCK_N")],
    "_merge_kernel": [("SPLITS", "BLOCK_D")],
    "_rope_write_kernel": [("Q_HEADS", "BLOCK_D"), ("KV_HEADS", "BLOCK_D")],
    "_add_rms_norm_kernel": [("BLOCK",)],
    "_silu_mul_kernel": [("BLOCK",)],
    "_uniforms_kernel": [("BLOCK",)],
    "_stats_kernel": [("BLOCK",), ("NUM_BINS",)],
    "_top_k_kernel": [("BLOCK",), ("TILES", "NUM_BINS")],
    "_top_p_first_kernel": [("CHUNK", "NUM_BINS"), ("TILES", "NUM_BINS")],
    "_top_p_kernel": [("CHUNK", "NUM_BINS"), ("TILES", "NUM_BINS")],
    "_floor_kernel": [("BLOCK",), ("TILES", "NUM_BINS")],
    "_decide_kernel": [("BLOCK",), ("TILES",)],
    "_sample_kernel": [("BLOCK",), ("TILES",)],
    "_gemv_kernel": [("BLOCK_R", "BLOCK_N", 32)],
    "_gemm_kernel": [("BLOCK_R", 32), ("BLOCK_N", 32), ("BLOCK_R", "BLOCK_N")],
    "_combine_kernel": [("BLOCK",)],
    "_rows_kernel": [("BLOCK_IDS", 32)],
}
# Each tl.dot as (M, N, K) of launch arguments: q @ k^T and p @ v of the split kernel.
DOTS = {"_split_kernel": [("Q_ROWS", "BLOCK_N", "BLOCK_D"), ("Q_ROWS", "BLOCK_D", "BLOCK_N")],
        "_gemm_kernel": [("BLOCK_R", "BLOCK_N", 32)]}  # activations [BLOCK_R, 32] @ a dequantized group [32, BLOCK_N]

# Model shapes the engine runs (hidden, intermediate, heads, kv heads, head_dim, context,
# sliding window, q/k norms): the shipped pair, SmolLM2 and its draft, the widened 1B target,
# Llama 3 8B and 70B, Qwen2.5 7B (group of 7), Qwen3 (norms), Mistral (window).
ARCHITECTURES = {
    "pycode-draft": (192, 512, 4, 2, 48, 1024, None, False),
    "pycode-target": (512, 1408, 8, 4, 64, 1024, None, False),
    "smollm2-135m": (576, 1536, 9, 3, 64, 8192, None, False),
    "widened-1b": (2048, 8192, 32, 8, 64, 1024, None, False),
    "llama3-8b": (4096, 14336, 32, 8, 128, 8192, None, False),
    "llama3-70b": (8192, 28672, 64, 8, 128, 131072, None, False),
    "qwen2.5-7b": (3584, 18944, 28, 4, 128, 32768, None, False),
    "qwen3-0.6b": (1024, 3072, 16, 8, 128, 40960, None, True),
    "mistral-7b": (4096, 14336, 32, 8, 128, 32768, 4096, False),
}
BATCHES = (1, 3, 64, 256)
STEP_TOKENS = (1, 2, 3, 5, 9, 17, 33, 65)  # a draft step, verifications up to MAX_GAMMA + 1 = 31, short prompts


def launches_of(run):
    """[(kernel name, grid, launch arguments)] of the Triton launches made by run(), none executed."""
    recorded = []
    patch = pytest.MonkeyPatch()
    for module in KERNEL_MODULES:
        for name, fn in vars(module).items():
            if name.endswith("_kernel") and hasattr(fn, "run"):
                def record(*args, grid, warmup=False, _name=name, _fn=fn, **kwargs):
                    grid = grid(kwargs) if callable(grid) else grid
                    named = dict(zip(_fn.arg_names, args))
                    recorded.append((_name, tuple(grid), {**named, **kwargs}))
                patch.setattr(fn, "run", record)
    try:
        run()
    finally:
        patch.undo()
    return recorded


def problems(kernel: str, grid: tuple, args: dict) -> list[str]:
    """What the compiled backend refuses in one launch."""
    found = []
    size = lambda name: name if isinstance(name, int) else args[name]  # noqa: E731
    if not 1 <= len(grid) <= 3 or any(not 1 <= g <= limit for g, limit in zip(grid, MAX_GRID)):
        found.append(f"grid {grid} outside 1..{MAX_GRID}")
    for block in BLOCKS[kernel]:
        sizes = [size(n) for n in block]
        if any(s < 1 or s & (s - 1) for s in sizes):
            found.append(f"block {dict(zip(block, sizes))} not powers of two")
        if torch.tensor(sizes).prod() > MAX_NUMEL:
            found.append(f"block {dict(zip(block, sizes))} over {MAX_NUMEL} elements")
    for dot in DOTS.get(kernel, []):
        sizes = [size(n) for n in dot]
        if min(sizes) < MIN_DOT:
            found.append(f"tl.dot (M, N, K) = {tuple(sizes)} under {MIN_DOT}")
    return found


def check(launches):
    bad = [f"{kernel} grid {grid}: {p}" for kernel, grid, args in launches for p in problems(kernel, grid, args)]
    assert not bad, "\n".join(bad[:20])


def test_the_tables_name_every_kernel_and_every_dot():
    """A new kernel, block or tl.dot must be added to BLOCKS and DOTS to be checked."""
    for module in KERNEL_MODULES:
        source = Path(module.__file__).read_text()
        kernels = set(re.findall(r"^def (_\w+_kernel)\(", source, re.M))
        assert kernels <= set(BLOCKS), f"{module.__name__}: {kernels - set(BLOCKS)} not in BLOCKS"
        dots = len(re.findall(r"\btl\.dot\(", source))
        assert dots == sum(len(DOTS.get(k, [])) for k in kernels) * (2 if module is attention else 1), \
            f"{module.__name__} has {dots} tl.dot calls; DOTS lists others"  # the split kernel: fp32 and 16-bit


def model_config(name: str, num_layers: int = 1) -> ModelConfig:
    hidden, inter, heads, kv_heads, head_dim, context, window, qk_norm = ARCHITECTURES[name]
    return ModelConfig("LlamaForCausalLM", 1024, hidden, inter, num_layers, heads, kv_heads, head_dim, context, 1e-6,
                       RopeConfig(10000.0), sliding_window=window, qk_norm=qk_norm)


def forward_launches(cfg: ModelConfig, dtype: torch.dtype, B: int, T: int, cached: int, capacity: int):
    """The launches of one forward of T tokens per row after `cached` ones (one decoder layer)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(dtype)
    model.use_backend("triton")
    cache = model.new_cache(B, capacity, growable=False)
    tokens = torch.zeros(B, T, dtype=torch.int64, device="meta")
    start = torch.full((B,), cached, dtype=torch.int64, device="meta")
    with torch.no_grad():
        launches = launches_of(lambda: model(tokens, start, cache, kv_len=min(cached + T, capacity)))
    assert model.triton_fallback_reason is None
    return launches


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)  # float16 blocks as bfloat16's
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_every_step_and_prompt_launch_fits_the_compiled_backend(name, dtype):
    cfg = model_config(name)
    context = cfg.max_position_embeddings
    launches = []
    for B in BATCHES:
        for T in STEP_TOKENS:  # decoding and verification: short steps over a short and a full cache
            for cached in (0, context - T):
                launches += forward_launches(cfg, dtype, B, T, cached, context)
    for B, T in [(1, 1000), (8, 777), (1, context), (4, min(context, 8192))]:  # prompts, up to the context
        launches += forward_launches(cfg, dtype, B, T, 0, context)
    kernels = {k for k, _, _ in launches}
    assert kernels == {"_add_rms_norm_kernel", "_rope_write_kernel", "_split_kernel", "_merge_kernel",
                       "_silu_mul_kernel"}, kernels
    check(launches)
    # A prompt's query rows are cut into bounded blocks, however long it is.
    assert max(args["Q_ROWS"] for k, _, args in launches if k == "_split_kernel") <= attention.MAX_Q_ROWS


def test_a_head_dim_under_16_still_gives_dots_of_16():
    """The tiny test models (head_dim 8) pad the key block to tl.dot's minimum instead of failing to compile."""
    cfg = ModelConfig("LlamaForCausalLM", 64, 32, 64, 1, 4, 2, 8, 64, 1e-6, RopeConfig(10000.0))
    launches = forward_launches(cfg, torch.float32, 2, 3, 5, 64)
    check(launches)
    assert {args["BLOCK_D"] for k, _, args in launches if k == "_split_kernel"} == {16}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("filters", [True, False])
def test_every_verify_and_uniforms_launch_fits_the_compiled_backend(dtype, filters):
    launches = []
    for B in BATCHES:
        for G in (0, 1, 4, 8, 64):  # 0: a drafter's sampling step (ops.verify.sample_warped)
            for V in (1, 4097, 32000, 128256, 262144):
                def run():
                    meta = dict(device="meta")
                    target = torch.empty(B, G + 1, V, dtype=dtype, **meta)
                    draft = torch.empty(B, G, V, dtype=dtype, **meta)
                    i64 = lambda *shape: torch.empty(*shape, dtype=torch.int64, **meta)  # noqa: E731
                    f32 = lambda *shape: torch.empty(*shape, dtype=torch.float32, **meta)  # noqa: E731
                    if G == 0:  # sample_warped's call: one row of logits, explicit uniforms
                        verify.verify_triton(target, None, i64(B, 0), i64(B), f32(B), i64(B), f32(B), f32(B), i64(B),
                                             i64(B), f32(B, 1), f32(B, 1), None, None, filters)
                        return
                    verify.verify_triton(target, draft, i64(B, G), i64(B), f32(B), i64(B), f32(B), f32(B), i64(B),
                                         i64(B), f32(B, G + 1), None, i64(B), i64(B), filters)
                    verify.verify_triton(target, None, i64(B, G), i64(B), f32(B), i64(B), f32(B), f32(B), i64(B),
                                         i64(B), None, None, None, None, filters)
                    philox.uniforms_triton(i64(B), i64(B, G + 1), 0)
                launches += launches_of(run)
    kernels = {k for k, _, _ in launches}
    assert {"_stats_kernel", "_decide_kernel", "_sample_kernel", "_uniforms_kernel"} <= kernels
    assert filters == ("_top_k_kernel" in kernels)
    check(launches)


def gguf_matrix(parts: list[tuple[WeightType, int]], K: int) -> BlockMatrix:
    return BlockMatrix(tuple(MatrixPart(t, torch.empty(rows, row_bytes(t, K), dtype=torch.uint8, device="meta"))
                             for t, rows in parts))


def compiled_block_variants() -> set:
    """(kernel, constexprs but EXACT) of the kernels/blocks.py variants tests/compile_triton.py compiles."""
    from compile_triton import variants

    return {(kernel, frozenset((k, v) for k, v in constexprs.items() if k != "EXACT"))
            for module, kernel, _, constexprs in variants() if module == "blocks"}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_every_gguf_product_and_lookup_fits_the_compiled_backend(name):
    """GGUF matrices as stored (ops.blocks_triton): the packed q/k/v (Q4_K_M's Q4_K, Q4_K and Q6_K
    parts where the rows are whole K-quant blocks), gate/up, down and a 128k vocabulary in each
    weight type whose blocks fit, for every step, verification and prompt size; and lookups. Each
    launch is also one of the variants that compile_triton.py compiles."""
    hidden, inter, heads, kv_heads, head_dim, context, _, _ = ARCHITECTURES[name]
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = [([q, kv, kv], hidden), ([2 * inter], hidden), ([hidden], inter), ([128256], hidden)]
    calls = sorted({(B, T) for B in BATCHES for T in STEP_TOKENS} | {(1, 1000), (8, 777), (1, context),
                                                                     (4, min(context, 8192))})
    launches = []
    for out_rows, K in shapes:
        fitting = [t for t in WeightType if K % BLOCK_LAYOUT[t][0] == 0]
        mixes = [[(t, n) for n in out_rows] for t in fitting]
        if WeightType.Q4_K in fitting and len(out_rows) == 3:
            q4k, q6k = WeightType.Q4_K, WeightType.Q6_K
            mixes.append([(q4k, out_rows[0]), (q4k, out_rows[1]), (q6k, out_rows[2])])
        for parts in mixes:
            matrix = gguf_matrix(parts, K)
            bias = torch.empty(matrix.out_features, device="meta")

            def run():
                for B, T in calls:  # [B, T, K]: the kernel follows tokens per row (kernels.blocks.plan)
                    linear_blocks_triton(torch.empty(B, T, K, device="meta"), matrix, bias)
                embedding_rows_triton(matrix, torch.empty(8, 777, dtype=torch.int64, device="meta"))
                embedding_rows_triton(matrix, torch.empty(1, dtype=torch.int64, device="meta"))
            launches += launches_of(run)
    kernels = {k for k, _, _ in launches}
    assert kernels == {"_gemv_kernel", "_gemm_kernel", "_combine_kernel", "_rows_kernel"}, kernels
    check(launches)
    compiled = compiled_block_variants()
    for kernel, _, args in launches:
        params = inspect.signature(getattr(blocks, kernel).fn).parameters
        constexprs = {k: v for k, v in args.items() if k == "num_warps"
                      or (k in params and k != "EXACT" and "constexpr" in str(params[k].annotation))}
        assert (kernel, frozenset(constexprs.items())) in compiled, (kernel, constexprs)


def test_the_check_catches_what_the_interpreter_hides():
    assert problems("_split_kernel", (1, 70000, 1), dict(Q_ROWS=16, BLOCK_N=64, BLOCK_D=64)) == [
        "grid (1, 70000, 1) outside 1..(2147483647, 65535, 65535)"]
    assert problems("_split_kernel", (1, 1, 1), dict(Q_ROWS=16, BLOCK_N=64, BLOCK_D=8)) == [
        "tl.dot (M, N, K) = (16, 64, 8) under 16", "tl.dot (M, N, K) = (16, 8, 64) under 16"]
    assert problems("_add_rms_norm_kernel", (4,), dict(BLOCK=3 * 2**19)) == [
        "block {'BLOCK': 1572864} not powers of two", "block {'BLOCK': 1572864} over 1048576 elements"]
