"""Chi-square goodness of fit with a real p-value (torch.special.gammaincc, no SciPy), and the exact
distribution of short continuations that the statistical tests compare an engine's samples with."""
import itertools

import torch

from specengine import SamplingParams


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of observing `counts` (any shape) under `probs` (same shape, sums to 1).

    Cells with expected count below min_expected are pooled into one cell. A cell of
    probability 0 with a nonzero count gives p = 0 (an impossible outcome happened).
    """
    counts = counts.flatten().to(torch.float64)
    probs = probs.flatten().to(torch.float64)
    n = counts.sum()
    if (counts[probs == 0] > 0).any():
        return 0.0
    expected = probs * n
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    dof = obs.numel() - 1
    if dof < 1:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


# ---- the exact distribution of short continuations -------------------------------------------
# The exact-distribution tests (test_engine_sampling and the drafters' own) sample NEW tokens after
# PROMPT from tiny models of V tokens, V ** NEW continuations in all, and compare the counts with
# the target's probabilities, warped here in float64 from the definitions (sampling/warp.py's
# docstring), not by the engine's warp_probs: a bug there, shared by the engine's sampling and a
# reference built on it, would pass end to end.

V, NEW = 5, 3
PROMPT = [1, 2, 1]

CASES = {
    "T=1": SamplingParams(temperature=1.0),
    "T=0.7,top_k=3": SamplingParams(temperature=0.7, top_k=3),
    "top_p=0.8": SamplingParams(top_p=0.8),
    "min_p=0.2": SamplingParams(min_p=0.2),
}


def reference_warped_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [N, V] float64 after params' warps of logits [N, V], written from the
    definitions: temperature T divides; top_k keeps the tokens whose logit is >= the k-th largest;
    top_p keeps a token iff the mass of the tokens strictly more probable is < P; min_p keeps a
    token iff its probability is >= m times the largest; each renormalises what it keeps. Greedy
    (T = 0): the one-hot of the first argmax."""
    x = logits.detach().cpu().double()
    if params.temperature == 0:
        return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    x = x / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(-1)
    if params.top_p < 1:
        ascending = probs.sort(dim=-1).values
        at_most = ascending.cumsum(-1)  # at_most[i]: the mass of the tokens no more probable than ascending[i]
        last_equal = torch.searchsorted(ascending, probs, right=True) - 1
        more_probable = at_most[:, -1:] - at_most.gather(-1, last_equal)
        probs = torch.where(more_probable < params.top_p, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.min_p > 0:
        probs = torch.where(probs >= params.min_p * probs.amax(-1, keepdim=True), probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def exact_distribution(model, params: SamplingParams, prompt: list[int] = PROMPT, new: int = NEW) -> torch.Tensor:
    """P(x_1..x_new | prompt) [V ** new] float64 under the target's warped distribution, for every
    continuation (row-major: continuation i is i's digits in base V), from the model's own forward
    of every continuation and reference_warped_probs."""
    vocab = model.config.vocab_size
    conts = torch.tensor(list(itertools.product(range(vocab), repeat=new)))
    seqs = torch.cat([torch.tensor(prompt).expand(len(conts), -1), conts], 1)
    cache = model.new_cache(len(seqs), seqs.shape[1])
    with torch.no_grad():
        logits = model.logits(model(seqs, torch.zeros(len(seqs), dtype=torch.int64), cache))
    logits = logits[:, len(prompt) - 1: -1].reshape(-1, vocab)  # the logits that predict x_1..x_new
    probs = reference_warped_probs(logits, params).view(len(conts), new, vocab)
    return probs.gather(-1, conts[..., None]).squeeze(-1).prod(-1)


def continuation_counts(results, vocab: int = V, new: int = NEW) -> torch.Tensor:
    """How often each continuation (indexed as exact_distribution's) came out of these Results."""
    index = torch.tensor([sum(t * vocab ** (new - 1 - i) for i, t in enumerate(r.token_ids)) for r in results])
    return torch.bincount(index, minlength=vocab ** new)


def sample_counts(engine, params: SamplingParams, N: int, prompt: list[int] = PROMPT, new: int = NEW) -> torch.Tensor:
    """continuation_counts of N requests of prompt under params, seeded 0..N-1."""
    requests = [SamplingParams(max_new_tokens=new, temperature=params.temperature, top_k=params.top_k,
                               top_p=params.top_p, min_p=params.min_p, seed=s) for s in range(N)]
    return continuation_counts(engine.generate([prompt] * N, requests), engine.target.config.vocab_size, new)
