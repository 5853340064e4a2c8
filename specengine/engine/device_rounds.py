"""Rounds run from device state, with no read from the device in between (Engine(check_every=N)).

A host round reads its emitted tokens back (one synchronisation) because the next round's inputs
come from the host's sequences. Here each row's last two tokens, its length and the tokens it
emitted stay on the device: a whole round (the draft phase, the target's verification, the verify
kernel, which advances both caches' lengths, and the next round's inputs) is one fixed-shape call
per (batch bucket, gamma), captured as one CUDA graph on a GPU and replayed back to back, and the
tokens of all the block's rounds are read back once at the end. The host chooses the block so that every round in
it drafts exactly what a host round would (full budgets for every row), so the tokens are the
same as round by round; rows that stop inside a block (EOS, a stop string) are trimmed exactly
when the block is read (the rounds computed past their end are counted in their statistics).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling.batch import SamplingBatch, logits_valid
from ..sampling.logprobs import TokenLogprob
from ..steps.graphs import FixedShapeSteps
from ..steps.feed import to_device
from .verification import verify_round


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
    failure: str | None = None  # why the row keeps nothing of these rounds (its logits broke)
    logprobs: list[TokenLogprob] | None = None  # one per token, for a row that asks (SamplingParams.logprobs)


def rounds_that_fit(rooms: list[int], gamma: int) -> int:
    """How many rounds every row can run with a full budget of gamma drafts, for rows with `rooms`
    tokens left (the fewer of max_new_tokens - generated and capacity - length): a round emits at
    most gamma + 1 tokens and drafts gamma only while gamma + 1 tokens remain."""
    return max(0, min((room - 1 - gamma) // (gamma + 1) + 1 for room in rooms))


@torch.inference_mode()
def run_block(target_steps: FixedShapeSteps, drafter, sampling: SamplingBatch, sequences: list[list[int]], gamma: int,
              rounds: int, max_rounds: int, verify_impl: str, phases) -> list[RowRounds]:
    """`rounds` (<= max_rounds) rounds of gamma drafts for every row (sequences of at least two
    tokens, every one with room for them, see rounds_that_fit), with one read from the device at
    the end. Each round is one graphed call (see _round) over the batch's bucket: on a GPU one
    graph replay, with nothing between replays on the host."""
    device, B, G = target_steps.model.device, len(sequences), gamma
    bucket, capacity = target_steps.bucket(B), target_steps.cache.capacity
    if rounds > max_rounds:
        raise ValueError(f"a block of {rounds} rounds needs max_rounds >= {rounds}")
    key = ("round", bucket, G, sampling.filters, verify_impl)
    layout = _Layout(G, max_rounds)
    buffers = target_steps.graphs.buffers(key, lambda: dict(
        state=torch.zeros(bucket, layout.columns, dtype=torch.int64, device=device),
        temperature=torch.zeros(bucket, device=device), top_k=torch.zeros(bucket, dtype=torch.int64, device=device),
        top_p=torch.ones(bucket, device=device), min_p=torch.zeros(bucket, device=device),
        seeds=torch.zeros(bucket, dtype=torch.int64, device=device)))
    # The block's inputs in one copy: each row's last two tokens and length, its output, count and
    # histogram zeroed, its logit checks passed so far; padding rows at the spill slot.
    state = [[*s[-2:], len(s)] + [0] * (layout.columns - 5) + [1, 1] for s in sequences]
    state += [[0, 0, capacity] + [0] * (layout.columns - 5) + [1, 1]] * (bucket - B)
    buffers["state"].copy_(to_device(state, torch.int64, device))
    for name in ("temperature", "top_k", "top_p", "min_p", "seeds"):
        buffers[name][:B].copy_(getattr(sampling, name))
    round_fn = lambda **b: _round(target_steps, drafter, layout, sampling.filters, verify_impl, **b)  # noqa: E731
    # A round advances its own state and both caches' lengths: a capture's warm-ups are undone.
    lengths = (target_steps.cache.row_lengths(bucket),) + ((drafter.steps.cache.row_lengths(bucket),) if G > 0 else ())
    for _ in range(rounds):
        with phases("round"):
            target_steps.graphs.run(key, round_fn, state=lengths)

    # The block's one read from the device: on CUDA one copy into pinned memory, queued behind the
    # replays, and one wait for it.
    state = buffers["state"][:B]
    if device.type == "cuda":
        host = torch.empty(state.shape, dtype=state.dtype, pin_memory=True)
        host.copy_(state, non_blocking=True)
        torch.cuda.current_stream(device).synchronize()
        state = host
    rows = state.tolist()
    # A row whose logits broke keeps nothing of the block; the other rows are unaffected.
    failures = [next((f"{name} logits had NaN or infinite entries within a block of {rounds} rounds; nothing of "
                      "the block was kept" for i, name in enumerate(("draft", "target")) if not row[layout.finite + i]),
                     None) for row in rows]
    n_rows = [row[layout.count] for row in rows]
    if G > 0:
        drafter.resync([len(s) + n for s, n in zip(sequences, n_rows)])
    outcomes = []
    for row, n, failure in zip(rows, n_rows, failures):
        hist = row[layout.histogram:layout.histogram + G + 1]
        outcomes.append(RowRounds(tokens=row[layout.out:layout.out + n], rounds=rounds, draft_calls=rounds * G,
                                  drafted=rounds * G, accepted=sum(k * c for k, c in enumerate(hist)),
                                  rejections=rounds - hist[G], histogram=hist, failure=failure))
    return outcomes


@dataclass(frozen=True)
class _Layout:
    """Columns of a block's state [bucket, columns] int64, one row per batch row: its last two
    tokens, its length, every round's emitted tokens then a spill column, their count, the
    histogram of drafts accepted, and whether the draft's and the target's logits were finite."""
    G: int
    max_rounds: int

    @property
    def out(self) -> int:
        return 3

    @property
    def count(self) -> int:
        return self.out + self.max_rounds * (self.G + 1) + 1

    @property
    def histogram(self) -> int:
        return self.count + 1

    @property
    def finite(self) -> int:
        return self.histogram + self.G + 1

    @property
    def columns(self) -> int:
        return self.finite + 2


def _round(target_steps: FixedShapeSteps, drafter, layout: _Layout, filters: bool, verify_impl: str, state, temperature,
           top_k, top_p, min_p, seeds) -> tuple:
    """One round of the whole bucket from its state, written back into it: the draft phase, the
    target's verification, the verify kernel (which advances both caches' lengths), and the next
    round's last two tokens and lengths. Only device ops: a CUDA graph captures it whole."""
    G, capacity = layout.G, target_steps.cache.capacity
    last_two, lengths = state[:, 0:2], state[:, 2]
    out = state[:, layout.out:layout.count]
    n_out, histogram = state[:, layout.count], state[:, layout.histogram:layout.finite]
    finite = state[:, layout.finite:layout.columns]
    real = lengths < capacity  # padding rows sit at the spill slot
    bucket = real.shape[0]
    sampling = SamplingBatch(temperature, top_k, top_p, min_p, seeds, filters)
    if G > 0:
        drafts, draft_logits = drafter.draft_phase_in_round(last_two, lengths, real, sampling, G)
        finite[:, 0] *= logits_valid(draft_logits)
    else:
        drafts, draft_logits = last_two[:, :0], None
    (logits,) = target_steps.forward(torch.cat([last_two[:, 1:], drafts], dim=1),
                                     torch.where(real, lengths - 1, capacity))  # [bucket, G+1, V]
    finite[:, 1] *= logits_valid(logits)
    emitted, counts = verify_round(logits, draft_logits, drafts.contiguous(), torch.where(real, G, 0), sampling,
                                   lengths.contiguous(), target_lengths=target_steps.cache.row_lengths(bucket),
                                   draft_lengths=drafter.steps.cache.row_lengths(bucket) if G > 0 else None,
                                   impl=verify_impl)
    # Append the emitted tokens to each row's output (the rest of the row goes to the spill column).
    column = torch.arange(G + 1, device=real.device)
    kept = column < counts[:, None]
    out.scatter_(1, torch.where(kept, n_out[:, None] + column, out.shape[1] - 1), emitted)
    n_out += counts
    histogram.scatter_add_(1, (counts - 1)[:, None], torch.ones_like(counts)[:, None])
    # The new last two tokens: positions counts and counts + 1 of [last two, emitted].
    last_two.copy_(torch.cat([last_two, emitted.clamp(min=0)], dim=1).gather(1, torch.stack([counts, counts + 1], 1)))
    lengths.copy_(torch.where(real, lengths + counts, capacity))
    return ()
