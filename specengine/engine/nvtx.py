"""NVTX ranges around the phases of a round, for Nsight Systems (off unless asked for)."""
from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def nvtx_range(name: str, enabled: bool):
    """Mark `name` on the CUDA timeline when enabled and CUDA is present; otherwise do nothing."""
    if not (enabled and torch.cuda.is_available()):
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()
