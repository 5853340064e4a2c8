"""Rounds run from device state, with no read from the device in between (Engine(check_every=N)).

A host round reads its emitted tokens back (one synchronisation) because the next round's inputs
come from the host's sequences. Here each row's last two tokens, its length and the tokens it
emitted stay on the device: the next round's catch-up, verification inputs and positions are
built there, the fused verify kernel advances both caches' lengths, and the tokens of all the
block's rounds are read back once at the end. The host chooses the block so that every round in
it drafts exactly what a host round would (full budgets for every row), so the tokens are the
same as round by round; rows that stop inside a block (EOS, a stop string) are trimmed exactly
when the block is read (the rounds computed past their end are counted in their statistics).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.verify import verify
from ..sampling.batch import InvalidLogitsError, SamplingBatch, logits_all_finite
from .graphs import StepGraphs
from .runner import to_device


@dataclass
class RowRounds:
    """What one row got from one round or a block of rounds."""
    tokens: list[int]       # emitted, in order (before stop conditions are applied)
    rounds: int
    draft_calls: int        # draft-model forward passes
    drafted: int
    accepted: int
    rejections: int         # rounds that ended by rejecting a draft
    histogram: list[int]    # [G + 1]: rounds by drafts accepted


def rounds_that_fit(rooms: list[int], gamma: int) -> int:
    """How many rounds every row can run with a full budget of gamma drafts, for rows with `rooms`
    tokens left (the fewer of max_new_tokens - generated and capacity - length): a round emits at
    most gamma + 1 tokens and drafts gamma only while gamma + 1 tokens remain."""
    return max(0, min((room - 1 - gamma) // (gamma + 1) + 1 for room in rooms))


@torch.inference_mode()
def run_block(target_steps: StepGraphs, drafter, sampling: SamplingBatch, sequences: list[list[int]], gamma: int,
              rounds: int, verify_impl: str, phases) -> list[RowRounds]:
    """`rounds` rounds of gamma drafts for every row (sequences of at least two tokens, every one
    with room for them, see rounds_that_fit), with one read from the device at the end."""
    device, B, G = target_steps.model.device, len(sequences), gamma
    cache = target_steps.cache
    lengths = to_device([len(s) for s in sequences], torch.int64, device)       # [B]
    last_two = to_device([s[-2:] for s in sequences], torch.int64, device)      # [B, 2]
    out = torch.zeros(B, rounds * (G + 1) + 1, dtype=torch.int64, device=device)  # last column: spill
    n_out = torch.zeros(B, dtype=torch.int64, device=device)
    histogram = torch.zeros(B, G + 1, dtype=torch.int64, device=device)
    finite = {"draft": torch.ones((), dtype=torch.bool, device=device),
              "target": torch.ones((), dtype=torch.bool, device=device)}
    column = torch.arange(G + 1, device=device)
    num_drafts = torch.full((B,), G, dtype=torch.int64, device=device)
    for _ in range(rounds):
        with phases("draft"):
            if G > 0:
                drafts, draft_logits = drafter.propose_on_device(last_two, lengths, sampling, G)
                finite["draft"] &= logits_all_finite(draft_logits)
            else:
                drafts, draft_logits = torch.zeros(B, 0, dtype=torch.int64, device=device), None
        with phases("verify"):
            logits = target_steps(torch.cat([last_two[:, 1:], drafts], dim=1), lengths - 1)  # [B, G+1, V]
            finite["target"] &= logits_all_finite(logits)
        with phases("accept"):
            emitted, counts = verify(logits, draft_logits, drafts, num_drafts, sampling.temperature, sampling.top_k,
                                     sampling.top_p, sampling.min_p, sampling.seeds, lengths,
                                     target_lengths=cache.lengths,
                                     draft_lengths=drafter.cache_lengths if G > 0 else None, impl=verify_impl,
                                     filters=sampling.filters)
            # Append the emitted tokens to each row's output (the rest of the row goes to the spill column).
            kept = column < counts[:, None]
            out.scatter_(1, torch.where(kept, n_out[:, None] + column, out.shape[1] - 1), emitted)
            n_out += counts
            histogram.scatter_add_(1, (counts - 1)[:, None], torch.ones_like(counts)[:, None])
            # The new last two tokens: positions counts and counts + 1 of [last two, emitted].
            last_two = torch.cat([last_two, emitted.clamp(min=0)], dim=1).gather(
                1, torch.stack([counts, counts + 1], dim=1))
            lengths = lengths + counts

    # The block's one read from the device (on CUDA the first .tolist() waits for it).
    out_rows, n_rows, hist_rows = out.tolist(), n_out.tolist(), histogram.tolist()
    for name, ok in finite.items():  # before any token of the block is kept
        if not ok:
            raise InvalidLogitsError(f"{name} logits had NaN or infinite entries within a block of {rounds} "
                                     "rounds; nothing of the block was kept")
    if G > 0:
        drafter.resync([len(s) + n for s, n in zip(sequences, n_rows)])
    return [RowRounds(tokens=row[:n], rounds=rounds, draft_calls=rounds * G, drafted=rounds * G,
                      accepted=sum(k * c for k, c in enumerate(hist)), rejections=rounds - hist[G], histogram=hist)
            for row, n, hist in zip(out_rows, n_rows, hist_rows)]
