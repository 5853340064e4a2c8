"""Measuring the step costs that gamma="auto" decides from (engine/gamma.py holds the policy).

measure_costs times, on this machine and at one batch size, the target's call on 1..max_gamma+1
tokens and one draft step (with its sampling), and returns them as a gamma.CostModel. The engine
calls it once per measured batch size when it starts with gamma="auto"; benchmarks call it too.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..ops.verify import sample_warped
from .gamma import CostModel


def _seconds(call) -> float:
    """Wall-clock seconds of call(), its GPU work included."""
    t0 = time.perf_counter()
    call()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


@torch.inference_mode()
def measure_costs(target, draft, max_gamma: int, batch_size: int = 1, context: int = 64, reps: int = 7,
                  target_steps=None, draft_steps=None) -> CostModel:
    """Time the target on 1..max_gamma+1 tokens and one draft step for `batch_size` rows at `context`
    cached tokens (a draft of None costs nothing). A draft step is what a drafter pays per token:
    the forward, and warping and sampling its distribution (no small share of the forward on a CPU).
    target_steps, draft_steps: the engine's FixedShapeSteps when it runs fixed-shape steps; then their
    calls are timed (replayed CUDA graphs on a GPU), since that is what its rounds pay."""
    def step(model, tokens: int, steps=None, then=None):
        """A call of `model` on `tokens` new tokens per row (then `then` on its last logits)."""
        if steps is not None:
            cache = steps.new_batch(batch_size)
            cache.lengths.fill_(max(0, min(context, cache.capacity - tokens)))
            forward = lambda x: steps(x, cache.lengths)  # noqa: E731
        else:
            cache = model.new_cache(batch_size, context + tokens)
            cache.pretend_filled(context)
            forward = lambda x: model.logits(model(x, cache.lengths.clone(), cache, kv_len=context + tokens))  # noqa: E731
        x = torch.zeros(batch_size, tokens, dtype=torch.int64, device=model.device)

        def call():
            logits = forward(x)
            if then is not None:
                then(logits[:, -1])
        return call

    def sample(logits):
        rows, device = logits.shape[0], logits.device
        ones, zeros = torch.ones(rows, device=device), torch.zeros(rows, device=device)
        # temperature 1, no top-k / top-p / min-p: the softmax path every sampled row takes
        sample_warped(logits, ones, zeros.long(), ones, zeros, 0.5 * ones)

    target_calls = [step(target, k, target_steps) for k in range(1, max_gamma + 2)]
    draft_call = step(draft, 1, draft_steps, then=sample) if draft is not None else None
    calls = target_calls + ([draft_call] if draft_call else [])
    # Three warm-up rounds: a fresh process's first timings run slow (caches, allocations, lazy
    # initialisation), which would make drafting look cheap.
    for _ in range(3):
        for call in calls:
            call()
    # Interleaved, one of each call per round, median over the rounds: timed one after the other,
    # a slow stretch of the machine falls on one call's timings and skews its cost alone (and
    # gamma="auto" then chooses differently from one start-up to the next); interleaved, it spoils
    # a round or two, not the median of one cost.
    target_s: list[list[float]] = [[] for _ in target_calls]
    draft_s: list[float] = []
    for _ in range(reps):
        for call, seconds in zip(target_calls, target_s):
            seconds.append(_seconds(call))
        if draft_call is not None:
            # A round's draft steps run back to back. The first, right after a target call, also
            # reloads the draft's weights into the CPU's caches: a cost per drafting round, which
            # its learned overhead covers (GammaController.observe_round), not per step. So the
            # steps timed follow another (three a round: the draft step is short, and its timings
            # the noisiest).
            draft_call()
            draft_s += [_seconds(draft_call) for _ in range(3)]
    return CostModel(statistics.median(draft_s) if draft_s else 0.0,
                     tuple(statistics.median(seconds) for seconds in target_s))
