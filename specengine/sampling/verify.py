"""The verify step of speculative sampling (Leviathan et al., Algorithm 1), in plain torch.

This is the oracle the fused kernels are tested against: it favours being obviously
right over being fast. Greedy rows need no special path: at temperature 0 the warp is
the one-hot of the argmax, so a draft is accepted iff it is the target's argmax, and the
residual or bonus sample is the target's argmax.
"""
from __future__ import annotations

import torch

from .warp import sample_from_probs, warp_probs


def verify_reference(
    target_logits: torch.Tensor,       # [B, G+1, V] float: target logits after the prefix and each draft
    draft_logits: torch.Tensor | None, # [B, G, V] float, the logits the drafts were sampled from; None: one-hot drafts
    draft_tokens: torch.Tensor,        # [B, G] int64, valid in [:, :num_drafts[b]]
    num_drafts: torch.Tensor,          # [B] int64 in [0, G]
    temperature: torch.Tensor,         # [B] float32, 0 = greedy
    top_k: torch.Tensor,               # [B] int64, 0 = off
    top_p: torch.Tensor,               # [B] float32, 1 = off
    min_p: torch.Tensor,               # [B] float32, 0 = off
    u_accept: torch.Tensor,            # [B, G+1] float32 in [0, 1): accept test of draft i (last column unused)
    u_sample: torch.Tensor,            # [B, G+1] float32 in [0, 1): residual / bonus sample at position i
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns emitted tokens [B, G+1] int64 (-1 after each row's end) and their count [B] int64.

    Row b accepts draft i with probability min(1, p_i(x_i) / q_i(x_i)) (test: u * q < p),
    stops at the first rejection and emits a sample of norm(max(0, p - q)) there, or a
    bonus sample of p_{n+1} when all num_drafts[b] drafts pass. Emits 1..num_drafts+1 tokens.
    """
    B, G1, V = target_logits.shape
    G = G1 - 1
    rows = torch.arange(B, device=target_logits.device)

    def warp(logits):  # [B, K, V] -> probs [B, K, V], each row with its own parameters
        K = logits.shape[1]
        flat = warp_probs(logits.reshape(B * K, V), temperature.repeat_interleave(K),
                          top_k.repeat_interleave(K), top_p.repeat_interleave(K), min_p.repeat_interleave(K))
        return flat.view(B, K, V)

    p = warp(target_logits)
    if draft_logits is None:
        q = torch.zeros(B, G, V, device=p.device).scatter_(-1, draft_tokens[..., None], 1.0)
    else:
        q = warp(draft_logits)

    p_x = p[:, :G].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, G]
    q_x = q.gather(-1, draft_tokens[..., None]).squeeze(-1)         # [B, G]
    passes = (u_accept[:, :G] * q_x < p_x) & (torch.arange(G, device=p.device) < num_drafts[:, None])
    num_accepted = passes.to(torch.int64).cumprod(-1).sum(-1)      # [B]: drafts before the first failure

    p_n = p[rows, num_accepted]                                    # [B, V]
    q_n = torch.cat([q, torch.zeros(B, 1, V, device=p.device)], 1)[rows, num_accepted]
    rejected = num_accepted < num_drafts
    residual = (p_n - q_n).clamp(min=0)
    # A rejection implies p != q, so the residual has mass; rounding can still empty it.
    use_residual = rejected & (residual.sum(-1) > 0)
    final_dist = torch.where(use_residual[:, None], residual, p_n)
    final_token = sample_from_probs(final_dist, u_sample[rows, num_accepted])

    positions = torch.arange(G1, device=p.device)
    emitted = torch.full((B, G1), -1, dtype=torch.int64, device=p.device)
    emitted[:, :G] = torch.where(positions[:G] < num_accepted[:, None], draft_tokens, -1)
    emitted[rows, num_accepted] = final_token
    return emitted, num_accepted + 1
