"""The decode step: kernels launched per decoder layer, and the replayed step against its weight-read floor.

    python bench/bench_step.py [--device cuda] [--batches 1 8] [--widened-layers 22] [--out step.json]
        [--models draft target widened] [--paths triton torch torch.compile]

Models: the shipped draft, the shipped target, and the shipped target widened to about 1B
parameters (models.widen), in bfloat16 on CUDA (float32 on a CPU). Paths:
  "triton"         the Triton step kernels (CUDA only: on a CPU they would run in the interpreter)
  "torch"          the torch ops the kernels replace (on a CPU, the model's own CPU path instead)
  "torch.compile"  the torch path's step under torch.compile(mode="reduce-overhead"), what a
                   gpt-fast user would pick (CUDA only; batch 1; after every other row, since
                   compiling takes the longest)
Per model, path and batch size:
  - launches per decoder layer: the CUDA kernels of one eager step (torch profiler), the step of the
    model cut to one layer subtracted, over the other layers; on a CPU, the torch ops the step
    dispatches (a proxy: there every op is a call, not a launch);
  - the step's median milliseconds at 64 cached tokens, replayed from a CUDA graph (steps.graphs;
    compiled on its own for torch.compile; eager on a CPU);
  - the bytes of its weights, this device's copy bandwidth, the floor (bytes / bandwidth) and the
    step's ratio to it.
Results are written after every row, so a run cut short keeps what it measured. Each model records
its triton_fallback_reason after the "triton" rows (None: the kernels ran); on CUDA a fallback ends
the run with exit status 1, since those rows then timed the torch path.
"""
from __future__ import annotations

import argparse
import datetime
import sys

import torch

from specengine.devtools.benchmark import machine_name
from specengine.devtools.host_ops import HostOps
from specengine.steps.graphs import FixedShapeSteps
from specengine.models.loader import load_model
from specengine.shipped import shipped_pair

from bench_costs import widened_target
from common import copy_bandwidth, sync, timeit, write_json

CACHED = 64


def step_inputs(model, batch: int):
    cache = model.new_cache(batch, 256)
    cache.lengths.fill_(CACHED)
    tokens = torch.zeros(batch, 1, dtype=torch.int64, device=model.device)
    return tokens, cache


def launches(model, batch: int) -> int:
    """CUDA kernels (a CPU: torch ops) of one eager step."""
    tokens, cache = step_inputs(model, batch)
    run = lambda: model.logits(model(tokens, cache.lengths.clone(), cache, kv_len=CACHED + 1))  # noqa: E731
    run()  # compile Triton kernels, warm caches
    if model.device.type != "cuda":
        counter = HostOps()
        with counter, counter.count():
            run()
        return counter.ops
    sync(model.device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        sync(model.device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset")))


def launches_per_layer(model, batch: int) -> float:
    layers = model.model.layers
    full = launches(model, batch)
    model.model.layers = layers[:1]
    try:
        one = launches(model, batch)
    finally:
        model.model.layers = layers
    return (full - one) / (len(layers) - 1)


def step_ms(model, batch: int, compiled: bool, reps: int = 50) -> float:
    """Median ms of a one-token step at CACHED positions: replayed (FixedShapeSteps), or compiled."""
    if compiled:
        tokens, cache = step_inputs(model, batch)
        start = cache.lengths.clone()
        fn = torch.compile(lambda t, s: model.logits(model(t, s, cache, kv_len=cache.capacity)), mode="reduce-overhead",
                           fullgraph=False)
        call = lambda: fn(tokens, start)  # noqa: E731
    else:
        steps = FixedShapeSteps(model, batch, 256)
        steps.new_batch(batch)
        tokens = torch.zeros(batch, 1, dtype=torch.int64, device=model.device)
        start = torch.full((batch,), CACHED, dtype=torch.int64, device=model.device)
        call = lambda: steps(tokens, start)  # noqa: E731
    for _ in range(5):  # the first ones capture a graph, or compile
        call()
    return 1e3 * timeit(call, model.device, min_reps=reps, budget_s=0.0)


@torch.inference_mode()  # as the engine runs: the kernels have no autograd, a step with gradients skips them
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--widened-layers", type=int, default=22, help="0 leaves the widened target out")
    parser.add_argument("--models", nargs="+", choices=("draft", "target", "widened"),
                        default=["draft", "target", "widened"])
    parser.add_argument("--paths", nargs="+", choices=("triton", "torch", "torch.compile"),
                        help="default: triton, torch and torch.compile on CUDA; torch on a CPU")
    parser.add_argument("--out", help="JSON path (default bench/results/step-<device>-<date>.json)")
    args = parser.parse_args()
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    target_dir, draft_dir = shipped_pair()
    bandwidth = copy_bandwidth(device)
    result = dict(machine=machine_name(device), date=datetime.date.today().isoformat(), torch=torch.__version__,
                  dtype=str(dtype).removeprefix("torch."), copy_bandwidth_gb_s=bandwidth / 1e9, models={})
    print(f"# {result['machine']}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; {result['dtype']}")
    models = {}
    if "draft" in args.models:
        models["shipped draft"] = lambda: load_model(draft_dir, device, dtype)
    if "target" in args.models:
        models["shipped target"] = lambda: load_model(target_dir, device, dtype)
    if args.widened_layers and "widened" in args.models:
        models["widened target"] = lambda: widened_target(load_model(target_dir, device, dtype), args.widened_layers)
    out_name = f"step-{device.type}-{result['date']}.json"
    save = lambda: write_json(result, args.out, out_name)  # noqa: E731
    paths = args.paths or (["triton", "torch", "torch.compile"] if on_cuda else ["torch"])
    loaded = {}
    # torch.compile last, at the first batch size only: compiling takes the longest.
    passes = [([p for p in paths if p != "torch.compile"], args.batches)]
    if "torch.compile" in paths:
        passes.append((["torch.compile"], args.batches[:1]))
    fell_back = []
    for paths, batches in passes:
        for name, make in models.items():
            model = loaded[name] = loaded.get(name) or make()
            fell_back += measure(model, name, paths, batches, bandwidth, result, save)
    if fell_back and on_cuda:
        print("the Triton step kernels fell back to the torch path for: " + ", ".join(fell_back))
        return 1
    return 0


def measure(model, name: str, paths: list[str], batches: list[int], bandwidth: float, result: dict, save) -> list[str]:
    """Rows of one model on the given paths; returns [name] if its Triton kernels fell back."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    floor_ms = 1e3 * weight_bytes / bandwidth
    rows = result["models"].setdefault(name, dict(layers=model.config.num_layers, weight_bytes=weight_bytes,
                                                  floor_ms=floor_ms, paths={}))
    for path in paths:
        # "torch" and "torch.compile" rows: the torch backend on CUDA, the default (C++) one on a CPU
        model.use_backend("triton" if path == "triton" else "torch" if model.device.type == "cuda" else None)
        entry = rows["paths"][path] = {}
        for batch in batches:
            try:
                per_layer = None if path == "torch.compile" else launches_per_layer(model, batch)
                ms = step_ms(model, batch, compiled=path == "torch.compile")
            except Exception as e:  # noqa: BLE001 (a path that fails is reported, the others still run)
                entry[str(batch)] = dict(error=f"{type(e).__name__}: {e}"[:500])
                print(f"{name:15s} {path:13s} batch {batch}: {entry[str(batch)]['error']}", flush=True)
                save()
                continue
            entry[str(batch)] = dict(launches_per_layer=per_layer, step_ms=ms, ratio_to_floor=ms / floor_ms)
            shown = "" if per_layer is None else f"{per_layer:5.1f} launches/layer, "
            print(f"{name:15s} {path:13s} batch {batch}: {shown}{ms:8.3f} ms/step "
                  f"({ms / floor_ms:.1f}x the {floor_ms:.3f} ms floor)", flush=True)
            if path == "triton":
                rows["triton_fallback_reason"] = model.triton_fallback_reason
            save()
        if path == "triton" and model.triton_fallback_reason:  # its rows then measured the torch path
            print(f"{name}: the Triton kernels fell back to the torch path: {model.triton_fallback_reason}")
            return [name]
    return []


if __name__ == "__main__":
    sys.exit(main())
