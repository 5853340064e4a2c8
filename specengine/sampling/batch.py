"""Sampling parameters of a batch of rows as tensors, and the checks every verify input gets."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .params import SamplingParams


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor        # [B] int64
    top_p: torch.Tensor        # [B] float32
    min_p: torch.Tensor        # [B] float32
    seeds: torch.Tensor        # [B] int64
    # Whether a row may use top-k, top-p or min-p. Known on the host when the batch is built from
    # parameters; True (the safe answer) for tensors filled elsewhere, e.g. a CUDA graph's buffers.
    filters: bool = True

    @classmethod
    def from_params(cls, params: list[SamplingParams], seeds: list[int], device) -> "SamplingBatch":
        def col(name, dtype):
            return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)
        filters = any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0) for p in params)
        return cls(col("temperature", torch.float32), col("top_k", torch.int64), col("top_p", torch.float32),
                   col("min_p", torch.float32), torch.tensor(seeds, dtype=torch.int64, device=device), filters)

    def select(self, rows: list[int]) -> "SamplingBatch":
        index = torch.tensor(rows, dtype=torch.int64, device=self.seeds.device)
        return SamplingBatch(*(t[index] for t in (self.temperature, self.top_k, self.top_p, self.min_p, self.seeds)),
                             self.filters)


class InvalidLogitsError(ValueError):
    """A model produced NaN or +inf logits, or masked every token of a row."""


def logits_all_finite(logits: torch.Tensor) -> torch.Tensor | bool:
    """Whether every entry is finite (a finite sum). On CUDA a 0-dim bool tensor, computed
    without a synchronisation: read it later. On a CPU the work is done when this returns, so
    it is a bool (a torch call on the 0-dim sum cost ~15 us a round there). When it is False,
    run check_logits: it names the problem, or passes when only the sum overflowed."""
    total = logits.sum()
    return math.isfinite(total) if logits.device.type == "cpu" else torch.isfinite(total)


def check_logits(name: str, logits: torch.Tensor):
    """Logits [..., V]: no NaN, no +inf, at least one finite entry per row."""
    # The common case in one reduction: a finite sum means every entry is finite (a NaN or an
    # infinity makes it non-finite; so can overflow, which takes the full checks below).
    if logits.numel() and math.isfinite(logits.sum()):
        return
    if torch.isnan(logits).any():
        raise InvalidLogitsError(f"{name} logits contain NaN (a numerically broken model or checkpoint?)")
    if torch.isposinf(logits).any():
        raise InvalidLogitsError(f"{name} logits contain +inf")
    if logits.numel() and not torch.isfinite(logits).any(-1).all():
        raise InvalidLogitsError(f"{name} logits are -inf for every token of some row")
