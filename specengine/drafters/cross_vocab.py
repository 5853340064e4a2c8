"""A draft model with a tokenizer of its own (drafters.vocab_map defines the terms).

Each round, per row:
  - the draft's context is the draft forms of the row's target tokens, in order: nothing is
    re-tokenised mid-round, and a target token the draft lacks is fed as its text's draft ids;
  - the draft's distribution is restricted to the shared tokens and renormalised (its logits
    scattered to their target ids, -inf at every other target id), so q is a distribution over
    the target's vocabulary, zero where the draft has no token: Leviathan et al.'s Algorithm 1
    is then exact as it stands (an unshared target token is reached through the residual
    norm(max(0, p - q)), as with any token a draft gives no mass). Each draft is one shared
    token: one target token, one draft position.

The draft keeps its own cache and positions: its context is as many draft ids as the target
tokens' forms hold, so its lengths are not the target's. It keeps that cache itself (no
staged_cache), and verification does not clip it: each proposal rolls a row back itself, to the
longest prefix of the target tokens it fed that the row's sequence still holds (its drafts past
a rejection are forgotten), and feeds the forms of the rest.

A row whose draft context would pass the draft's max_position_embeddings drafts no more (the
draft was not trained on longer contexts): its rounds are target-only rounds from then on.
Encoder-decoder models are not paired across vocabularies.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models.loader import Model
from ..sampling.batch import SamplingBatch
from ..steps.feed import feed, to_device
from .base import Drafter, Proposal
from .model import sample_drafts
from .vocab_map import VocabMap


@dataclass
class _Row:
    """What a row's draft cache holds: the draft forms of `tokens` (target ids), as the draft ids
    `draft`; offsets[k] is where the forms of tokens[k:] start (offsets[0] = 0)."""
    tokens: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=lambda: [0])
    draft: list[int] = field(default_factory=list)
    seen: int = 0      # the length of the row's sequence at the last proposal (tokens that stay)
    off: bool = False  # its context outgrew the draft's: it drafts no more

    def truncate(self, k: int):
        """Keep the forms of the first k target tokens."""
        del self.tokens[k:]
        del self.draft[self.offsets[k]:]
        del self.offsets[k + 1:]

    def append(self, token: int, form: tuple[int, ...]):
        self.tokens.append(token)
        self.draft += form
        self.offsets.append(len(self.draft))


class CrossVocabDrafter(Drafter):
    def __init__(self, model: Model, vocab: VocabMap):
        if model.is_encoder_decoder:
            raise ValueError("a draft with another tokenizer must be a decoder-only model")
        if vocab.draft_size > model.config.vocab_size:
            raise ValueError(f"the vocabulary map covers {vocab.draft_size} draft ids, but the draft's head has "
                             f"{model.config.vocab_size}")
        self.model, self.vocab = model, vocab
        self.vocab_size = vocab.target_size  # the width of q, the target's logits
        self.max_context = model.config.max_position_embeddings
        device = model.device
        self._target_ids = vocab.target_ids.to(device)
        self._draft_ids = vocab.draft_ids.to(device)
        self._to_draft = vocab.to_draft.clamp(min=0).to(device)  # a sampled id is always shared
        self.cache = None
        self.rows: list[_Row] = []
        # The last round's drafts [B, G], G, and which rows drafted (fed them) that round.
        self._pending: tuple[torch.Tensor, int, list[bool]] | None = None

    # ---- rows

    def join_rows(self, prompts: list[list[int]], capacity: int, sources: list[list[int]] | None = None):
        if sources is not None:
            raise ValueError("a draft with another tokenizer does not pair with an encoder-decoder target")
        self._settle()
        new = [_Row() for _ in prompts]
        for row, prompt in zip(new, prompts):  # every token but the last, whose logits the first proposal needs
            for t in prompt[:-1]:
                row.append(t, self.vocab.draft_form(t))
            row.off = len(row.draft) >= self.max_context
        longest = max([len(r.draft) for r in new if not r.off], default=0)
        if self.cache is None:
            self.cache = self.model.new_cache(len(prompts), min(self.max_context, max(capacity, longest + 64)))
            self.cache.reset(0)
        self.cache.reserve(self.cache.batch_size + len(prompts), self.cache.capacity)
        self._reserve(longest + 1)
        rows = self.cache.add_rows(len(prompts))
        feed(self.model, rows, [[] if r.off else r.draft for r in new], cached=[0] * len(new))
        for r in new:
            if r.off:
                r.truncate(0)
        self.rows += new

    def _reserve(self, needed: int):
        """Room for `needed` positions per row, at least doubling (contexts grow a round at a time)."""
        if needed > self.cache.capacity:
            self.cache.reserve(self.cache.allocated_rows, max(needed, 2 * self.cache.capacity))

    def keep_rows(self, rows: list[int]):
        self._settle()
        self.rows = [self.rows[i] for i in rows]
        if self.cache is not None:
            self.cache.keep_rows(rows)

    # ---- drafting

    def _settle(self):
        """Record the last round's drafts as fed (all but the last, which no step fed). Read here,
        not when drafted: by the next proposal the engine has read the round's results anyway."""
        if self._pending is None:
            return
        drafts, G, drafting = self._pending
        self._pending = None
        to_draft = self.vocab._to_draft_list
        for row, tokens, fed in zip(self.rows, drafts[:, :G - 1].tolist(), drafting):
            if fed and not row.off:
                for t in tokens:
                    row.append(t, (max(to_draft[t], 0),))

    def propose(self, sequences: list[list[int]], budgets: list[int], sampling: SamplingBatch) -> Proposal:
        if len(sequences) != len(self.rows):
            raise RuntimeError(f"{len(sequences)} sequences for the cross-vocabulary drafter's {len(self.rows)} rows")
        self._settle()
        G, device = max(budgets), self.model.device
        chunks, starts, drafting = [], [], []
        for row, seq in zip(self.rows, sequences):
            chunk, start = self._catch_up(row, seq, G)
            chunks.append(chunk)
            starts.append(start)
            drafting.append(not row.off and start + len(chunk) > 0)
        ends = [s + len(c) for s, c in zip(starts, chunks)]
        self._reserve(max(ends) + G)
        self.cache.lengths.copy_(to_device(starts, torch.int64, device))
        # Rows that draft nothing feed one padding token at position 0 (their cache is unused).
        hidden = feed(self.model, self.cache, [c if c else [0] for c in chunks], cached=starts)
        ends = [max(e, 1) for e in ends]
        longest = max(ends)
        positions = to_device(ends, torch.int64, device)  # each row's first draft position in the draft's cache
        # The drafts' uniforms are keyed by the target positions they take, like any draft's.
        target_positions = to_device([len(s) for s in sequences], torch.int64, device)[:, None] + \
            torch.arange(G, device=device)

        def step(token: torch.Tensor, i: int) -> torch.Tensor:
            hidden = self.model(self._to_draft[token][:, None], positions + i, self.cache, kv_len=longest + i + 1)
            return self.model.logits(hidden)[:, 0]
        tokens, logits = sample_drafts(self.model.logits(hidden), target_positions, sampling, self._fit_vocab,
                                       self.vocab_size, step)
        self._pending = (tokens, G, drafting)
        num = [min(b, G) if d else 0 for b, d in zip(budgets, drafting)]
        return Proposal(tokens, to_device(num, torch.int64, device), logits, draft_calls=G)

    def _catch_up(self, row: _Row, seq: list[int], G: int) -> tuple[list[int], int]:
        """Roll the row back to what its sequence still holds and return (the draft ids to feed,
        the position they start at). The last target token is always fed (again if needed): its
        logits start the drafts. A row that drafts no more feeds nothing."""
        if row.off:
            return [], 0
        # The longest prefix of the fed tokens that the sequence still holds. The engine's
        # sequences only grow, so the tokens of the previous proposal's sequence still match
        # (checked, at C speed), and only the drafts fed after them are compared one by one.
        n = min(len(row.tokens), len(seq) - 1)
        k = min(row.seen, n)
        if row.tokens[:k] != seq[:k]:
            k = 0
        while k < n and row.tokens[k] == seq[k]:
            k += 1
        row.seen = len(seq)
        row.truncate(k)
        for t in seq[k:]:
            row.append(t, self.vocab.draft_form(t))
        start = row.offsets[k]
        if start == len(row.draft) and start > 0:  # the new tokens have empty forms: feed the last id again
            start -= 1
        if len(row.draft) + G - 1 > self.max_context:
            row.off = True
            row.truncate(0)
            return [], 0
        return row.draft[start:], start

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [B, V_draft] -> [B, V_target]: the shared tokens' logits at their target ids,
        -inf elsewhere (softmax then renormalises over the shared tokens)."""
        out = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return out.index_copy_(1, self._target_ids, logits.index_select(1, self._draft_ids))
