"""Gamma policies replayed on acceptance traces: gamma="auto"'s choices scored without timing noise.

On a 2-core VM, repeats of one configuration vary by several per cent, as much as what separates
gamma="auto" from the best fixed gamma, so a real run cannot tell whether auto chose well. A
replay can: a trace is one request's acceptance probability at each generated position (for a
model pair, `acceptance_along`: sum_x min(p(x), q(x)), paper Definition 3.1, from one forward of
each model over a sequence the target decoded; at temperature 0, whether their argmaxes agree).
A policy (a fixed gamma, or GammaController as the engine runs it) decodes the trace again round
by round: draft i of a round at position t is accepted with position t + i's probability, and the
round costs what CostModel.round_seconds says. At temperature 0 the replay is exact (accepted
drafts are the target's greedy tokens); at temperature 1 an accepted draft is a sample of
min(p, q), not of p, so a round's later positions are those of a target sample: close, not exact.
How closely replays matched real runs: bench/results/gamma-policy-2026-11-29-to-12-01.md.
"""
from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..engine.gamma import CostModel, GammaController
from ..sampling.warp import warp_probs


@torch.inference_mode()
def acceptance_along(target, draft, prompt: list[int], generated: list[int], temperature: float) -> list[float]:
    """Per generated position t: the probability that a draft of token t, from the same prefix, is accepted."""
    ids = torch.tensor([prompt + generated], device=target.device)
    start = len(prompt) - 1  # the logits at position start predict generated[0]

    def logits(model):
        hidden = model(ids, torch.zeros(1, dtype=torch.int64, device=ids.device), model.new_cache(1, ids.shape[1]),
                       kv_len=ids.shape[1])
        return model.logits(hidden)[0, start: start + len(generated)].float()
    p_logits, q_logits = logits(target), logits(draft)
    vocab = min(p_logits.shape[-1], q_logits.shape[-1])  # a widened draft's extra rows are never sampled
    n = len(generated)
    # The engine's warp (at temperature 0, one-hot argmaxes: min(p, q) sums to 1 where they agree)
    warps = (torch.full((n,), float(temperature)), torch.zeros(n, dtype=torch.int64), torch.ones(n), torch.zeros(n))
    p, q = (warp_probs(x[:, :vocab], *(w.to(x.device) for w in warps)) for x in (p_logits, q_logits))
    return torch.minimum(p, q).sum(-1).tolist()


@dataclass(frozen=True)
class ReplayResult:
    tokens_per_s: float      # simulated: tokens over the rounds' modelled seconds
    drafts_per_token: float

    def __post_init__(self):
        if self.tokens_per_s <= 0 or self.drafts_per_token < 0:
            raise ValueError(f"impossible replay result {self}")


def replay(traces: Sequence[Sequence[float]], costs: CostModel, policy: int | str, seed: int,
           overheads_s: tuple[float, float] = (0.0, 0.0)) -> ReplayResult:
    """The traces' requests decoded in turn at batch 1 by a fixed gamma, or by policy "auto" (a
    fresh GammaController, as one engine's). overheads_s: what a target-only round and a drafting
    round cost beyond their modelled steps (auto is given them as already learned)."""
    if policy != "auto" and not (isinstance(policy, int) and 0 <= policy <= costs.max_gamma):
        raise ValueError(f"policy must be a gamma in [0, {costs.max_gamma}] or 'auto', got {policy!r}")
    if not traces or any(not trace or min(trace) < 0 or max(trace) > 1 for trace in traces):
        raise ValueError("traces must be non-empty lists of acceptance probabilities in [0, 1]")
    rng = random.Random(seed)
    controller = None
    if policy == "auto":
        controller = GammaController(costs)
        controller.overhead_s = {(1, False): overheads_s[0], (1, True): overheads_s[1]}
    tokens = seconds = drafted = 0
    for trace in traces:
        estimate = controller.new_estimate() if controller else None
        position = accepted_total = rejected_total = 0
        while position < len(trace):
            gamma = controller.choose([estimate]) if controller else policy
            drafts = min(gamma, len(trace) - position - 1)  # as the engine: never past max_new_tokens
            accepted = 0
            while accepted < drafts and rng.random() < trace[position + accepted]:
                accepted += 1
            rejected = int(accepted < drafts)
            position += accepted + 1  # the accepted drafts and the resampled (or bonus) token
            drafted += drafts
            seconds += costs.round_seconds(gamma, overheads_s[gamma > 0])
            if controller:
                estimate.update(accepted, rejected)
                accepted_total, rejected_total = accepted_total + accepted, rejected_total + rejected
        tokens += position
        if controller:
            controller.observe_finished(estimate, accepted_total, rejected_total)
    return ReplayResult(tokens / seconds, drafted / tokens)


def replay_mean(traces, costs: CostModel, policy: int | str, seeds: int,
                overheads_s: tuple[float, float] = (0.0, 0.0)) -> ReplayResult:
    """replay averaged over seeds 0..seeds-1."""
    runs = [replay(traces, costs, policy, seed, overheads_s) for seed in range(seeds)]
    return ReplayResult(statistics.mean(r.tokens_per_s for r in runs), statistics.mean(r.drafts_per_token for r in runs))
