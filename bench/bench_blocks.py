"""Microbenchmark of the block-format product (ops.blocks, "cpp": csrc/blocks.cpp) per weight type and
row count, on a model's matrix shapes, against the bfloat16 op (_C.linear_bf16_weight) on the same shapes.

    python bench/bench_blocks.py [--types Q4_1 Q8_0 ...] [--rows 1 2 4 6 8] [--repeats 5] [--threads 2]
                                 [--clock wall|cpu] [--isa avx512|avx2|portable]

For each type and R it runs one whole-model pass (every layer's qkv, o, gate_up and down matrix, each
its own copy, then the head) as a decode step reads them, and reports the milliseconds per pass
(median of --repeats, each the mean of several passes) and the GB/s of weight bytes it read. Shapes:
SmolLM2-135M's (30 layers, hidden 576, intermediate 1536, 9 + 3 + 3 heads of 64, vocabulary 49152,
tied head) for the types whose blocks divide 576; the K-quants (256-weight blocks) take a model of
the same size with hidden 768 and intermediate 2048 (18 layers). The "file" row is the SmolLM2 Q4_1
file's mix: Q4_1 layers and a Q8_0 head. Other processes on the machine make the numbers rough:
with --threads 1, --clock cpu (this process's CPU time, the minimum over repeats) is much steadier
than wall time on a shared machine, but counts no time lost to waiting for another thread.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specengine import _C  # noqa: E402
from specengine.ops.blocks import BLOCK_LAYOUT, BlockMatrix, MatrixPart, WeightType  # noqa: E402
from specengine.ops.blocks_cpp import matrix_descriptor  # noqa: E402

SMOLLM2 = dict(layers=30, hidden=576, inter=1536, qkv=(9 + 3 + 3) * 64, vocab=49152)
K_SHAPES = dict(layers=18, hidden=768, inter=2048, qkv=3 * 768, vocab=49152)


def random_part(weight_type: WeightType, rows: int, cols: int, g: torch.Generator) -> MatrixPart:
    """Random blocks with sane float16 scales (every field a valid value, none NaN or inf)."""
    block, size = BLOCK_LAYOUT[weight_type]
    if weight_type == WeightType.F32:
        data = (torch.randn(rows, cols, generator=g) * 0.05).view(torch.uint8)
    elif weight_type in (WeightType.F16, WeightType.BF16):
        dtype = torch.float16 if weight_type == WeightType.F16 else torch.bfloat16
        data = (torch.randn(rows, cols, generator=g) * 0.05).to(dtype).view(torch.uint8)
    else:
        data = torch.randint(0, 256, (rows, cols // block, size), dtype=torch.uint8, generator=g)
        scale_offsets = {WeightType.Q4_K: (0, 2), WeightType.Q5_K: (0, 2), WeightType.Q6_K: (208,)}
        for offset in scale_offsets.get(weight_type, (0, 2) if weight_type in (WeightType.Q4_1, WeightType.Q5_1)
                                        else (0,)):
            scales = (torch.rand(rows, cols // block, generator=g) * 0.01 + 0.001).half()
            data[:, :, offset:offset + 2] = scales.view(torch.uint8).view(rows, cols // block, 2)
        data = data.reshape(rows, -1)
    return MatrixPart(weight_type, data.contiguous())


def model(shapes: dict, layer_type: WeightType, head_type: WeightType, g: torch.Generator) -> list[BlockMatrix]:
    h, i = shapes["hidden"], shapes["inter"]
    mats = []
    for _ in range(shapes["layers"]):
        for n, k in ((shapes["qkv"], h), (h, h), (2 * i, h), (h, i)):
            mats.append(BlockMatrix((random_part(layer_type, n, k, g),)))
    mats.append(BlockMatrix((random_part(head_type, shapes["vocab"], h, g),)))
    return mats


def time_pass(calls, repeats: int, clock: str) -> float:
    """Seconds per pass: the median over repeats of the mean of 3 passes (wall), or the minimum (cpu)."""
    timer = time.perf_counter if clock == "wall" else time.process_time
    for call in calls:  # warm up
        call()
    times = []
    for _ in range(repeats):
        n = 3
        start = timer()
        for _ in range(n):
            for call in calls:
                call()
        times.append((timer() - start) / n)
    return statistics.median(times) if clock == "wall" else min(times)


def block_calls(mats: list[BlockMatrix], R: int):
    calls = []
    for m in mats:
        desc = matrix_descriptor(m)
        x = torch.randn(R, m.in_features)
        out = torch.empty(R, m.out_features)
        calls.append(lambda x=x, d=desc, out=out: _C.linear_blocks(x.data_ptr(), d, 0, out.data_ptr(), R))
    return calls


def bf16_calls(mats: list[BlockMatrix], R: int):
    calls = []
    for m in mats:
        w = torch.randn(m.out_features, m.in_features).bfloat16()
        x = torch.randn(R, m.in_features)
        out = torch.empty(R, m.out_features)
        calls.append(lambda x=x, w=w, out=out, N=m.out_features, K=m.in_features:
                     _C.linear_bf16_weight(x.data_ptr(), w.data_ptr(), 0, out.data_ptr(), R, K, N))
    return calls


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=["file", "Q4_1", "Q8_0", "Q4_0", "Q5_0", "Q5_1", "F16",
                                                        "Q4_K", "Q5_K", "Q6_K", "bf16-op"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 6, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", default=None, help="an instruction-set limit (_C.set_cpu_isa_limit)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.isa:
        _C.set_cpu_isa_limit(args.isa)
    g = torch.Generator().manual_seed(0)
    print(f"isa {_C.cpu_isa()}, {args.threads} threads, {args.clock} clock; ms per whole-model pass "
          f"(GB/s of weight bytes)")
    print(f"{'type':10s} {'MB':>6s} " + " ".join(f"{'R=' + str(r):>15s}" for r in args.rows))
    for name in args.types:
        if name == "bf16-op":
            mats = model(SMOLLM2, WeightType.BF16, WeightType.BF16, g)
            nbytes = sum(m.nbytes for m in mats)
            make = bf16_calls
        else:
            layer = WeightType.Q4_1 if name == "file" else WeightType[name]
            head = WeightType.Q8_0 if name == "file" else layer
            shapes = K_SHAPES if BLOCK_LAYOUT[layer][0] == 256 else SMOLLM2
            mats = model(shapes, layer, head, g)
            nbytes = sum(m.nbytes for m in mats)
            make = block_calls
        cells = []
        for R in args.rows:
            seconds = time_pass(make(mats, R), args.repeats, args.clock)
            cells.append(f"{seconds * 1e3:6.2f} ({nbytes / seconds / 1e9:5.1f})")
        print(f"{name:10s} {nbytes / 1e6:6.1f} " + " ".join(f"{c:>15s}" for c in cells), flush=True)
        del mats


if __name__ == "__main__":
    main()
