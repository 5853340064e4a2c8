"""What the engine asks of a drafter."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..sampling.batch import SamplingBatch

if TYPE_CHECKING:  # annotations only
    from ..layers.kv_cache import StaticKVCache
    from ..steps.graphs import FixedShapeSteps
    from ..models.loader import Model


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
    """Everything the engine asks of a drafter. Drafters subclass it: the members with a body
    are the defaults of a drafter without a model of its own (the n-gram drafter's)."""

    model: "Model | None" = None          # the draft model (None: a model-free drafter)
    steps: "FixedShapeSteps | None" = None     # its fixed-shape steps, after use_static_steps

    def add_rows(self, prompts: list[list[int]], capacity: int, prefill: bool = True,
                 sources: list[list[int]] | None = None) -> None:
        """Append a row per prompt after the rows in flight (requests that joined the batch), for
        contexts of at most `capacity` tokens. prefill=False: leave the prompts to the rows' first
        proposal (gamma="auto" may never draft for a request). sources: with an encoder-decoder
        target, each row's encoder input (the prompts are then the decoder's start); a drafter
        reads it as it needs (a draft model encodes it, the n-gram drafter copies from it)."""
        ...

    def staged_cache(self, capacity: int) -> "StaticKVCache | None":
        """The draft model's cache, where the engine stages and prefills the rows of joining requests
        (a chunk a step, the target's chunks; from the prefix cache) before they join (join_rows),
        made on first use for contexts of `capacity` tokens. None (the default): the drafter has no
        such cache, and prefills what it needs itself when rows join."""
        return None

    def join_rows(self, prompts: list[list[int]], capacity: int, sources: list[list[int]] | None = None) -> None:
        """Requests whose prefill is done join the rows in flight, after them. With a staged_cache,
        their staged rows there already became rows in use, holding all but each prompt's last token
        (and the encoder input's entries, with sources). Default: add_rows, prefilling them."""
        self.add_rows(prompts, capacity, True, sources)

    def reserve(self, capacity: int) -> None:
        """Room for contexts of `capacity` tokens in every row (the target's cache grew)."""

    def propose(self, sequences: list[list[int]], budgets: list[int], sampling: SamplingBatch) -> Proposal:
        """Up to budgets[b] draft tokens to follow sequences[b] (max(budgets) >= 1)."""
        ...

    @property
    def cache_lengths(self) -> torch.Tensor | None:
        """[B] int64 lengths of the drafter's own KV cache (None without one). Verification sets
        them to min(themselves, the target's new length): drafts past a rejection are forgotten."""
        return None

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only these rows (in this order); the others' requests have left."""
        ...

    # ---- fixed-shape steps and rounds run from device state (steps.graphs, engine.device_rounds)

    def use_static_steps(self, max_batch_size: int, capacity: int) -> None:
        """Run on a persistent cache of max_batch_size rows through fixed-shape steps (CUDA graphs
        on a GPU). A drafter without a model has nothing to run there."""

    def runs_in_device_rounds(self, sequences: list[list[int]]) -> bool:
        """Whether the next rounds over these sequences may run from device state: the drafter's
        whole draft phase is then device ops (draft_phase_in_round)."""
        return False

    def draft_phase_in_round(self, last_two: torch.Tensor, lengths: torch.Tensor, real: torch.Tensor,
                             sampling: SamplingBatch, G: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft phase of a round run from device state (see ModelDrafter)."""
        raise NotImplementedError(f"{type(self).__name__} does not draft in rounds run from device state")

    def cache_row_lengths(self, rows: int) -> torch.Tensor:
        """[rows] int64, the lengths of the first `rows` rows of the persistent cache (a view)."""
        raise NotImplementedError(f"{type(self).__name__} has no persistent cache")

    def resync(self, lengths: list[int]) -> None:
        """After rounds run from device state: the rows now hold sequences of these lengths."""
