"""A prompt's prefill on a CPU: the C++ float32 GEMM (gemm_blocks) against oneDNN's sgemm, and AMX.

    python bench/bench_prefill.py [--models default Q4_1 Q8_0] [--lengths 64 512] [--repeats 7]
                                  [--kernels] [--threads 2] [--out FILE]

Models: "default", the default target (SmolLM2-135M-Instruct's Q4_1 GGUF file, its matrices kept
as stored, float32 compute); a GGUF type name (Q4_1, Q8_0, ...), that SmolLM2 file from
bench/gguf_files.py's folder; or a path. NAME@bfloat16 loads NAME's matrices dequantized into dense
bfloat16 tensors (ops.product). For each prompt length, the median milliseconds of one
prefill (the forward over the prompt and the logits of its last token) on each path, interleaved
call by call so that all see the same machine:

  gemm_blocks  the products as the engine runs them: csrc/gemm_blocks.cpp's float32 FMA tiles on
               weights dequantized (or widened) 32 rows at a time
  sgemm        the path it replaced: 4 MiB slabs of weight rows dequantized (widened), then
               F.linear (oneDNN's sgemm) in fixed blocks of 64 rows, the last padded
  amx          ops.linear's AMX op (bfloat16 matrices, CPUs with AMX only)

and the largest logit difference from gemm_blocks. --kernels adds the GFLOP/s of the two float32
products alone on SmolLM2's shapes (a dense float32 matrix, so no dequantization), medians of
interleaved calls. Run on an otherwise idle machine: both products use every thread.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specengine import _C, default_pair
from specengine.devtools.benchmark import machine_name
from specengine.models import load_model
from specengine.ops import blocks_cpp, product

from common import cpu_name, write_json

GGUF_FOLDER = Path.home() / ".cache" / "specengine" / "bench-gguf"
# SmolLM2-135M's products (K -> N): q and o, k and v, gate and up, down, a 4 MiB slab of the head.
KERNEL_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]


def sgemm_product(x: torch.Tensor, matrix, bias: torch.Tensor | None) -> torch.Tensor:
    """The replaced path: slabs of 4 MiB of float32 weight rows, F.linear over blocks of 64 rows."""
    K = x.shape[-1]
    N = matrix.shape[0] if isinstance(matrix, torch.Tensor) else matrix.out_features
    rows = x.reshape(-1, K)
    R = rows.shape[0]
    pad = -R % 64
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, K)])
    out = torch.empty((R + pad, N), dtype=torch.float32)
    slab = max(1, (4 << 20) // (4 * K))
    for n0 in range(0, N, slab):
        n1 = min(N, n0 + slab)
        w = blocks_cpp.dequantize_rows_cpp(matrix, n0, n1)
        b = None if bias is None else bias[n0:n1]
        for i in range(0, R + pad, 64):
            out[i:i + 64, n0:n1] = F.linear(rows[i:i + 64], w, b)
    return out[:R].view(*x.shape[:-1], N)


@contextlib.contextmanager
def products(path: str):
    """Prompt-sized products on `path` while inside."""
    saved = product.gemm_blocks_cpp
    if path == "sgemm":
        product.gemm_blocks_cpp = sgemm_product
    if path == "amx":
        _C.set_cpu_isa_limit("amx")
    elif _C.cpu_isa() == "amx":
        _C.set_cpu_isa_limit("avx512")
    try:
        yield
    finally:
        product.gemm_blocks_cpp = saved
        _C.set_cpu_isa_limit("amx")


def prefill_ms(model, tokens: torch.Tensor) -> tuple[float, torch.Tensor]:
    cache = model.new_cache(1, tokens.shape[1] + 1)
    start = time.perf_counter()
    with torch.no_grad():
        logits = model.logits(model(tokens, torch.zeros(1, dtype=torch.int64), cache)[:, -1])
    return (time.perf_counter() - start) * 1e3, logits


def model_path(name: str) -> Path:
    if name == "default":
        return default_pair()[0]
    if Path(name).exists():
        return Path(name)
    return GGUF_FOLDER / f"SmolLM2-135M-Instruct.{name}.gguf"


def prefill_rows(name: str, lengths: list[int], repeats: int) -> list[dict]:
    file, _, weight_dtype = name.partition("@")
    model = load_model(model_path(file), weight_dtype=weight_dtype or None)
    paths = ["gemm_blocks", "sgemm"] + (["amx"] if weight_dtype == "bfloat16" and _C.cpu_isa() == "amx" else [])
    rows = []
    for length in lengths:
        tokens = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        times = {path: [] for path in paths}
        logits = {}
        for _ in range(repeats + 1):  # the first round warms up
            for path in paths:
                with products(path):
                    ms, logits[path] = prefill_ms(model, tokens)
                times[path].append(ms)
        row = {"model": name, "prompt_tokens": length,
               **{f"{p}_ms": round(statistics.median(t[1:]), 2) for p, t in times.items()}}
        row["gemm_blocks_vs_sgemm"] = round(row["gemm_blocks_ms"] / row["sgemm_ms"], 3)
        row["tokens_per_s"] = round(length / row["gemm_blocks_ms"] * 1e3, 1)
        for path in paths[1:]:
            row[f"max_logit_difference_{path}"] = float((logits[path] - logits["gemm_blocks"]).abs().max())
        print(row, flush=True)
        rows.append(row)
    return rows


def kernel_rows(repeats: int) -> list[dict]:
    """GFLOP/s of gemm_blocks and of the sgemm path's F.linear blocks on a float32 slab (no
    dequantization on either side: the product alone)."""
    rows = []
    for K, N in KERNEL_SHAPES:
        N = min(N, (4 << 20) // (4 * K))  # one slab, as the sgemm path had it
        g = torch.Generator().manual_seed(K + N)
        w = torch.randn(N, K, generator=g)
        for R in (64, 512):
            x = torch.randn(R, K, generator=g)
            out = torch.empty(R, N)

            def ours():
                _C.gemm_blocks(x.data_ptr(), blocks_cpp.matrix_descriptor(w), 0, out.data_ptr(), R, N)

            def sgemm():
                for i in range(0, R, 64):
                    out[i:i + 64] = F.linear(x[i:i + 64], w)
            times = {"gemm_blocks": [], "sgemm": []}
            for _ in range(repeats + 1):
                for name, fn in (("gemm_blocks", ours), ("sgemm", sgemm)):
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            row = {"K": K, "N": N, "R": R,
                   **{f"{name}_gflops": round(2 * R * K * N / statistics.median(t[1:]) / 1e9, 1)
                      for name, t in times.items()}}
            print(row, flush=True)
            rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["default"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--kernels", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--label", default="prefill-cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # specengine._C runs on torch's OpenMP runtime: both ops follow
    record = {"machine": machine_name(), "cpu": cpu_name(), "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "isa": _C.cpu_isa()}
    if args.kernels:
        record["kernels"] = kernel_rows(args.repeats)
    record["prefill"] = [row for name in args.models for row in prefill_rows(name, args.lengths, args.repeats)]
    write_json(record, args.out, f"{args.label}-{datetime.date.today().isoformat()}.json")


if __name__ == "__main__":
    main()
