"""What the benchmark scripts share: the results folder, synchronisation, timing, the device's
copy bandwidth (the memory floors' yardstick), the JSON writer (the machine's name is
specengine.devtools.benchmark.machine_name), and engines taking turns at timed passes over the
same requests."""
from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from specengine.engine.costs import cpu_name  # noqa: F401 (the benchmarks' record of the machine)

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


def timed_pass(engine, prompts, params) -> tuple[float, list[list[int]], float | None]:
    """(tokens per second, outputs, acceptance rate) of an Engine's pass over the prompts, one at a time."""
    start, tokens, outputs, accepted, tested = time.perf_counter(), 0, [], 0, 0
    for prompt in prompts:
        (result,) = engine.generate([prompt], params)
        tokens += len(result.token_ids)
        outputs.append(result.token_ids)
        accepted += result.stats.accepted
        tested += result.stats.accepted + result.stats.rejections
    return tokens / (time.perf_counter() - start), outputs, (accepted / tested if tested else None)


def alpha_note(alpha: float | None) -> str:
    return f"  alpha {alpha:.2f}" if alpha is not None else ""


class Turns:
    """Engines taking turns at timed passes over sets of prompts: each pass's tokens per second and
    (for an engine that drafts) acceptance rate, by key, and whether every pass over a set gave the
    greedy output of the first pass over it."""

    def __init__(self, key_width: int):
        self.key_width = key_width  # of a key in the printed lines
        self.rates: dict[str, list[float]] = {}
        self.alphas: dict[str, list[float]] = {}
        self.first_outputs: dict[str, list[list[int]]] = {}  # by prompt set: its first pass's outputs
        self.same = True

    @staticmethod
    def order(names: Iterable, repeat: int) -> list:
        """The names in this repeat's order: reversed every other repeat, so that no engine is always
        the first (or the last) to run."""
        return list(names)[::1 if repeat % 2 == 0 else -1]

    def timed_pass(self, repeat: int, key: str, engine, prompts, params, prompt_set: str = ""):
        """Time the engine's pass over the prompts (those of prompt_set) under key, and print it."""
        rate, outputs, alpha = timed_pass(engine, prompts, params)
        self.rates.setdefault(key, []).append(rate)
        if alpha is not None:
            self.alphas.setdefault(key, []).append(alpha)
        self.same &= outputs == self.first_outputs.setdefault(prompt_set, outputs)
        print(f"repeat {repeat} {key:{self.key_width}s} {rate:6.1f} tok/s" + alpha_note(alpha), flush=True)

    def summary(self, baseline_of: Callable[[str], str] | None = None) -> dict:
        """Medians over the repeats by key: tok_s; with baseline_of, the speedup over the key it names
        (and a line a key printed); every pass's tok/s (runs); alpha."""
        medians = {k: statistics.median(v) for k, v in self.rates.items()}
        alpha = {k: statistics.median(v) for k, v in self.alphas.items()}
        if baseline_of is None:
            return dict(tok_s=medians, runs=self.rates, alpha=alpha)
        speedup = {k: v / medians[baseline_of(k)] for k, v in medians.items()}
        for key, rate in medians.items():
            print(f"{key:{self.key_width}s} {rate:6.1f} tok/s  {speedup[key]:4.2f}x" + alpha_note(alpha.get(key)))
        return dict(tok_s=medians, speedup=speedup, runs=self.rates, alpha=alpha)
