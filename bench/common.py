"""What the benchmark scripts share: the results folder, synchronisation, timing, the device's
copy bandwidth (the memory floors' yardstick), the JSON writer (the machine's name is
specengine.devtools.benchmark.machine_name)."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def sync(device: torch.device):
    """Wait for the device's queued work (timings on a GPU would otherwise measure launches)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Short chat requests of several kinds (code, explanation, lists, prose), for end-to-end runs that
# compare engines on the same requests one at a time.
CHAT_REQUESTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in two sentences what a hash table is.",
    "List three uses of the command `grep`.",
    "What is the difference between a list and a tuple in Python?",
    "Give a short recipe for pancakes.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "Write a haiku about autumn rain.",
    "How do I reverse a linked list? Answer with code.",
]


def write_json(result: dict, out: str | None, default_name: str):
    """Write a benchmark's results to `out`, or to bench/results/<default_name>."""
    path = Path(out) if out else RESULTS / default_name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


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
