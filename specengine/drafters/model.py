"""A small draft model M_q proposing gamma tokens autoregressively on its own static cache.

A round's draft phase (Leviathan et al.'s step 1, gamma times M_q):
  1. catch up: feed each row what the cache lacks of its sequence, ending with its last token;
  2. sample draft 1 from the logits after that token; feed it, sample draft 2; ... draft G.
The cache then holds the catch-up and drafts 1..G-1; verification clips its lengths to what the
target accepted. _draft_phase is that computation, written once: called eagerly on ragged rows,
or on a padded bucket of fixed shape, where a CUDA graph records it (the host's rounds) or a
round run from device state calls it inside its own graph (draft_phase_in_round).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..steps.graphs import FixedShapeSteps
from ..steps.feed import to_device
from ..models.loader import Model
from ..ops.verify import sample_warped
from ..sampling.batch import SamplingBatch, fill_sampling_buffers, sampling_buffers
from ..sampling.rng import STREAM_DRAFT, uniforms
from .base import Drafter, Proposal


def sample_drafts(logits: torch.Tensor, positions: torch.Tensor, sampling: SamplingBatch,
                  fit_vocab: Callable[[torch.Tensor], torch.Tensor], num_ids: int,
                  step: Callable[[torch.Tensor, int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts sampled one at a time from a draft model: the loop of every model drafter.

    logits [B, V_draft]: the draft's logits after each row's last token. positions [B, G] int64:
    the target positions the drafts take; their uniforms are keyed (seed, position) like every
    draft's. fit_vocab(logits [B, V_draft]) -> [B, V]: q's logits over the target's vocabulary.
    num_ids: drafts are clamped below it, so that a row whose logits broke (the engine finds it
    when it reads the round's results, without a synchronisation here) still feeds a valid id.
    step(token [B], i) -> logits [B, V_draft] after draft i, which it feeds.
    Returns the drafts [B, G] int64 and q's logits they were sampled from [B, G, V]."""
    G = positions.shape[1]
    u = uniforms(sampling.seeds, positions, STREAM_DRAFT)  # [B, G]
    tokens, qs = [], []
    for i in range(G):
        q = fit_vocab(logits)
        token = sample_warped(q, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, u[:, i],
                              filters=sampling.filters).clamp_(0, num_ids - 1)
        tokens.append(token)
        qs.append(q)
        if i + 1 < G:
            logits = step(token, i)
    return torch.stack(tokens, 1), torch.stack(qs, 1)


class ModelDrafter(Drafter):
    # A round's catch-up is 1 or 2 tokens per row: the last token, and the last draft after full
    # acceptance. The fixed-shape phase always feeds the last 2 (one of them again when the cache
    # holds it: same prefix, same K/V), which makes the whole draft phase one computation per
    # (bucket, G): one graph replay a round on a GPU instead of about 10 launches per draft step.
    # After rounds without drafts (gamma="auto"'s g = 0) a row lacks more: that round runs eagerly.
    CATCH_UP_WIDTH = 2

    def __init__(self, model: Model, vocab_size: int, num_real_tokens: int):
        """vocab_size: the target's logit width; num_real_tokens: ids a draft may propose (the
        tokenizer's), so a draft with a padded embedding never proposes a padding id."""
        self.model = model
        self.vocab_size = vocab_size
        self.num_real_tokens = min(num_real_tokens, vocab_size, model.config.vocab_size)
        self.cache = None  # the staged_cache
        self.steps: FixedShapeSteps | None = None
        # The cache's lengths as last advanced by this drafter, kept on the host: with the
        # sequences' lengths they give the lengths after verification without a device read.
        self.fed: list[int] = []

    # ---- rows

    def use_static_steps(self, max_batch_size: int, capacity: int):
        self.steps = FixedShapeSteps(self.model, max_batch_size, capacity)

    def staged_cache(self, capacity: int):
        if self.cache is None:
            self.cache = self.steps.new_batch(0) if self.steps is not None else self.model.new_cache(1, capacity)
            self.cache.reset(0)
        return self.cache

    def join_rows(self, prompts: list[list[int]], capacity: int, sources: list[list[int]] | None = None):
        self.fed += [len(p) - 1 for p in prompts]  # the engine prefilled them (staged_cache)

    def keep_rows(self, rows: list[int]):
        if self.cache is None:  # no rows yet
            return
        self.cache.keep_rows(rows)
        self.fed = [self.fed[i] for i in rows]

    # ---- drafting

    def propose(self, sequences: list[list[int]], budgets: list[int], sampling: SamplingBatch) -> Proposal:
        G, W = max(budgets), self.CATCH_UP_WIDTH
        # Verification clipped the lengths to the target's, len(sequence) - 1.
        cached = [min(fed, len(seq) - 1) for fed, seq in zip(self.fed, sequences)]
        if self.steps is not None and all(len(seq) - n <= W for seq, n in zip(sequences, cached)):
            tokens, logits = self._fixed_shape_phase(sequences, sampling, G)
        else:
            tokens, logits = self._eager_phase(sequences, cached, sampling, G)
        self.fed = [len(seq) + G - 1 for seq in sequences]
        # The engine checks these logits when it reads the round's results (no synchronisation
        # here); until then a broken row drafts some valid id (the clamp), harmlessly.
        return Proposal(tokens, to_device(budgets, torch.int64, self.model.device), logits, draft_calls=G)

    def _eager_phase(self, sequences: list[list[int]], cached: list[int], sampling: SamplingBatch,
                     G: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft phase on the rows in use, each catching up from its cache's length on the
        tokens it lacks. Attention spans the longest row so far, known on the host (on a GPU,
        reading it from the positions would synchronise every step)."""
        device = self.model.device
        gaps = [len(seq) - n for seq, n in zip(sequences, cached)]
        T = max(gaps)
        chunks = to_device([(seq[n:] + [0] * T)[:T] for seq, n in zip(sequences, cached)], torch.int64, device)
        starts, lacking = self.cache.lengths, to_device(gaps, torch.int64, device)
        rows = torch.stack([starts, starts + lacking, lacking - 1])
        longest = max(len(seq) for seq in sequences)
        kv_lens = [max(cached) + T] + [longest + i + 1 for i in range(G - 1)]
        return self._draft_phase(chunks, rows, sampling, G, kv_lens)

    def _fixed_shape_phase(self, sequences: list[list[int]], sampling: SamplingBatch,
                           G: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft phase on a padded bucket of the persistent cache, each row catching up on its
        last CATCH_UP_WIDTH tokens: captured as a CUDA graph per (bucket, G, filters) on a GPU."""
        B, W, device = len(sequences), self.CATCH_UP_WIDTH, self.model.device
        bucket, capacity = self.steps.bucket(B), self.steps.cache.capacity
        # A one-token sequence feeds its token and a padding slot, which its first draft step
        # overwrites before anything reads it. Padding rows start at the spill slot.
        starts = [max(len(seq) - W, 0) for seq in sequences] + [capacity] * (bucket - B)
        chunks = [(seq[s:] + [0] * W)[:W] for seq, s in zip(sequences, starts)] + [[0] * W] * (bucket - B)
        lengths = [len(seq) for seq in sequences] + [capacity] * (bucket - B)
        last = [n - 1 - s for n, s in zip(lengths, starts[:B])] + [0] * (bucket - B)
        # A batch without top-k, top-p or min-p gets its own graph, whose sampling skips them.
        key = ("draft phase", bucket, G, sampling.filters)
        buffers = self.steps.graphs.buffers(key, lambda: dict(
            chunks=torch.zeros(bucket, W, dtype=torch.int64, device=device),
            rows=torch.zeros(3, bucket, dtype=torch.int64, device=device), **sampling_buffers(bucket, device)))
        buffers["chunks"].copy_(to_device(chunks, torch.int64, device))
        buffers["rows"].copy_(to_device([starts, lengths, last], torch.int64, device))
        fill_sampling_buffers(buffers, sampling)

        def phase(chunks, rows, temperature, top_k, top_p, min_p, seeds):
            bucket_sampling = SamplingBatch(temperature, top_k, top_p, min_p, seeds, sampling.filters)
            return self._draft_phase(chunks, rows, bucket_sampling, G, [capacity] * G)
        tokens, logits = self.steps.graphs.run(key, phase)
        return tokens[:B], logits[:B]

    def draft_phase_in_round(self, last_two: torch.Tensor, lengths: torch.Tensor, real: torch.Tensor,
                             sampling: SamplingBatch, G: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed-shape draft phase of a whole bucket, for a round run from device state to call
        inside its own CUDA graph (engine.rounds): last_two [bucket, 2] int64, lengths
        [bucket] int64, real [bucket] bool (False: a padding row, which starts at the spill slot),
        sampling rows of the bucket. Returns tokens [bucket, G], logits [bucket, G, V]."""
        capacity, W = self.steps.cache.capacity, self.CATCH_UP_WIDTH
        rows = torch.stack([torch.where(real, lengths - W, capacity), torch.where(real, lengths, capacity),
                            torch.where(real, W - 1, 0)])
        return self._draft_phase(torch.where(real[:, None], last_two, 0), rows, sampling, G, [capacity] * G)

    def _draft_phase(self, chunks: torch.Tensor, rows: torch.Tensor, sampling: SamplingBatch, G: int,
                     kv_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """G drafts for each of the cache's first R rows (see the module).

        chunks [R, W] int64: each row's catch-up, right-padded. rows [3, R] int64: each row's
        catch-up start position, its first draft's position (its sequence's length), and the index
        in its chunk of its last token. kv_lens [G] (host ints): the keys each call attends over,
        the catch-up's then each draft step's (clipped to the cache's capacity).
        Returns the drafts [R, G] int64 and q's logits [R, G, V]."""
        starts, first, last = rows
        hidden = self.model(chunks, starts, self.cache, kv_len=kv_lens[0])  # [R, W, D]
        logits = self.model.logits(hidden[torch.arange(chunks.shape[0], device=chunks.device), last])
        positions = first[:, None] + torch.arange(G, device=first.device)  # [R, G]

        def step(token: torch.Tensor, i: int) -> torch.Tensor:
            hidden = self.model(token[:, None], positions[:, i], self.cache, kv_len=kv_lens[i + 1])
            return self.model.logits(hidden)[:, 0]
        tokens, logits = sample_drafts(logits, positions, sampling, self._fit_vocab, self.num_real_tokens, step)
        self.cache.row_lengths(chunks.shape[0]).copy_(first + (G - 1))  # the last draft is not fed
        return tokens, logits

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [B, V_draft] -> [B, V_target], -inf on ids the draft must not propose."""
        if logits.shape[-1] == self.vocab_size == self.num_real_tokens:
            return logits  # one vocabulary, every id a real token: nothing to mask
        out = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        out[:, : self.num_real_tokens] = logits[:, : self.num_real_tokens]
        return out

    # ---- rounds run from device state

    def runs_in_device_rounds(self, sequences: list[list[int]], gamma: int) -> bool:
        """With static steps, whether each row's cache lacks at most the fixed-shape catch-up's
        last tokens (all that a round run from device state feeds it; after rounds at gamma 0 it
        lacks more)."""
        return self.steps is not None and all(len(seq) - min(fed, len(seq) - 1) <= self.CATCH_UP_WIDTH
                                              for seq, fed in zip(sequences, self.fed))

    def device_round_state(self, sequences: list[list[int]], bucket: int, gamma: int) -> tuple[torch.Tensor, ...]:
        """The draft cache's lengths [bucket]: a round's catch-up reads its inputs from the round's
        log (each row's last two tokens), and its draft phase and verification set these."""
        return (self.steps.cache.row_lengths(bucket),)

    def verified(self, starts: list[int], gamma: int, lengths: list[int]):
        """The last round's draft phase fed each row up to its gamma - 1st draft (every row of the
        batch is fed gamma - 1 drafts, whatever its budget), and verification clipped the cache to
        all but the last token of each sequence: drafts fed past a rejection are gone, and a
        catch-up after rounds without drafts starts there. The same after a host round (whose
        propose fed the rows) as after a block (whose draft phases ran on the device)."""
        self.fed = [min(start + gamma - 1, n - 1) for start, n in zip(starts, lengths)]
