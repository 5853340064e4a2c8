"""Compiles every Triton kernel for an H100/H200 (sm_90) and an A100 (sm_80) without a GPU: Triton's
own LLVM and ptxas build the cubins. The interpreter runs what the compiler rejects (module
globals read in a kernel, a tl.dot under 16), so tests/test_kernels_compile.py runs this in a
process without TRITON_INTERPRET, and tests/compile_triton_versions.sh under each Triton release.

    python tests/compile_triton.py [--arch 90 80] [--jobs N]

One line per kernel, variant and architecture: the registers per thread, the local memory per
thread (spills: cuobjdump's stack size) and the shared memory per program, against the
architecture's limits. A variant over a limit (it would fail to launch) fails the run; spills
are reported, not failed (a float32 dot keeps its operands in registers and spills at head_dim
128). Exit status 1 on any failure. Needs only triton (its nvidia backend ships ptxas and
cuobjdump): the kernels are loaded from kernels/ without specengine or torch.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import types
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"
# Per architecture: registers per thread, registers per program (one SM's file), shared memory
# per program with the opt-in carve-out (CUDA's sharedMemPerBlockOptin).
LIMITS = {90: dict(regs=255, block_regs=65536, shared=232448), 80: dict(regs=255, block_regs=65536, shared=166912)}

STEP_FLOAT32 = {"m_ptr", "l_ptr", "acc_ptr"}  # the attention splits' partials, float32 in any dtype
MODULES = ("activation", "attention", "norm", "philox", "rotary", "verify", "blocks")  # kernels/*.py
INT_POINTERS = {"top_k_ptr", "tile_arg_ptr", "state_ptr", "top_k_state_ptr", "top_p_state_ptr", "tokens_ptr",
                "num_drafts_ptr", "seeds_ptr", "positions_ptr", "decided_ptr", "emitted_ptr", "count_ptr",
                "target_len_ptr", "draft_len_ptr", "out_ptr_i64", "ids_ptr"}


def load_kernels():
    """kernels/ as a package of its own ("kernels"). Its modules import torch for their host
    wrappers only; where torch is not installed (a venv with just triton) a stub stands in."""
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.modules["torch"] = types.ModuleType("torch")
    # Another package named `kernels` (Hugging Face's, which transformers imports) may be loaded:
    # ours then goes under a name of its own.
    name = "kernels"
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve().parent != KERNELS_DIR.resolve():
        name = "specengine_kernels_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, KERNELS_DIR / "__init__.py",
                                                      submodule_search_locations=[str(KERNELS_DIR)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package
        spec.loader.exec_module(package)
    return [importlib.import_module(f"{name}.{module}") for module in MODULES]


def signature(fn, constexprs: dict, logits: str) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("target_ptr", "draft_ptr", "w_ptr"):  # w_ptr: a GGUF part's rows (kernels/blocks.py)
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
    """(kernel module, kernel name, pointer dtype, constexprs): what verify_triton and uniforms_triton
    launch, the decode step's kernels at the smallest blocks (tl.dot's minimum) and the largest
    (a long prompt's query blocks, the most splits, Llama 3 70B's 64 query heads and 8192 features),
    and every launch of ops.blocks_triton: each weight type's products and row lookup."""
    _, attention, _, _, _, verify, blocks = load_kernels()
    kernels = ["_stats_kernel", "_top_k_kernel", "_top_p_first_kernel", "_top_p_kernel", "_floor_kernel",
               "_decide_kernel", "_sample_kernel"]
    for logits, levels, flags in [("*fp32", 4, (True, False, True, True)), ("*bf16", 2, (False, True, False, False)),
                                  ("*fp16", 4, (True, True, True, False))]:
        has_draft, has_uniforms, has_target_len, has_draft_len = flags
        values = dict(TILE=verify.TILE, BLOCK=1024, NUM_BINS=verify.NUM_BINS, TILES=verify.TILES_PER_LOAD,
                      LEVELS=levels, CHUNK=32, HAS_DRAFT=has_draft, HAS_UNIFORMS=has_uniforms,
                      HAS_TARGET_LEN=has_target_len, HAS_DRAFT_LEN=has_draft_len)
        for name in kernels:
            fn = getattr(verify, name)
            yield "verify", name, logits, {k: v for k, v in values.items() if k in fn.arg_names}
    yield "philox", "_uniforms_kernel", "*fp32", dict(stream=0, BLOCK=128)  # up to MAX_GAMMA + 1 = 31 uniforms
    # The decode step's kernels, in bfloat16 (the GPU's compute dtype) and float32 (exact dots).
    for dtype, dot_fp32 in (("*bf16", False), ("*fp32", True)):
        rows = attention.MAX_Q_ROWS_FP32 if dot_fp32 else attention.MAX_Q_ROWS
        for block in (1024, 8192):
            yield "norm", "_add_rms_norm_kernel", dtype, dict(HAS_DELTA=True, BLOCK=block)
        yield "activation", "_silu_mul_kernel", dtype, dict(BLOCK=1024)
        yield "rotary", "_rope_write_kernel", dtype, dict(HAS_NORM=dtype == "*bf16", Q_HEADS=32, KV_HEADS=8, BLOCK_D=64)
        yield "rotary", "_rope_write_kernel", dtype, dict(HAS_NORM=True, Q_HEADS=64, KV_HEADS=8, BLOCK_D=128)
        for q_rows, D in ((attention.MIN_DOT, 64), (rows, 128)):
            yield "attention", "_split_kernel", dtype, dict(
                Q_ROWS=q_rows, D=D, BLOCK_D=D, BLOCK_N=attention.BLOCK_N, DOT_FP32=dot_fp32,
                num_warps=attention.split_warps(q_rows, D))
        for splits in (16, attention.MAX_SPLITS):
            yield "attention", "_merge_kernel", dtype, dict(D=128, BLOCK_D=128, SPLITS=splits)
    # GGUF parts as stored: each weight type's products (every tiling blocks.plan picks, by the
    # activation rows) and row lookup, compiled as launched on a GPU (EXACT: the unfused
    # inline-PTX dequantization).
    pointers = {blocks.F32.value: "*fp32", blocks.F16.value: "*fp16", blocks.BF16.value: "*i16"}
    tilings = {}
    for R, gemm in [(R, gemm) for R in range(1, 2 * blocks.GEMM_BLOCK_R + 2) for gemm in (False, True)]:
        p = blocks.plan(R, 4096, 4096, gemm)
        tilings[p["kernel"], p["BLOCK_R"]] = dict(BLOCK_R=p["BLOCK_R"], BLOCK_N=p["BLOCK_N"], num_warps=p["num_warps"])
    for weight_type in blocks.LAYOUT:
        w = pointers.get(weight_type, "*u8")
        for (kernel, _), tiles in tilings.items():
            yield "blocks", f"_{kernel}_kernel", w, dict(TYPE=weight_type, EXACT=True, **tiles)
        yield "blocks", "_rows_kernel", w, dict(TYPE=weight_type, BLOCK_IDS=blocks.ROWS_BLOCK_IDS,
                                                GROUPS=blocks.ROWS_GROUPS, EXACT=True, num_warps=blocks.NUM_WARPS)
    yield "blocks", "_combine_kernel", "*fp32", dict(BLOCK=blocks.COMBINE_BLOCK, num_warps=blocks.NUM_WARPS)


def resources(compiled, arch: int) -> tuple[dict, list[str]]:
    """(registers, local bytes, shared bytes and warps; the problems against the architecture's limits)."""
    regs, spills = _cuobjdump(compiled.asm["cubin"])
    shared = compiled.metadata.shared
    threads = 32 * compiled.metadata.num_warps
    found = dict(regs=regs, spills=spills, shared=shared, warps=compiled.metadata.num_warps)
    limit = LIMITS[arch]
    problems = []
    if shared > limit["shared"]:
        problems.append(f"shared {shared} > {limit['shared']} bytes")
    if regs is not None and (regs > limit["regs"] or regs * threads > limit["block_regs"]):
        problems.append(f"{regs} registers x {threads} threads over {limit['regs']} / {limit['block_regs']}")
    return found, problems


def _cuobjdump(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, local-memory stack bytes) of a cubin from cuobjdump --dump-resource-usage (the
    driver reports them only when it loads the cubin, on a GPU)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else (None, None)


def compile_one(job) -> tuple[str, bool, float]:
    """(report line, ok, seconds) of one variant on one architecture."""
    module_name, kernel, dtype, constexprs, arch = job
    constexprs = dict(constexprs)
    options = {"num_warps": constexprs.pop("num_warps")} if "num_warps" in constexprs else {}  # as launched
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module = dict(zip(MODULES, load_kernels()))[module_name]
    fn = getattr(module, kernel)
    sig = signature(fn, constexprs, dtype)
    if kernel == "_uniforms_kernel":
        sig.update(seeds_ptr="*i64", positions_ptr="*i64", out_ptr="*fp32")
    source = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    label = f"sm_{arch} {kernel} {dtype} {dict(constexprs, **options)}"
    start = time.perf_counter()
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
        found, problems = resources(compiled, arch)
    except Exception:  # noqa: BLE001 (report every kernel, then fail)
        return f"FAILED  {label}\n{traceback.format_exc()}", False, time.perf_counter() - start
    seconds = time.perf_counter() - start
    limit = LIMITS[arch]
    spills = "" if not found["spills"] else f" SPILLS {found['spills']} bytes of local memory"
    usage = (f"{found['regs']}/{limit['regs']} regs, {found['warps']} warps, shared "
             f"{found['shared']}/{limit['shared']} bytes{spills}")
    if problems:
        return f"FAILED  {label}: over the limits: {'; '.join(problems)} ({usage})", False, seconds
    return f"ok      {label} ({usage}; {seconds:.1f} s)", True, seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", choices=sorted(LIMITS), default=[90, 80])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    import triton

    jobs = [(*variant, arch) for arch in args.arch for variant in variants()]
    print(f"triton {triton.__version__}: {len(jobs)} compilations for sm_{', sm_'.join(map(str, args.arch))}",
          flush=True)
    start = time.perf_counter()
    failed = spilled = 0
    with ProcessPoolExecutor(args.jobs) as pool:
        for line, ok, _ in pool.map(compile_one, jobs):
            print(line, flush=True)
            failed += not ok
            spilled += "SPILLS" in line
    print(f"{len(jobs) - failed} compiled, {failed} failed, {spilled} spill to local memory; "
          f"{time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
