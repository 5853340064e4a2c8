"""A small draft model M_q proposing gamma tokens autoregressively on its own static cache."""
from __future__ import annotations

import torch

from ..engine.graphs import StepGraphs
from ..engine.runner import feed, to_device
from ..models.llama import LlamaForCausalLM
from ..ops.verify import sample_warped
from ..sampling.batch import SamplingBatch
from ..sampling.rng import STREAM_DRAFT, uniforms
from .base import Proposal


class ModelDrafter:
    def __init__(self, model: LlamaForCausalLM, vocab_size: int, num_real_tokens: int):
        """vocab_size: the target's logit width; num_real_tokens: ids a draft may propose (the
        tokenizer's), so a draft with a padded embedding never proposes a padding id."""
        self.model = model
        self.vocab_size = vocab_size
        self.num_real_tokens = min(num_real_tokens, vocab_size, model.config.vocab_size)
        self.cache = None
        self.steps: StepGraphs | None = None
        # The cache's lengths as last advanced by this drafter, kept on the host: with the
        # sequences' lengths they give the lengths after verification without a device read.
        self.fed: list[int] = []

    def use_static_steps(self, max_batch_size: int, capacity: int):
        """Run draft steps on a persistent cache through StepGraphs (CUDA graphs on a GPU)."""
        self.steps = StepGraphs(self.model, max_batch_size, capacity)

    def start(self, prompts: list[list[int]], capacity: int):
        if self.steps is not None:
            self.cache = self.steps.new_batch(len(prompts))
        else:
            self.cache = self.model.new_cache(len(prompts), capacity)
        self.fed = [len(p) - 1 for p in prompts]
        feed(self.model, self.cache, [p[:-1] for p in prompts], cached=[0] * len(prompts))

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [B, V_draft] -> [B, V_target], -inf on ids the draft must not propose."""
        if logits.shape[-1] == self.vocab_size == self.num_real_tokens:
            return logits  # one vocabulary, every id a real token: nothing to mask
        out = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        out[:, : self.num_real_tokens] = logits[:, : self.num_real_tokens]
        return out

    def propose(self, sequences: list[list[int]], budgets: list[int], sampling: SamplingBatch) -> Proposal:
        G = max(budgets)
        # Verification clipped the lengths to the target's, len(sequence) - 1 (see cache_lengths).
        cached = [min(fed, len(seq) - 1) for fed, seq in zip(self.fed, sequences)]
        # Catch up on what the cache lacks: the last token, plus the last draft after full acceptance.
        if self.steps is not None and all(len(seq) - n <= self.CATCH_UP_WIDTH for seq, n in zip(sequences, cached)):
            logits = self._catch_up_static(sequences)
        else:  # (also after rounds without drafts, gamma="auto"'s g = 0, which leave longer gaps)
            hidden = feed(self.model, self.cache, [seq[n:] for seq, n in zip(sequences, cached)], cached)
            logits = self.model.logits(hidden)
        self.fed = [len(seq) + G - 1 for seq in sequences]  # after the G - 1 draft steps below
        device = self.model.device
        positions = to_device([len(s) for s in sequences], torch.int64, device)[:, None] + torch.arange(G, device=device)
        u = uniforms(sampling.seeds, positions, STREAM_DRAFT)  # [B, G]
        tokens, all_logits = [], []
        for i in range(G):
            logits = self._fit_vocab(logits)
            token = sample_warped(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p,
                                  u[:, i]).clamp_(0, self.num_real_tokens - 1)
            tokens.append(token)
            all_logits.append(logits)
            if i + 1 < G:
                logits = self._step(token[:, None])[:, 0]
                self.cache.lengths.add_(1)
        # The engine checks these logits when it reads the round's results (no synchronisation
        # here); until then a broken row drafts some valid id (the clamp), harmlessly.
        num = to_device(budgets, torch.int64, device)
        return Proposal(torch.stack(tokens, 1), num, torch.stack(all_logits, 1), draft_calls=G)

    # A round's catch-up is 1 or 2 tokens per row; with static steps it always feeds the last 2 (one
    # of them again when the cache holds it: same prefix, same K/V), so it is one fixed-shape step
    # (a graph replay on a GPU) instead of an eager forward of a new shape every round.
    CATCH_UP_WIDTH = 2

    def _catch_up_static(self, sequences: list[list[int]]) -> torch.Tensor:
        """Feed each row's last CATCH_UP_WIDTH tokens at their positions (a one-token sequence: its
        token and a padding slot, which the next draft step overwrites before anything reads it);
        the cache lengths become the sequences' lengths. Returns the logits of each row's last
        token [B, V]."""
        W = self.CATCH_UP_WIDTH
        starts = [max(len(seq) - W, 0) for seq in sequences]
        chunks = [(seq[s:] + [0] * W)[:W] for seq, s in zip(sequences, starts)]
        lengths = [len(seq) for seq in sequences]
        host = to_device([starts, lengths, [n - 1 - s for n, s in zip(lengths, starts)]], torch.int64,
                         self.model.device)  # [3, B] in one copy: starts, lengths, index of the last token
        logits = self.steps(to_device(chunks, torch.int64, self.model.device), host[0])  # [B, W, V]
        self.cache.lengths.copy_(host[1])
        return logits[torch.arange(len(sequences), device=logits.device), host[2]]

    def _step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, 1, V] of one draft token per row at the cache's lengths."""
        if self.steps is not None:
            return self.steps(tokens, self.cache.lengths)
        return self.model.logits(self.model(tokens, self.cache.lengths.clone(), self.cache))

    @property
    def cache_lengths(self) -> torch.Tensor:
        # Cached entries stay valid up to the first rejected draft, which verification enforces
        # by clipping these lengths to the target's (the sequence minus its unfed last token).
        return self.cache.lengths

    def keep_rows(self, rows: list[int]):
        self.cache.keep_rows(rows)
        self.fed = [self.fed[i] for i in rows]
