"""The phases of a round, marked for Nsight Systems (NVTX ranges) and/or timed (both off by default)."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class Phases:
    """`with phases("draft"): ...` marks and/or times one phase.

    nvtx: push/pop an NVTX range of that name when CUDA is present.
    timed: add the phase's wall-clock seconds to `seconds[name]`. On CUDA this synchronises at
    both ends (the only way to charge GPU work to its phase), so it slows the loop a little
    there; on CPU the work is synchronous and timing costs nothing measurable.
    """

    def __init__(self, nvtx: bool = False, timed: bool = False):
        self.nvtx = nvtx
        self.timed = timed
        self.seconds: dict[str, float] = defaultdict(float)

    def reset(self):
        self.seconds = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        cuda = torch.cuda.is_available()
        if self.nvtx and cuda:
            torch.cuda.nvtx.range_push(name)
        if self.timed:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
        try:
            yield
        finally:
            if self.timed:
                if cuda:
                    torch.cuda.synchronize()
                self.seconds[name] += time.perf_counter() - start
            if self.nvtx and cuda:
                torch.cuda.nvtx.range_pop()
