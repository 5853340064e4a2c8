"""Log-probabilities of tokens under the distribution their position is sampled from (the target's
logits after a request's warps, warp.warp_logprobs), and the most probable tokens there."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .params import SamplingParams
from .warp import warp_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability at its position, and the position's most probable tokens."""
    token_id: int
    logprob: float                       # -inf where the request's warps drop the token
    top: tuple[tuple[int, float], ...]   # (token_id, logprob) of the k most probable, most probable first

    def __post_init__(self):
        if not isinstance(self.token_id, int) or self.token_id < 0:
            raise ValueError(f"token_id must be an integer >= 0, got {self.token_id!r}")
        if self.logprob > 0:
            raise ValueError(f"a log-probability is <= 0, got {self.logprob}")


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor, tops: list[int]) -> list[TokenLogprob]:
    """One TokenLogprob per position: tokens[n]'s log-probability under the warped distribution of
    logits[n], and the tops[n] most probable tokens there.

    logits [N, V] float; tokens [N] int64; temperature, top_p, min_p [N] float32; top_k [N] int64
    (each position's request's warps); tops N ints in [0, MAX_LOGPROBS]. One read from the device.

    Alternatives are ranked by logit: every warp keeps the order of the logits, and this ranks the
    tokens a filter drops (-inf all) too, deterministically.
    """
    logprobs = warp_logprobs(logits, temperature, top_k, top_p, min_p)  # [N, V]
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
    k = min(max(tops), logits.shape[-1])
    if k > 0:
        top_ids = logits.topk(k, dim=-1).indices  # [N, k]
        top_values = logprobs.gather(-1, top_ids)
        ids, values = top_ids.tolist(), top_values.tolist()
    else:
        ids = values = [[] for _ in tops]
    return [TokenLogprob(token, logprob, tuple(zip(i[:n], v[:n])))
            for token, logprob, i, v, n in zip(tokens.tolist(), chosen.tolist(), ids, values, tops)]


def request_logprobs(logits: torch.Tensor, tokens: list[int], params: SamplingParams, top: int) -> list[TokenLogprob]:
    """token_logprobs for positions of one request: logits [N, V] float, tokens N ids, `top`
    alternatives each, under params' warps."""
    device, N = logits.device, len(tokens)
    warps = (torch.full((N,), float(params.temperature), device=device),
             torch.full((N,), params.top_k, dtype=torch.int64, device=device),
             torch.full((N,), float(params.top_p), device=device),
             torch.full((N,), float(params.min_p), device=device))
    return token_logprobs(logits, torch.tensor(tokens, dtype=torch.int64, device=device), *warps, [top] * N)
