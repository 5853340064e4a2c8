"""Inputs for verify-step tests and a naive, one-row-at-a-time Algorithm 1 (with optional bugs)."""
from dataclasses import dataclass

import torch

from specengine.sampling.warp import sample_from_probs, warp_probs


@dataclass
class VerifyCase:
    target_logits: torch.Tensor  # [B, G+1, V]
    draft_logits: torch.Tensor | None  # [B, G, V]
    draft_tokens: torch.Tensor  # [B, G]
    num_drafts: torch.Tensor  # [B]
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    u_accept: torch.Tensor  # [B, G+1]
    u_sample: torch.Tensor  # [B, G+1]

    def args(self):
        return (self.target_logits, self.draft_logits, self.draft_tokens, self.num_drafts, self.temperature,
                self.top_k, self.top_p, self.min_p, self.u_accept, self.u_sample)


def random_case(B, G, V, seed=0, one_hot=False, dtype=torch.float32, ragged=True, params="mixed") -> VerifyCase:
    """Draft logits close to the target's (so drafts are often accepted), drafts sampled from q."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(B, G + 1, V, generator=g) * 2
    target[torch.rand(B, G + 1, V, generator=g) < 0.05] = float("-inf")
    target[..., 0] = target[..., 0].clamp(min=-10.0)  # every row keeps a finite logit
    draft = target[:, :G] + torch.randn(B, G, V, generator=g) * 0.5
    if params == "mixed":
        temperature = torch.tensor([[0.0, 1.0, 0.7, 1.3][b % 4] for b in range(B)])
        top_k = torch.tensor([[0, 0, 5, 0][b % 4] for b in range(B)])
        top_p = torch.tensor([[1.0, 1.0, 1.0, 0.9][b % 4] for b in range(B)])
        min_p = torch.tensor([[0.0, 0.05, 0.0, 0.0][b % 4] for b in range(B)])
    else:
        temperature, top_k = torch.ones(B), torch.zeros(B, dtype=torch.int64)
        top_p, min_p = torch.ones(B), torch.zeros(B)
    q = warp_probs(draft.reshape(B * G, V), temperature.repeat_interleave(G), top_k.repeat_interleave(G),
                   top_p.repeat_interleave(G), min_p.repeat_interleave(G))
    tokens = sample_from_probs(q, torch.rand(B * G, generator=g)).view(B, G)
    num = torch.randint(0, G + 1, (B,), generator=g) if ragged else torch.full((B,), G)
    return VerifyCase(
        target.to(dtype), None if one_hot else draft.to(dtype), tokens, num, temperature, top_k, top_p, min_p,
        torch.rand(B, G + 1, generator=g), torch.rand(B, G + 1, generator=g),
    )


def naive_verify(c: VerifyCase, bug: str | None = None):
    """Algorithm 1, one row and one draft at a time. `bug` plants a known mistake:
    residual_p (resample from p, not norm(max(0, p - q))), reused_uniform (the accept test's
    uniform also draws the residual), wrong_position (residual from the next position's p),
    no_renorm (sample the residual as if it summed to one)."""
    B, G1, V = c.target_logits.shape
    G = G1 - 1
    emitted = torch.full((B, G1), -1, dtype=torch.int64)
    counts = torch.zeros(B, dtype=torch.int64)
    # The warps are tested on their own (test_warp.py); here they are computed once for all rows.
    def warp(logits):
        K = logits.shape[1]
        params = (t.repeat_interleave(K) for t in (c.temperature, c.top_k, c.top_p, c.min_p))
        return warp_probs(logits.reshape(B * K, V).float(), *params).view(B, K, V)

    all_p = warp(c.target_logits)
    if c.draft_logits is None:
        all_q = torch.zeros(B, G, V).scatter_(-1, c.draft_tokens[..., None], 1.0)
    else:
        all_q = warp(c.draft_logits)
    for b in range(B):
        p, q = all_p[b], all_q[b]
        n = 0
        while n < int(c.num_drafts[b]):
            x = int(c.draft_tokens[b, n])
            if not c.u_accept[b, n] * q[n, x] < p[n, x]:
                break
            emitted[b, n] = x
            n += 1
        u = c.u_sample[b, n]
        if n < int(c.num_drafts[b]):
            dist = (p[n] - q[n]).clamp(min=0)
            if bug == "residual_p":
                dist = p[n]
            elif bug == "wrong_position":
                dist = (p[n + 1] - q[n]).clamp(min=0)
            elif bug == "reused_uniform":
                u = c.u_accept[b, n]
            if dist.sum() <= 0:
                dist = p[n]
            if bug == "no_renorm":
                cdf = dist.cumsum(-1)
                token = int(min((cdf <= u).sum(), (dist > 0).nonzero().max()))
            else:
                token = int(sample_from_probs(dist[None], u[None])[0])
        else:
            token = int(sample_from_probs(p[n][None], u[None])[0])
        emitted[b, n] = token
        counts[b] = n + 1
    return emitted, counts


WARPS = {
    "T=1": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "T=0.7,top_k=5": dict(temperature=0.7, top_k=5, top_p=1.0, min_p=0.0),
    "top_p=0.8": dict(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0),
    "min_p=0.1": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1),
}


def fixed_position_case(N, warp, one_hot=False, seed=0):
    """N independent trials of one position (G=1) with fixed logits of p and q over V=12."""
    g = torch.Generator().manual_seed(seed)
    V = 12
    p_logits = torch.randn(V, generator=g) * 1.5
    q_logits = torch.randn(V, generator=g) * 1.5  # far from p: many rejections
    params = {k: torch.full((N,), v, dtype=torch.int64 if k == "top_k" else torch.float32) for k, v in warp.items()}
    q = warp_probs(q_logits.expand(N, V), params["temperature"], params["top_k"], params["top_p"], params["min_p"])
    tokens = sample_from_probs(q, torch.rand(N, generator=g))[:, None]
    if one_hot:  # a fixed deterministic draft: q is one-hot on it
        tokens = torch.full((N, 1), int(p_logits.argsort()[-2]))
    case = VerifyCase(p_logits.expand(N, 2, V).clone(), None if one_hot else q_logits.expand(N, 1, V).clone(),
                      tokens, torch.ones(N, dtype=torch.int64), params["temperature"], params["top_k"],
                      params["top_p"], params["min_p"], torch.rand(N, 2, generator=g), torch.rand(N, 2, generator=g))
    p = warp_probs(p_logits[None], *(t[:1] for t in (params["temperature"], params["top_k"], params["top_p"],
                                                     params["min_p"])))[0]
    return case, p
