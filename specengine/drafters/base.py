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
    are the defaults of a drafter without a model of its own (the n-gram drafter's).

    Rows are the requests in flight, in the order of the target's cache rows. A request joins
    (join_rows) once its prompt is prefilled and leaves by keep_rows. A drafter whose cache holds
    the target's positions (a draft model sharing the target's tokenizer) hands the engine that
    cache (staged_cache): the engine then stages and prefills its rows as it does the target's,
    grows it with the target's, and verification clips its lengths to the target's (drafts past a
    rejection are forgotten)."""

    model: "Model | None" = None          # the draft model (None: a model-free drafter)
    steps: "FixedShapeSteps | None" = None     # its fixed-shape steps, after use_static_steps
    # The target layers whose input states this drafter reads (a feature drafter: drafters.eagle3).
    # The engine reads it once and has the target capture them in every forward (prefill chunks,
    # verification), handing each forward's over with take_features. (): reads none.
    feature_layers: tuple[int, ...] = ()

    def staged_cache(self, capacity: int) -> "StaticKVCache | None":
        """The draft model's cache of contexts of `capacity` tokens (made on first use), whose
        staged rows the engine prefills with the target's chunks (or from the prefix cache) before
        the requests join. None (the default): the drafter keeps what it needs itself."""
        return None

    def join_rows(self, prompts: list[list[int]], capacity: int, sources: list[list[int]] | None = None) -> None:
        """Requests whose prefill is done join, after the rows in flight: their prompts (each the
        start of its sequence), for contexts of `capacity` tokens. With a staged_cache, their rows
        there already hold all but each prompt's last token (and the encoder input's entries).
        sources: with an encoder-decoder target, each row's encoder input (the prompts are then the
        decoder's start); a drafter reads it as it needs (the n-gram drafter copies from it)."""
        ...

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only these rows (in this order); the others' requests have left."""
        ...

    def take_features(self, rows: list[int], starts: list[int], features: torch.Tensor, counts: list[int]) -> None:
        """With feature_layers: row rows[r] now has the target's features (LlamaForCausalLM.capture_features)
        of positions starts[r] .. starts[r] + counts[r] - 1, in features[r, :counts[r]] ([R, T, F]
        float32): a prefilled prompt's (right after join_rows) and, after each host round, those of the
        tokens verification kept. Positions come in order, each once."""

    def propose(self, sequences: list[list[int]], budgets: list[int], sampling: SamplingBatch) -> Proposal:
        """Up to budgets[b] draft tokens to follow sequences[b] (max(budgets) >= 1)."""
        ...

    # ---- fixed-shape steps and rounds run from device state (steps.graphs, engine.rounds)

    def use_static_steps(self, max_batch_size: int, capacity: int) -> None:
        """Run on a persistent cache of max_batch_size rows through fixed-shape steps (CUDA graphs
        on a GPU): steps.cache becomes the draft model's cache (the staged_cache of a drafter that
        has one). A drafter without a model has nothing to run there."""

    def runs_in_device_rounds(self, sequences: list[list[int]], gamma: int) -> bool:
        """Whether the next rounds over these sequences, gamma drafts each, may run from device
        state: the drafter's whole draft phase is then device ops (draft_phase_in_round)."""
        return False

    def device_round_state(self, sequences: list[list[int]], bucket: int, gamma: int) -> tuple[torch.Tensor, ...]:
        """Before a block of rounds from device state over these sequences (a bucket of `bucket`
        rows, gamma drafts a round): the device tensors the block's draft phases read and write,
        filled from the host's state. The rounds update them in place (a graph capture's warm-up
        runs are undone on them)."""
        raise NotImplementedError(f"{type(self).__name__} does not draft in rounds run from device state")

    def draft_phase_in_round(self, last_two: torch.Tensor, lengths: torch.Tensor, real: torch.Tensor,
                             sampling: SamplingBatch, G: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft phase of a round run from device state (see ModelDrafter)."""
        raise NotImplementedError(f"{type(self).__name__} does not draft in rounds run from device state")

    def take_features_in_round(self, features: torch.Tensor, emitted: torch.Tensor, counts: torch.Tensor,
                               lengths: torch.Tensor, real: torch.Tensor) -> None:
        """With feature_layers, inside a round run from device state, after its verification: the
        verification forward's features [bucket, G+1, F] float32, the tokens emitted [bucket, G+1]
        int64 (-1 past counts [bucket]), the rows' lengths before the round [bucket] int64 and which
        rows are real [bucket] bool; device ops only (see drafters.eagle3)."""
        raise NotImplementedError(f"{type(self).__name__} reads no features in rounds run from device state")

    def verified(self, starts: list[int], gamma: int, lengths: list[int]) -> None:
        """After a read of rounds that checked this drafter's drafts (a host round, or a block run
        from device state): the last of them drafted up to gamma tokens a row from sequences of
        starts[b] tokens, and the rows now hold sequences of lengths[b] (verification clipped a
        draft model's staged cache to the target's)."""
