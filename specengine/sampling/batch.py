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


def logits_valid(logits: torch.Tensor) -> torch.Tensor | bool:
    """Whether check_logits would pass: no NaN, no +inf, a finite entry in every row. -inf
    entries are fine (a draft whose head scores only some ids has them on every other id, every
    round). One reduction: every row's largest entry is finite exactly then (a NaN propagates
    through max). On CUDA a 0-dim bool tensor, computed without a synchronisation: read it
    later. On a CPU the work is done when this returns, so it is a bool. When it is False, run
    check_logits: it names the problem."""
    if logits.numel() == 0:
        return True
    lowest, highest = torch.aminmax(logits.amax(-1))
    if logits.device.type == "cpu":
        return math.isfinite(lowest) and math.isfinite(highest)
    return torch.isfinite(lowest) & torch.isfinite(highest)


def check_logits(name: str, logits: torch.Tensor):
    """Logits [..., V]: no NaN, no +inf, at least one finite entry per row."""
    if logits_valid(logits):
        return
    if torch.isnan(logits).any():
        raise InvalidLogitsError(f"{name} logits contain NaN (a numerically broken model or checkpoint?)")
    if torch.isposinf(logits).any():
        raise InvalidLogitsError(f"{name} logits contain +inf")
    if logits.numel() and not torch.isfinite(logits).any(-1).all():
        raise InvalidLogitsError(f"{name} logits are -inf for every token of some row")


def rows_valid(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, T, V]: [B] bool, whether check_logits would pass on each row (the reduction of
    logits_valid, kept per row: a row's logits never depend on another's). Device ops only, no
    synchronisation."""
    return torch.isfinite(logits.amax(-1)).all(-1)


def row_problems(name: str, logits: torch.Tensor) -> dict[int, str]:
    """Logits [B, T, V] that failed logits_valid: what check_logits says of each broken row, by row."""
    broken = ~rows_valid(logits)
    problems = {}
    for row in broken.nonzero().flatten().tolist():
        try:
            check_logits(name, logits[row])
        except InvalidLogitsError as exc:
            problems[row] = str(exc)
    return problems
