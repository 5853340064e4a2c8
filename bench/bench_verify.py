"""Verify-step benchmark: eager torch reference vs fused C++ (CPU) vs fused Triton (GPU).

    python bench/bench_verify.py [--quick] [--out bench/results/verify-<machine>.csv]

Per case: median microseconds per call, effective GB/s (bytes of target and draft logits read
once / time), the memory floor (those bytes / this device's measured copy bandwidth) and the
ratio of the time to that floor. Rows sample at temperature 1 (top-p 0.9 where named),
drafts are drawn from q, uniforms come from Philox inside the op.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import statistics
import time
from pathlib import Path

import torch

from specengine.benchmark import machine_name
from specengine.ops.verify import verify
from specengine.sampling.warp import sample_from_probs, warp_probs

from common import RESULTS, sync

FULL_GRID = [(B, G, V) for B in (1, 8, 64) for G in (1, 4, 8) for V in (32000, 128256, 151936)]
QUICK_GRID = [(1, 4, 32000), (8, 5, 32000), (8, 1, 32000), (8, 8, 32000), (64, 4, 32000), (8, 4, 128256),
              (8, 4, 151936)]


def timeit(fn, device, min_reps=3, budget_s=1.0) -> float:
    """Median seconds per call: at least min_reps calls, more while within budget_s."""
    fn()
    sync(device)
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device) -> float:
    """Bytes/s of a large device copy (read + write counted): the memory floor's yardstick."""
    x = torch.empty(64 * 2**20, dtype=torch.float32, device=device)  # 256 MiB
    y = torch.empty_like(x)
    seconds = timeit(lambda: y.copy_(x), device, min_reps=5, budget_s=2.0)
    return 2 * x.numel() * x.element_size() / seconds


def make_inputs(B, G, V, device, top_p, seed=0):
    """Made on the device itself: on a GPU machine, building the largest cases on its CPU (a top-p
    sort over 151936 logits for 512 rows) would take longer than timing them."""
    g = torch.Generator(device).manual_seed(seed)
    target = torch.randn(B, G + 1, V, generator=g, device=device) * 3
    draft = target[:, :G] + torch.randn(B, G, V, generator=g, device=device)
    temperature, top_k = torch.ones(B, device=device), torch.zeros(B, dtype=torch.int64, device=device)
    top_p_t, min_p = torch.full((B,), top_p, device=device), torch.zeros(B, device=device)
    q = warp_probs(draft.reshape(B * G, V), temperature.repeat_interleave(G), top_k.repeat_interleave(G),
                   top_p_t.repeat_interleave(G), min_p.repeat_interleave(G))
    tokens = sample_from_probs(q, torch.rand(B * G, generator=g, device=device)).view(B, G)
    return (target, draft, tokens, torch.full((B,), G, device=device), temperature, top_k, top_p_t, min_p,
            torch.arange(B, device=device), torch.full((B,), 100, device=device))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a CPU-sized subset of the grid")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", help="CSV path (default bench/results/verify-<device>-<date>.csv)")
    args = parser.parse_args()
    device = torch.device(args.device)
    impls = ["reference", "triton"] if device.type == "cuda" else ["reference", "cpp"]
    machine = machine_name(device)
    date = datetime.date.today().isoformat()
    bandwidth = copy_bandwidth(device)
    print(f"# {machine}; copy bandwidth {bandwidth / 1e9:.1f} GB/s; torch {torch.__version__}")
    grid = [(B, G, V, 1.0) for B, G, V in (QUICK_GRID if args.quick else FULL_GRID)] + [(8, 5, 32000, 0.9)]
    out = Path(args.out or RESULTS / f"verify-{device.type}-{date}.csv")
    out.parent.mkdir(parents=True, exist_ok=True)
    budget_s = 0.5 if device.type == "cuda" else 1.0  # GPU medians settle within a few hundred calls
    rows = []
    for B, G, V, top_p in grid:
        inputs = make_inputs(B, G, V, device, top_p)
        logit_bytes = (inputs[0].numel() + inputs[1].numel()) * inputs[0].element_size()
        floor_s = logit_bytes / bandwidth
        times = {}
        for impl in impls:
            times[impl] = timeit(lambda: verify(*inputs, impl=impl), device, budget_s=budget_s)
        fused = impls[1]
        for impl in impls:
            s = times[impl]
            row = dict(machine=machine, date=date, torch=torch.__version__, device=device.type, impl=impl, B=B, G=G,
                       V=V, top_p=top_p, median_us=round(s * 1e6, 1), gb_per_s=round(logit_bytes / s / 1e9, 2),
                       floor_us=round(floor_s * 1e6, 1), ratio_to_floor=round(s / floor_s, 2),
                       speedup_vs_reference=round(times["reference"] / s, 2))
            rows.append(row)
        print(f"B={B:3d} G={G} V={V:6d} top_p={top_p}: reference {times['reference'] * 1e6:10.0f} us  "
              f"{fused} {times[fused] * 1e6:9.0f} us  ({times['reference'] / times[fused]:.1f}x, "
              f"{times[fused] / floor_s:.1f}x the memory floor)", flush=True)
        with out.open("w", newline="") as f:  # after every case: a run cut short keeps what it measured
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(f"wrote {out}")

if __name__ == "__main__":
    main()
