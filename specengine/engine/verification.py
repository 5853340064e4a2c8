"""The one place a round's verification is called (host rounds and rounds run from device state
alike): Algorithm 1's accept / resample / bonus step over a batch, and the cache rollback it does."""
from __future__ import annotations

import torch

from ..ops.verify import verify
from ..sampling.batch import SamplingBatch


def verify_round(logits: torch.Tensor, draft_logits: torch.Tensor | None, drafts: torch.Tensor,
                 num_drafts: torch.Tensor, sampling: SamplingBatch, lengths: torch.Tensor,
                 target_lengths: torch.Tensor, draft_lengths: torch.Tensor | None,
                 impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, G+1, V] of the target on [last token, drafts]; draft_logits [B, G, V] (None:
    one-hot drafts); drafts [B, G] int64; num_drafts [B] int64; lengths [B] int64, each sequence's
    length (token i of the round lands at lengths + i: its uniforms' key); target_lengths [B] and
    draft_lengths [B] (None: no draft cache) int64, the caches' lengths, set by the call to what
    the sequences hold after it (the whole rollback). Returns emitted [B, G+1] int64 and
    num_emitted [B] int64 in [1, G+1]."""
    return verify(logits, draft_logits, drafts, num_drafts, sampling.temperature, sampling.top_k, sampling.top_p,
                  sampling.min_p, sampling.seeds, lengths, target_lengths=target_lengths,
                  draft_lengths=draft_lengths, impl=impl, filters=sampling.filters)
