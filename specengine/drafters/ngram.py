"""Prompt-lookup (n-gram) drafting: drafts copied from earlier in the context (paper Section 3.6).

q is one-hot on the copied token, so verification stays lossless. The search runs in C++
(specengine._C.ngram_propose; tests/test_csrc.py holds its oracle).
"""
from __future__ import annotations

import numpy as np
import torch

from .. import _C
from ..sampling.batch import SamplingBatch
from .base import Drafter, Proposal


class NgramDrafter(Drafter):
    """With an encoder-decoder target the search also covers each row's encoder input, placed
    before its decoded sequence: a summary or a translation copies spans of its source, and a
    match in the sequence itself, being later, still wins."""

    def __init__(self, min_n: int = 1, max_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram drafter needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.sources: list[np.ndarray] = []  # each row's encoder input (empty for a decoder-only target)

    def join_rows(self, prompts: list[list[int]], capacity: int, sources: list[list[int]] | None = None):
        # It reads the sequences themselves; of an encoder-decoder's rows it keeps the inputs.
        self.sources += [np.asarray(s, dtype=np.int64) for s in sources] if sources is not None else \
            [np.zeros(0, dtype=np.int64)] * len(prompts)

    def propose(self, sequences: list[list[int]], budgets: list[int], sampling: SamplingBatch) -> Proposal:
        drafts = [
            _C.ngram_propose(np.concatenate([source, np.asarray(seq, dtype=np.int64)]), self.min_n, self.max_n,
                             budget) if budget else []
            for seq, source, budget in zip(sequences, self.sources, budgets)
        ]
        G = max(len(d) for d in drafts)
        tokens = torch.zeros(len(drafts), G, dtype=torch.int64)
        for b, d in enumerate(drafts):
            tokens[b, : len(d)] = torch.as_tensor(d, dtype=torch.int64)
        num = torch.tensor([len(d) for d in drafts], dtype=torch.int64)
        device = sampling.seeds.device
        return Proposal(tokens.to(device), num.to(device), None, draft_calls=0)

    def keep_rows(self, rows):
        self.sources = [self.sources[i] for i in rows]
