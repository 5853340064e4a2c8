"""Verify-step benchmark: the torch reference, the fused C++ op (CPU), the Triton kernel and the
previous one-program-per-row Triton kernel (GPU), side by side.

    python bench/bench_verify.py [--quick | --goals] [--device cuda] [--impls reference triton]
        [--out bench/results/verify-<device>-<date>.csv]

Per case (B, G, V, logit dtype, warp): median microseconds per call, called eagerly and, for the
Triton kernel, replayed from a CUDA graph (how the engine runs it: its launches' host time gone;
the previous kernel is one launch, the reference is not graph-safe); the bytes
one read of the target and draft logits takes, this device's measured copy bandwidth, the memory
floor (bytes / bandwidth) and the ratio to it. Rows sample at temperature 1, alone ("T=1": the
engine then passes filters=False), with top-k 50 or with top-p 0.9; drafts are drawn from q and
uniforms come from Philox inside the op. --quick: the CPU-sized grid for the C++ op. --goals: only
the cases the GPU goals name (B=1 G=4 V=32000 and B=64 G=4 V=128256, temperature 1 alone, float32
logits: the engine's call), for bench/gpu_check.sh.
"""
from __future__ import annotations

import argparse
import csv
import datetime
from pathlib import Path

import torch

from specengine.devtools.benchmark import machine_name
from specengine.ops.verify import verify
from specengine.sampling.warp import sample_from_probs, warp_probs

from common import RESULTS, copy_bandwidth, timeit

WARPS = {"T=1": dict(top_k=0, top_p=1.0), "top-k 50": dict(top_k=50, top_p=1.0), "top-p 0.9": dict(top_k=0, top_p=0.9)}
# The shapes with targets first (a run cut short keeps them), each with every warp and both
# logit dtypes; then the rest of the grid at temperature 1 in float32.
WARPED_SHAPES = [(1, 4, 32000), (1, 4, 128256), (64, 4, 128256), (8, 4, 151936)]
SHAPES = [(B, G, V) for B in (1, 8, 64) for G in (1, 4, 8) for V in (32000, 128256)] + [(B, 4, 151936) for B in (1, 64)]
GOAL_SHAPES = [(1, 4, 32000), (64, 4, 128256)]
QUICK_SHAPES = [(1, 4, 32000), (8, 5, 32000), (8, 1, 32000), (8, 8, 32000), (64, 4, 32000), (8, 4, 128256),
                (8, 4, 151936)]


def cases(quick: bool, goals: bool = False):
    if goals:
        return [(B, G, V, torch.float32, "T=1") for B, G, V in GOAL_SHAPES]
    if quick:
        return [(B, G, V, torch.float32, "T=1") for B, G, V in QUICK_SHAPES] + [(8, 5, 32000, torch.float32, "top-p 0.9")]
    warped = [(B, G, V, dtype, warp) for B, G, V in WARPED_SHAPES for dtype in (torch.float32, torch.bfloat16)
              for warp in WARPS]
    return warped + [(B, G, V, torch.float32, "T=1") for B, G, V in SHAPES if (B, G, V) not in WARPED_SHAPES]


def replayed(fn, device, budget_s) -> float:
    """Median seconds per replay of fn captured in a CUDA graph (10 calls per graph, so that a
    replay's own launch is spread over them)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    return timeit(graph.replay, device, min_reps=5, budget_s=budget_s) / 10


def make_inputs(B, G, V, dtype, warp, device, seed=0):
    """Made on the device itself: on a GPU machine, building the largest cases on its CPU (a top-p
    sort over 151936 logits for 512 rows) would take longer than timing them."""
    g = torch.Generator(device).manual_seed(seed)
    target = torch.randn(B, G + 1, V, generator=g, device=device) * 3
    draft = target[:, :G] + torch.randn(B, G, V, generator=g, device=device)
    temperature, min_p = torch.ones(B, device=device), torch.zeros(B, device=device)
    top_k = torch.full((B,), WARPS[warp]["top_k"], dtype=torch.int64, device=device)
    top_p = torch.full((B,), WARPS[warp]["top_p"], device=device)
    q = warp_probs(draft.reshape(B * G, V), *(t.repeat_interleave(G) for t in (temperature, top_k, top_p, min_p)))
    tokens = sample_from_probs(q, torch.rand(B * G, generator=g, device=device)).view(B, G)
    return (target.to(dtype), draft.to(dtype), tokens, torch.full((B,), G, device=device), temperature, top_k, top_p,
            min_p, torch.arange(B, device=device), torch.full((B,), 100, device=device))


def implementations(device):
    """name -> fn(inputs, filters) for this device."""
    if device.type != "cuda":
        return {"reference": lambda x, f: verify(*x, impl="reference"), "cpp": lambda x, f: verify(*x, impl="cpp")}
    from verify_rowwise import verify_triton as rowwise

    return {"reference": lambda x, f: verify(*x, impl="reference"),
            "triton": lambda x, f: verify(*x, impl="triton", filters=f),
            "triton-rowwise": lambda x, f: rowwise(*x, None, None, None, None)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a CPU-sized grid")
    parser.add_argument("--goals", action="store_true", help="only the cases the GPU goals name")
    parser.add_argument("--impls", nargs="+", help="implementations to time (default: all this device has)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budget", type=float, help="seconds of calls per timing (default 0.25 on a GPU, 1 on CPU)")
    parser.add_argument("--out", help="CSV path (default bench/results/verify-<device>-<date>.csv)")
    args = parser.parse_args()
    device = torch.device(args.device)
    impls = implementations(device)
    if args.impls:
        impls = {name: fn for name, fn in impls.items() if name in args.impls or name == "reference"}
    machine = machine_name(device)
    date = datetime.date.today().isoformat()
    bandwidth = copy_bandwidth(device)
    print(f"# {machine}; copy bandwidth {bandwidth / 1e9:.1f} GB/s; torch {torch.__version__}")
    out = Path(args.out or RESULTS / f"verify-{device.type}-{date}.csv")
    out.parent.mkdir(parents=True, exist_ok=True)
    budget_s = args.budget or (0.25 if device.type == "cuda" else 1.0)
    rows = []
    for B, G, V, dtype, warp in cases(args.quick, args.goals):
        inputs = make_inputs(B, G, V, dtype, warp, device)
        filters = warp != "T=1"
        logit_bytes = (inputs[0].numel() + inputs[1].numel()) * inputs[0].element_size()
        floor_s = logit_bytes / bandwidth
        times = {}
        for name, fn in impls.items():
            call = lambda: fn(inputs, filters)  # noqa: E731
            eager = timeit(call, device, budget_s=budget_s)
            graph = replayed(call, device, budget_s) if name == "triton" else None
            times[name] = (eager, graph)
        best = {name: min(s for s in pair if s is not None) for name, pair in times.items()}
        for name, (eager, graph) in times.items():
            rows.append(dict(machine=machine, date=date, torch=torch.__version__, device=device.type, impl=name,
                             dtype=str(dtype).removeprefix("torch."), warp=warp, B=B, G=G, V=V,
                             eager_us=round(eager * 1e6, 1), replayed_us=round(graph * 1e6, 1) if graph else "",
                             logit_bytes=logit_bytes, floor_us=round(floor_s * 1e6, 1),
                             ratio_to_floor=round(best[name] / floor_s, 2),
                             speedup_vs_reference=round(best["reference"] / best[name], 2)))
        shown = "  ".join(f"{name} {best[name] * 1e6:8.1f} us" for name in impls)
        print(f"B={B:3d} G={G} V={V:6d} {rows[-1]['dtype']:8s} {warp:9s}: {shown}  (floor {floor_s * 1e6:.1f} us)",
              flush=True)
        with out.open("w", newline="") as f:  # after every case: a run cut short keeps what it measured
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
