"""The EAGLE-3 drafter: a draft head (models.eagle3) that reads the target's own features.

The target captures the residual stream entering the head's feature_layers in every forward
(LlamaForCausalLM.capture_features, set by the engine from this drafter's feature_layers), and
the engine hands this drafter the features of the positions each forward settled
(take_features): a prompt's, from its prefill chunks (or the prefix cache's blocks), when it
joins; after each round, those of the tokens verification kept (the row's last token and the
accepted drafts: the features of rejected drafts are dropped there). No target forward is spent
on the drafter.

A row's head cache holds "pairs": at position t, the target's features at t with the token at
t + 1 (what the published heads were trained on, at vLLM's positions). A row of a sequence of n
tokens can hold pairs 0 .. n - 2, since the target has seen tokens 0 .. n - 2 when the round
starts. Each round, for every row:
  1. catch up: feed the pairs the head lacks (fed .. n - 2; one after the accepted tokens of the
     last round, more after rounds at gamma 0), their features fused by the head's fc;
  2. draft 1 comes from the output at the last pair, at position n; then draft i + 1 from feeding
     (the head's own output before its final norm, draft i) at position n - 2 + i, as EAGLE-3
     drafts: the head never sees a target feature for a token the target has not verified.
The chain's entries are never kept: the next round feeds the verified tokens with the target's
features over them (a row's cache is set back to its pairs, fed). q is the head's softmax over
its draft vocabulary mapped to the target's ids (d2t), -inf elsewhere: exact.

Bits: every call of the head feeds fewer than ops.product.GEMM_MIN_TOKENS_PER_ROW tokens per row
(long catch-ups go in pieces), so its products take the decode path in every call, and a row's
entries and q are the same whatever rows, chunks or pieces it was fed with (each row's products
and each query's attention are computed on their own): seeded sampling stays batch invariant, and
a prompt fed from the prefix cache's blocks drafts as one prefilled whole.

Rounds from device state (cuda_graphs with rounds_per_read > 1) are not run with this drafter:
runs_in_device_rounds is False, so every round is a host round; nor are the head's steps
captured as CUDA graphs (use_static_steps refuses a CUDA target; on a CPU the fixed-shape
steps run eagerly).
"""
from __future__ import annotations

import torch

from ..models.eagle3 import Eagle3Head
from ..ops.product import GEMM_MIN_TOKENS_PER_ROW
from ..sampling.batch import SamplingBatch
from ..steps.feed import to_device
from .base import Drafter, Proposal
from .model import sample_drafts


class Eagle3Drafter(Drafter):
    # The most tokens per row one call of the head feeds: decode-sized products (see the module).
    PIECE = GEMM_MIN_TOKENS_PER_ROW - 1

    def __init__(self, head: Eagle3Head, vocab_size: int, num_real_tokens: int):
        """vocab_size: the target's logit width; num_real_tokens: ids a draft may propose (the
        tokenizer's): a head whose d2t reaches a padding id never proposes it."""
        if head.config.vocab_size != vocab_size:
            raise ValueError(f"the head scores {head.config.vocab_size} ids, the target {vocab_size}")
        self.model = head
        self.feature_layers = head.config.feature_layers
        self.vocab_size = vocab_size
        self.num_real_tokens = min(num_real_tokens, vocab_size)
        self.cache = None
        self.fed: list[int] = []                   # per row: pairs held (positions 0 .. fed - 1)
        self.pending: list[torch.Tensor] = []      # per row: features [m, F] of positions fed .. fed + m - 1

    # ---- rows

    def use_static_steps(self, max_batch_size: int, capacity: int):
        if self.model.device.type == "cuda":
            raise ValueError("the EAGLE-3 drafter does not run on CUDA graphs yet (drop cuda_graphs)")
        # On a CPU the target's fixed-shape steps run eagerly and capture the features; the head
        # runs its own eager calls (host rounds).

    def join_rows(self, prompts: list[list[int]], capacity: int, sources: list[list[int]] | None = None):
        if sources is not None:
            raise ValueError("an EAGLE-3 head reads a decoder-only target's features")
        width = len(self.feature_layers) * self.model.config.target_hidden_size
        if self.cache is None:
            self.cache = self.model.new_cache(len(prompts), capacity)
            self.cache.reset(0)
        self.cache.reserve(self.cache.batch_size + len(prompts), max(capacity, self.cache.capacity))
        self.cache.add_rows(len(prompts))
        self.fed += [0] * len(prompts)
        # Their prompts' features come next (take_features), as the engine hands them over.
        self.pending += [torch.zeros(0, width, device=self.model.device) for _ in prompts]

    def keep_rows(self, rows: list[int]):
        self.fed = [self.fed[i] for i in rows]
        self.pending = [self.pending[i] for i in rows]
        if self.cache is not None:
            self.cache.keep_rows(rows)

    def take_features(self, rows: list[int], starts: list[int], features: torch.Tensor, counts: list[int]):
        """Row rows[r] now has the target's features of positions starts[r] .. starts[r] +
        counts[r] - 1 in features[r, :counts[r]] ([R, T, F] float32)."""
        for r, (row, start, count) in enumerate(zip(rows, starts, counts)):
            known = self.fed[row] + self.pending[row].shape[0]
            if count and start != known:  # each position once, in order: a gap or a repeat is the engine's bug
                raise RuntimeError(f"row {row}: the target's features come for positions from {start}, but the "
                                   f"drafter holds them up to position {known}")
            if count:
                self.pending[row] = torch.cat([self.pending[row], features[r, :count]])

    # ---- drafting

    def propose(self, sequences: list[list[int]], budgets: list[int], sampling: SamplingBatch) -> Proposal:
        G, device = max(budgets), self.model.device
        need = [len(s) - 1 - fed for s, fed in zip(sequences, self.fed)]
        short = [b for b, n in enumerate(need) if n > self.pending[b].shape[0]]
        if short:
            raise RuntimeError(f"rows {short} lack the target's features of tokens they hold (not handed over)")
        longest = max(len(s) for s in sequences)
        if longest + G > self.cache.capacity:  # room for the chain, at least doubling
            self.cache.reserve(self.cache.allocated_rows, max(longest + G, 2 * self.cache.capacity))
        last = self._catch_up(sequences, need)  # [B, H]
        positions = to_device([len(s) for s in sequences], torch.int64, device)[:, None] + torch.arange(
            G, device=device)  # [B, G]: the drafts' target positions (their uniforms' key)
        slots = positions[:, 0] - 1  # draft step i feeds its pair at slots + i
        hidden = last[:, None]

        def step(token: torch.Tensor, i: int) -> torch.Tensor:
            nonlocal hidden
            hidden = self.model(token[:, None], slots + i, self.cache, kv_len=longest + i, hidden=hidden)
            return self.model.logits(hidden)[:, 0]
        tokens, logits = sample_drafts(self.model.logits(last), positions, sampling, self._fit_vocab,
                                       self.num_real_tokens, step)
        # A one-token sequence has no pair yet (the target has seen none of its tokens): no drafts.
        num_drafts = [budget if len(s) >= 2 else 0 for s, budget in zip(sequences, budgets)]
        self.pending = [p[n:] for p, n in zip(self.pending, need)]
        self.fed = [len(s) - 1 for s in sequences]
        return Proposal(tokens, to_device(num_drafts, torch.int64, device), logits, draft_calls=G)

    def _catch_up(self, sequences: list[list[int]], need: list[int]) -> torch.Tensor:
        """Feed each row's lacking pairs (fed .. len - 2) in calls of at most PIECE tokens per row;
        returns each row's output at its last pair [B, H] (zeros for a row without pairs)."""
        head, device = self.model, self.model.device
        B, F = len(sequences), self.pending[0].shape[1]
        last = torch.zeros(B, head.config.hidden_size, dtype=head.dtype, device=device)
        done = [0] * B
        while True:
            W = min(max(n - d for n, d in zip(need, done)), self.PIECE)
            if W <= 0:
                return last
            takes = [min(n - d, W) for n, d in zip(need, done)]
            starts = [fed + d for fed, d in zip(self.fed, done)]
            # Right-padded: a row's padding writes past its pairs, where the chain writes next.
            tokens = [(s[p + 1:p + 1 + k] + [0] * W)[:W] for s, p, k in zip(sequences, starts, takes)]
            features = torch.zeros(B, W, F, device=device)
            for b, (d, k) in enumerate(zip(done, takes)):
                features[b, :k] = self.pending[b][d:d + k]
            out = head(to_device(tokens, torch.int64, device), to_device(starts, torch.int64, device), self.cache,
                       kv_len=max(starts) + W, hidden=head.fuse(features))  # [B, W, H]
            ending = [b for b in range(B) if takes[b] and done[b] + takes[b] == need[b]]
            if ending:
                rows = to_device(ending, torch.int64, device)
                last[rows] = out[rows, to_device([takes[b] - 1 for b in ending], torch.int64, device)]
            done = [d + k for d, k in zip(done, takes)]

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's logits over the target's vocabulary [B, V], -inf past the tokenizer's ids."""
        if self.num_real_tokens == self.vocab_size:
            return logits
        return torch.cat([logits[:, :self.num_real_tokens],
                          logits.new_full((logits.shape[0], self.vocab_size - self.num_real_tokens), float("-inf"))],
                         dim=1)
