"""Logit warps and inverse-CDF sampling: the definitions every implementation follows.

Warps apply in this order, to the target's and the draft's logits alike:
  temperature T   logits / T; T == 0 is greedy: the one-hot of the first argmax.
  top_k  k        keep tokens whose logit is >= the k-th largest (ties kept); 0: off.
  top_p  P        keep token x iff the mass of tokens strictly more probable than x is < P
                  (the smallest nucleus reaching P, ties kept; never empty); 1: off.
  min_p  m        keep x iff prob(x) >= m * max prob; 0: off.
Each filter renormalises what it keeps. All definitions are thresholds, so a kernel can
apply them without sorting and agree with this code exactly.
"""
from __future__ import annotations

import torch


def warp_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Probabilities [N, V] float32 after all warps.

    logits [N, V] float; temperature, top_p, min_p [N] float32; top_k [N] int64.
    """
    logits = logits.to(torch.float32)
    greedy = temperature == 0
    _, probs, _ = _filtered(logits, temperature, top_k, top_p, min_p)
    probs = probs / probs.sum(-1, keepdim=True)

    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def warp_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Log-probabilities [N, V] float32 of warp_probs's distribution, computed in log space (a
    token kept by the filters has a finite log-probability even where its probability underflows
    float32; one dropped has -inf). A greedy row (temperature 0) gets the unwarped log-softmax of
    its logits instead of the one-hot's 0 and -inf: what vLLM reports for greedy decoding.

    logits [N, V] float; temperature, top_p, min_p [N] float32; top_k [N] int64.
    """
    logits = logits.to(torch.float32)
    greedy = temperature == 0
    scaled, _, dropped = _filtered(logits, temperature, top_k, top_p, min_p)
    return scaled.masked_fill(dropped & ~greedy[:, None], float("-inf")).log_softmax(-1)


def _filtered(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The warps of non-greedy rows: the scaled logits [N, V] (shifted by the row max; greedy
    rows unscaled), their probabilities [N, V] with the filters' drops zeroed (unnormalised), and
    the drops [N, V] bool (a token the filters drop, not one whose probability underflowed).

    logits [N, V] float32; temperature, top_p, min_p [N] float32; top_k [N] int64.
    """
    N, V = logits.shape
    greedy = temperature == 0
    # Shift by the row max first: huge finite logits divided by a small temperature stay finite.
    shifted = logits - logits.amax(-1, keepdim=True)
    scaled = shifted / torch.where(greedy, 1.0, temperature)[:, None]
    dropped = scaled == float("-inf")

    use_top_k = (top_k > 0) & (top_k < V)
    if use_top_k.any():  # (the sorts are skipped when no row needs them: same result, less time)
        sorted_logits = scaled.sort(dim=-1, descending=True).values
        kth = sorted_logits.gather(-1, (torch.where(use_top_k, top_k, V) - 1)[:, None])
        dropped = dropped | (scaled < kth)
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)

    use_top_p = top_p < 1
    if use_top_p.any():
        # Mass strictly before each sorted entry; the nucleus is every entry whose mass before is
        # < top_p, and equal probabilities share the fate of their first (tie-inclusive).
        sorted_probs = probs.sort(dim=-1, descending=True).values
        mass_before = torch.cat([sorted_probs.new_zeros(N, 1), sorted_probs.cumsum(-1)[:, :-1]], dim=-1)
        kept = (mass_before < top_p[:, None]).sum(-1, keepdim=True).clamp(min=1)
        smallest_kept = sorted_probs.gather(-1, kept - 1)
        outside = use_top_p[:, None] & (probs < smallest_kept)
        dropped = dropped | outside
        probs = torch.where(outside, 0.0, probs)

    below_min_p = probs < min_p[:, None] * probs.amax(-1, keepdim=True)
    return scaled, torch.where(below_min_p, 0.0, probs), dropped | below_min_p


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample [N] int64 from unnormalised probs [N, V] (>= 0, positive sum) with u [N] in [0, 1).

    The token is the first index whose cumulative mass exceeds u * total; zero-mass tokens are
    never chosen (rounding at the top end falls back to the last token with mass).
    """
    cdf = probs.cumsum(-1)
    index = (cdf <= u[:, None] * cdf[:, -1:]).sum(-1)
    V = probs.shape[-1]
    last_positive = V - 1 - (probs > 0).flip(-1).to(torch.int64).argmax(-1)
    return torch.minimum(index, last_positive)
