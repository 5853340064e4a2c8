"""Sampling parameters of a batch of rows as tensors, and the checks every verify input gets."""
from __future__ import annotations

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


def sampling_buffers(bucket: int, device) -> dict[str, torch.Tensor]:
    """Static buffers of a bucket's sampling parameters (SamplingBatch's fields, [bucket] each),
    for a captured call (padding rows hold whatever they held last: their results are never used)."""
    return dict(temperature=torch.zeros(bucket, device=device),
                top_k=torch.zeros(bucket, dtype=torch.int64, device=device),
                top_p=torch.ones(bucket, device=device), min_p=torch.zeros(bucket, device=device),
                seeds=torch.zeros(bucket, dtype=torch.int64, device=device))


def fill_sampling_buffers(buffers: dict[str, torch.Tensor], sampling: SamplingBatch):
    """Copy the rows' sampling parameters into the first rows of sampling_buffers'."""
    for name in ("temperature", "top_k", "top_p", "min_p", "seeds"):
        buffers[name][:len(getattr(sampling, name))].copy_(getattr(sampling, name))


class InvalidLogitsError(ValueError):
    """A model produced NaN or +inf logits, or masked every token of a row."""


def rows_valid(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, T, V]: [B] bool, whether each row's logits are valid: no NaN, no +inf, a finite
    entry at every position (-inf entries are fine: a draft whose head scores only some ids has
    them on every other id, every round). One reduction: a position's largest entry is finite
    exactly then (a NaN propagates through max), kept per row: a row's logits never depend on
    another's. Device ops only, no synchronisation."""
    return torch.isfinite(logits.amax(-1)).all(-1)
