"""What the engine asks of a drafter."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..sampling.batch import SamplingBatch


@dataclass
class Proposal:
    tokens: torch.Tensor               # [B, G] int64, row b valid in [:num_drafts[b]]
    num_drafts: torch.Tensor           # [B] int64 in [0, G]
    logits: torch.Tensor | None        # [B, G, V] float32, what the drafts were sampled from; None: one-hot
    draft_calls: int                   # draft-model forward passes spent on this proposal

    def __post_init__(self):
        B, G = self.tokens.shape
        if self.num_drafts.shape != (B,):
            raise ValueError(f"num_drafts must be [{B}], got {tuple(self.num_drafts.shape)}")
        if self.logits is not None and tuple(self.logits.shape[:2]) != (B, G):
            raise ValueError(f"draft logits must be [{B}, {G}, V], got {tuple(self.logits.shape)}")


class Drafter(Protocol):
    def add_rows(self, prompts: list[list[int]], capacity: int, prefill: bool = True,
                 sources: list[list[int]] | None = None) -> None:
        """Append a row per prompt after the rows in flight (requests that joined the batch), for
        contexts of at most `capacity` tokens. prefill=False: leave the prompts to the rows' first
        proposal (gamma="auto" may never draft for a request). sources: with an encoder-decoder
        target, each row's encoder input (the prompts are then the decoder's start); a drafter
        reads it as it needs (a draft model encodes it, the n-gram drafter copies from it)."""

    def reserve(self, capacity: int) -> None:
        """Room for contexts of `capacity` tokens in every row (the target's cache grew)."""

    def propose(self, sequences: list[list[int]], budgets: list[int], sampling: SamplingBatch) -> Proposal:
        """Up to budgets[b] draft tokens to follow sequences[b] (max(budgets) >= 1)."""

    @property
    def cache_lengths(self) -> torch.Tensor | None:
        """[B] int64 lengths of the drafter's own KV cache (None without one). Verification sets
        them to min(themselves, the target's new length): drafts past a rejection are forgotten."""

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only these rows (in this order); the others' requests have left."""
