"""What the benchmark scripts share: the results folder, synchronisation, the JSON writer
(the machine's name is specengine.benchmark.machine_name)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def sync(device: torch.device):
    """Wait for the device's queued work (timings on a GPU would otherwise measure launches)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_json(result: dict, out: str | None, default_name: str):
    """Write a benchmark's results to `out`, or to bench/results/<default_name>."""
    path = Path(out) if out else RESULTS / default_name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
