"""Compiles every Triton kernel for an H100/H200 (sm_90) without a GPU: Triton's own LLVM and
ptxas build the cubins. The interpreter runs what the compiler rejects (module globals read in
a kernel, say), so tests/test_kernels_compile.py runs this in a process without TRITON_INTERPRET.

    python tests/compile_triton.py    # prints one line per kernel and variant; exit 1 on failure
"""
import sys
import traceback

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from specengine.kernels import activation, attention, norm, philox, rotary, verify

STEP_FLOAT32 = {"m_ptr", "l_ptr", "acc_ptr"}  # the attention splits' partials, float32 in any dtype
INT_POINTERS = {"top_k_ptr", "tile_arg_ptr", "state_ptr", "top_k_state_ptr", "top_p_state_ptr", "tokens_ptr",
                "num_drafts_ptr", "seeds_ptr", "positions_ptr", "decided_ptr", "emitted_ptr", "count_ptr",
                "target_len_ptr", "draft_len_ptr", "out_ptr_i64"}


def signature(fn, constexprs: dict, logits: str) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("target_ptr", "draft_ptr"):
            sig[name] = logits
        elif name == "counts_ptr":
            sig[name] = "*i32"
        elif name in INT_POINTERS:
            sig[name] = "*i64"
        elif name in STEP_FLOAT32:
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = logits if fn.__module__.split(".")[-1] in ("norm", "activation", "rotary", "attention") \
                else "*fp32"
        elif name in ("eps", "scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def variants():
    """(kernel, logits pointer type, constexprs) for what verify_triton and uniforms_triton launch."""
    kernels = [verify._stats_kernel, verify._top_k_kernel, verify._top_p_first_kernel, verify._top_p_kernel,
               verify._floor_kernel, verify._decide_kernel, verify._sample_kernel]
    for logits, levels, flags in [("*fp32", 4, (True, False, True, True)), ("*bf16", 2, (False, True, False, False)),
                                  ("*fp16", 4, (True, True, True, False))]:
        has_draft, has_uniforms, has_target_len, has_draft_len = flags
        values = dict(TILE=4096, BLOCK=1024, NUM_BINS=verify.NUM_BINS, TILES=verify.TILES_PER_LOAD, LEVELS=levels,
                      CHUNK=32, HAS_DRAFT=has_draft, HAS_UNIFORMS=has_uniforms, HAS_TARGET_LEN=has_target_len,
                      HAS_DRAFT_LEN=has_draft_len)
        for fn in kernels:
            yield fn, logits, {k: v for k, v in values.items() if k in fn.arg_names}
    yield philox._uniforms_kernel, "*fp32", dict(stream=0, BLOCK=16)
    # The decode step's kernels, in bfloat16 (the GPU's compute dtype) and float32.
    for dtype, dot_fp32 in (("*bf16", False), ("*fp32", True)):
        yield norm._add_rms_norm_kernel, dtype, dict(HAS_DELTA=True, BLOCK=1024)
        yield activation._silu_mul_kernel, dtype, dict(BLOCK=activation.BLOCK)
        yield rotary._rope_write_kernel, dtype, dict(HAS_NORM=dtype == "*bf16", Q_HEADS=32, KV_HEADS=8, BLOCK_D=64)
        yield attention._split_kernel, dtype, dict(GROUP=4, Q_ROWS=16, D=64, BLOCK_D=64, BLOCK_N=attention.BLOCK_N,
                                                   DOT_FP32=dot_fp32)
        yield attention._merge_kernel, dtype, dict(D=128, BLOCK_D=128, SPLITS=16)


def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    failed = 0
    for fn, logits, constexprs in variants():
        sig = signature(fn, constexprs, logits)
        if fn is philox._uniforms_kernel:
            sig.update(seeds_ptr="*i64", positions_ptr="*i64", out_ptr="*fp32")
        source = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
        try:
            compiled = triton.compile(source, target=target)
            print(f"ok      {fn.__name__} {logits} {constexprs} ({len(compiled.asm['cubin'])} bytes of cubin)")
        except Exception:  # noqa: BLE001 (report every kernel, then fail)
            failed += 1
            print(f"FAILED  {fn.__name__} {logits} {constexprs}\n{traceback.format_exc()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
