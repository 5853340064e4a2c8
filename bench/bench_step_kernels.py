"""Each decode-step kernel against the torch ops it replaces, at the shipped and widened targets'
shapes (CUDA only: on a CPU the kernels run in Triton's interpreter, which times nothing real).

    python bench/bench_step_kernels.py [--models shipped widened] [--out bench/results/step-kernels-<date>.json]

Per op and shape: median microseconds of the Triton kernel and of the torch reference (the model's
torch path), bytes moved once (inputs read, outputs written), and each one's ratio to that floor
at this device's measured copy bandwidth. bfloat16 throughout. Before it is timed, each kernel's
output is compared with the torch path's (the kernels are called directly, so what is timed is
the compiled kernel or the run stops with its error; a wrong result is recorded and the run
exits with status 1). The results are rewritten after every case, so a run cut short keeps what
it measured.
"""
from __future__ import annotations

import argparse
import datetime
import sys

import torch
import torch.nn.functional as F

from specengine.devtools.benchmark import machine_name
from specengine.kernels.activation import silu_mul_triton
from specengine.kernels.norm import add_rms_norm_triton
from specengine.ops.attention import attention_mask, cached_attention_reference, cached_attention_triton
from specengine.ops.norm import rms_norm_reference

from common import copy_bandwidth, timeit, write_json

DTYPE = torch.bfloat16
# (name, hidden, intermediate, heads, kv heads): the shipped target's shape and the widened one's.
MODELS = {"shipped": ("shipped target", 512, 1408, 8, 4), "widened": ("widened target", 2048, 5632, 32, 8)}


def cases(device, models):
    """(op, shape label, bytes moved once, triton fn, torch fn)."""
    size = torch.finfo(DTYPE).bits // 8
    for name, hidden, inter, H, Hkv in (MODELS[m] for m in models):
        D = hidden // H
        for B, T in ((1, 1), (8, 1), (1, 5)):
            rows = B * T
            x, delta = (torch.randn(rows, hidden, device=device, dtype=DTYPE) for _ in range(2))
            w = torch.ones(hidden, device=device, dtype=DTYPE)
            # The kernel adds delta into x in place on every call: x drifts over the repeats, which
            # changes no timing.
            # The torch side reads x + delta before the kernel adds delta into x (the check calls it first).
            yield ("rmsnorm+add", f"{name} B={B} T={T}", 4 * rows * hidden * size,
                   lambda: add_rms_norm_triton(x, w, 1e-6, delta), lambda: rms_norm_reference(x + delta, w, 1e-6))
            gate_up = torch.randn(rows, 2 * inter, device=device, dtype=DTYPE)
            yield ("silu*mul", f"{name} B={B} T={T}", 3 * rows * inter * size, lambda: silu_mul_triton(gate_up),
                   lambda: F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
            for kv_len in (256, 2048):
                capacity = kv_len + 8
                qkv = torch.randn(B, T, (H + 2 * Hkv) * D, device=device, dtype=DTYPE)
                q, k, v = qkv.split((H * D, Hkv * D, Hkv * D), dim=-1)
                q, k, v = q.view(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
                positions = torch.full((B, 1), kv_len - T, device=device) + torch.arange(T, device=device)
                cos = torch.randn(B, T, D, device=device, dtype=DTYPE)
                sin = torch.randn(B, T, D, device=device, dtype=DTYPE)
                cache_k = torch.randn(B, capacity + 1, Hkv, D, device=device, dtype=DTYPE)
                cache_v = torch.randn_like(cache_k)
                mask = attention_mask(positions, kv_len, None)
                moved = (2 * B * kv_len * Hkv * D + 2 * B * T * H * D) * size
                yield ("rotary+cache+attention", f"{name} B={B} T={T} kv={kv_len}", moved,
                       lambda: cached_attention_triton(q, k, v, cos, sin, positions, cache_k, cache_v, kv_len, None),
                       lambda: cached_attention_reference(q, k, v, cos, sin, positions, cache_k, cache_v, kv_len, mask))


@torch.inference_mode()
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_step_kernels.py times compiled Triton kernels: it needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    rows = []
    date = datetime.date.today().isoformat()
    # Called directly, the kernels cannot fall back: the field says so to whoever collects them.
    result = dict(machine=machine_name(device), date=date, torch=torch.__version__, dtype="bfloat16",
                  copy_bandwidth_gb_s=bandwidth / 1e9, triton_fallback_reason=None, rows=rows)
    wrong = []
    for op, shape, moved, triton_fn, torch_fn in cases(device, args.models):
        want = torch_fn()
        got = triton_fn()
        error = (got.float() - want.float()).abs().max().item()
        scale = want.float().abs().max().item()
        if not error <= 2e-2 * max(scale, 1.0):  # a few bfloat16 roundings apart at most
            wrong.append(f"{op} {shape}: max error {error:.3g} against values up to {scale:.3g}")
        floor_us = 1e6 * moved / bandwidth
        kernel, reference = (1e6 * timeit(fn, device, min_reps=100, budget_s=0.0) for fn in (triton_fn, torch_fn))
        rows.append(dict(op=op, shape=shape, bytes=moved, floor_us=floor_us, triton_us=kernel, torch_us=reference,
                         triton_ratio_to_floor=kernel / floor_us, speedup=reference / kernel, max_error=error))
        print(f"{op:24s} {shape:36s} triton {kernel:8.1f} us  torch {reference:8.1f} us  "
              f"({reference / kernel:.1f}x; floor {floor_us:.1f} us)", flush=True)
        write_json(result, args.out, f"step-kernels-{date}.json")
    if wrong:
        print("kernels that disagree with the torch path:\n  " + "\n  ".join(wrong))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
