"""A small draft model M_q proposing gamma tokens autoregressively on its own static cache."""
from __future__ import annotations

import torch

from ..steps.graphs import FixedShapeSteps
from ..steps.feed import append_prompts, feed, to_device
from ..models.loader import Model
from ..ops.verify import sample_warped
from ..sampling.batch import SamplingBatch
from ..sampling.rng import STREAM_DRAFT, uniforms
from .base import Drafter, Proposal


class ModelDrafter(Drafter):
    def __init__(self, model: Model, vocab_size: int, num_real_tokens: int):
        """vocab_size: the target's logit width; num_real_tokens: ids a draft may propose (the
        tokenizer's), so a draft with a padded embedding never proposes a padding id."""
        self.model = model
        self.vocab_size = vocab_size
        self.num_real_tokens = min(num_real_tokens, vocab_size, model.config.vocab_size)
        self.cache = None
        self.steps: FixedShapeSteps | None = None
        # The cache's lengths as last advanced by this drafter, kept on the host: with the
        # sequences' lengths they give the lengths after verification without a device read.
        self.fed: list[int] = []

    def use_static_steps(self, max_batch_size: int, capacity: int):
        """Run draft steps on a persistent cache through FixedShapeSteps (CUDA graphs on a GPU)."""
        self.steps = FixedShapeSteps(self.model, max_batch_size, capacity)

    def add_rows(self, prompts: list[list[int]], capacity: int, prefill: bool = True,
                 sources: list[list[int]] | None = None):
        if self.cache is None:
            if self.steps is not None:
                self.cache = self.steps.new_batch(0)
            else:
                self.cache = self.model.new_cache(len(prompts), capacity)
                self.cache.reset(0)
        self.cache.reserve(self.cache.batch_size + len(prompts), capacity)
        append_prompts(self.model, self.cache, prompts, sources, prefill)
        self.fed += [len(p) - 1 if prefill else 0 for p in prompts]

    def staged_cache(self, capacity: int):
        if self.cache is None:
            if self.steps is not None:
                self.cache = self.steps.new_batch(0)
            else:
                self.cache = self.model.new_cache(1, capacity)
                self.cache.reset(0)
        return self.cache

    def join_rows(self, prompts: list[list[int]], capacity: int, sources: list[list[int]] | None = None):
        self.fed += [len(p) - 1 for p in prompts]  # the engine prefilled the rows (staged_cache)

    def reserve(self, capacity: int):
        if self.cache is not None:
            self.cache.reserve(self.cache.allocated_rows, capacity)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [B, V_draft] -> [B, V_target], -inf on ids the draft must not propose."""
        if logits.shape[-1] == self.vocab_size == self.num_real_tokens:
            return logits  # one vocabulary, every id a real token: nothing to mask
        out = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        out[:, : self.num_real_tokens] = logits[:, : self.num_real_tokens]
        return out

    def propose(self, sequences: list[list[int]], budgets: list[int], sampling: SamplingBatch) -> Proposal:
        G = max(budgets)
        device = self.model.device
        # Verification clipped the lengths to the target's, len(sequence) - 1 (see cache_lengths).
        cached = [min(fed, len(seq) - 1) for fed, seq in zip(self.fed, sequences)]
        gaps = [len(seq) - n for seq, n in zip(sequences, cached)]
        if self.steps is not None and max(gaps) <= self.CATCH_UP_WIDTH:
            tokens, logits = self._propose_static(sequences, sampling, G)
        else:
            # Catch up on what the cache lacks: the last token, plus the last draft after full
            # acceptance (more after rounds without drafts, gamma="auto"'s g = 0).
            hidden = feed(self.model, self.cache, [seq[n:] for seq, n in zip(sequences, cached)], cached)
            lengths = self.cache.lengths.clone()  # [B] the first draft's position in each row
            longest = max(len(seq) for seq in sequences)
            step = lambda tokens, positions, i: self._step(tokens, positions, kv_len=longest + i + 1)  # noqa: E731
            tokens, logits = self._draft_loop(self.model.logits(hidden), lengths, sampling, G, step)
            self.cache.lengths.add_(G - 1)
        self.fed = [len(seq) + G - 1 for seq in sequences]  # the catch-up and G - 1 draft steps
        # The engine checks these logits when it reads the round's results (no synchronisation
        # here); until then a broken row drafts some valid id (the clamp), harmlessly.
        return Proposal(tokens, to_device(budgets, torch.int64, device), logits, draft_calls=G)

    def _draft_loop(self, logits: torch.Tensor, lengths: torch.Tensor, sampling: SamplingBatch, G: int,
                    step) -> tuple[torch.Tensor, torch.Tensor]:
        """G drafts per row from the logits of each row's last token [B, V_draft]; lengths [B] is the
        first draft's position; step(tokens [B], positions [B], i) -> next logits [B, V_draft] feeds
        draft i. Returns tokens [B, G] and the (vocabulary-fitted) logits they came from [B, G, V]."""
        positions = lengths[:, None] + torch.arange(G, device=lengths.device)
        u = uniforms(sampling.seeds, positions, STREAM_DRAFT)  # [B, G]
        tokens, all_logits = [], []
        for i in range(G):
            logits = self._fit_vocab(logits)
            token = sample_warped(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p,
                                  u[:, i], filters=sampling.filters).clamp_(0, self.num_real_tokens - 1)
            tokens.append(token)
            all_logits.append(logits)
            if i + 1 < G:
                logits = step(token, positions[:, i], i)
        return torch.stack(tokens, 1), torch.stack(all_logits, 1)

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Logits [B, V] of one draft token per row [B] at these positions [B] (eager, or a static step
        after an eager catch-up). kv_len: max(positions) + 1, known on the host (on a GPU, reading
        it from positions would synchronise every draft step)."""
        if self.steps is not None:
            return self.steps(tokens[:, None], positions)[:, 0]
        return self.model.logits(self.model(tokens[:, None], positions, self.cache, kv_len=kv_len))[:, 0]

    # A round's catch-up is 1 or 2 tokens per row. The static path always feeds the last 2 (one of
    # them again when the cache holds it: same prefix, same K/V), which makes the whole draft
    # phase (catch-up, G - 1 draft steps, G samplings) one fixed-shape computation per (batch
    # bucket, G): one graph replay a round on a GPU instead of about 10 launches per draft step.
    CATCH_UP_WIDTH = 2

    def _propose_static(self, sequences: list[list[int]], sampling: SamplingBatch,
                        G: int) -> tuple[torch.Tensor, torch.Tensor]:
        B, W, device = len(sequences), self.CATCH_UP_WIDTH, self.model.device
        bucket, capacity = self.steps.bucket(B), self.steps.cache.capacity
        # A one-token sequence feeds its token and a padding slot, which its first draft step
        # overwrites before anything reads it. Padding rows start at the spill slot.
        starts = [max(len(seq) - W, 0) for seq in sequences] + [capacity] * (bucket - B)
        chunks = [(seq[s:] + [0] * W)[:W] for seq, s in zip(sequences, starts)] + [[0] * W] * (bucket - B)
        lengths = [len(seq) for seq in sequences] + [capacity] * (bucket - B)
        last = [n - 1 - s for n, s in zip(lengths, starts[:B])] + [0] * (bucket - B)

        def fill(buffers):
            buffers["chunks"].copy_(to_device(chunks, torch.int64, device))
            buffers["rows"].copy_(to_device([starts, lengths, last], torch.int64, device))
        return self._run_draft_phase(B, G, sampling, fill)

    def draft_phase_in_round(self, last_two: torch.Tensor, lengths: torch.Tensor, real: torch.Tensor,
                             sampling: SamplingBatch, G: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The static draft phase of a whole bucket, as plain ops for a caller's CUDA graph to
        capture (a round run from device state, see engine.device_rounds): last_two [bucket, 2]
        int64, lengths [bucket] int64, real [bucket] bool (False: a padding row, which starts at the
        spill slot), sampling rows of the bucket. Returns tokens [bucket, G], logits [bucket, G, V]."""
        capacity, W = self.steps.cache.capacity, self.CATCH_UP_WIDTH
        row_lengths = torch.where(real, lengths, capacity)
        rows = torch.stack([torch.where(real, lengths - W, capacity), row_lengths,
                            torch.where(real, W - 1, 0)])
        tokens, logits = self._draft_phase(torch.where(real[:, None], last_two, 0), rows, sampling.temperature,
                                           sampling.top_k, sampling.top_p, sampling.min_p, sampling.seeds, G=G,
                                           filters=sampling.filters)
        self.cache.row_lengths(real.shape[0]).copy_(row_lengths + (G - 1))
        return tokens, logits

    def runs_in_device_rounds(self, sequences: list[list[int]]) -> bool:
        """With static steps, whether each row's cache lacks at most the static catch-up's last
        tokens (all that a round run from device state feeds it; after rounds at gamma 0 it lacks
        more)."""
        return self.steps is not None and all(len(seq) - min(fed, len(seq) - 1) <= self.CATCH_UP_WIDTH
                                              for seq, fed in zip(sequences, self.fed))

    def cache_row_lengths(self, rows: int) -> torch.Tensor:
        return self.cache.row_lengths(rows)

    def resync(self, lengths: list[int]):
        """After rounds run from device state: the rows now hold sequences of these lengths. The
        cache holds at least all but the last two tokens (verification clipped it; full acceptance
        leaves exactly that), and the static catch-up re-feeds those two."""
        self.fed = [n - self.CATCH_UP_WIDTH for n in lengths]

    def _run_draft_phase(self, B: int, G: int, sampling: SamplingBatch, fill) -> tuple[torch.Tensor, torch.Tensor]:
        """fill(buffers) writes the bucket's chunks [bucket, W] and rows [3, bucket] (starts,
        lengths, index of the last token in the chunk); the sampling rows are copied here."""
        bucket, W, device = self.steps.bucket(B), self.CATCH_UP_WIDTH, self.model.device
        # A batch without top-k, top-p or min-p gets its own graph, whose sampling skips them.
        key = ("draft phase", bucket, G, sampling.filters)
        buffers = self.steps.graphs.buffers(key, lambda: dict(
            chunks=torch.zeros(bucket, W, dtype=torch.int64, device=device),
            rows=torch.zeros(3, bucket, dtype=torch.int64, device=device),
            temperature=torch.zeros(bucket, device=device), top_k=torch.zeros(bucket, dtype=torch.int64, device=device),
            top_p=torch.ones(bucket, device=device), min_p=torch.zeros(bucket, device=device),
            seeds=torch.zeros(bucket, dtype=torch.int64, device=device)))
        fill(buffers)
        for name in ("temperature", "top_k", "top_p", "min_p", "seeds"):
            buffers[name][:B].copy_(getattr(sampling, name))
        tokens, logits = self.steps.graphs.run(key, lambda **b: self._draft_phase(G=G, filters=sampling.filters, **b))
        self.cache.lengths.copy_(buffers["rows"][1, :B] + (G - 1))
        return tokens[:B], logits[:B]

    def _draft_phase(self, chunks, rows, temperature, top_k, top_p, min_p, seeds, G: int, filters: bool):
        """The static draft phase of a full bucket on the persistent cache (see _propose_static)."""
        (catch_up,) = self.steps.forward(chunks, rows[0])  # [bucket, W, V_draft]
        logits = catch_up[torch.arange(chunks.shape[0], device=chunks.device), rows[2]]
        step = lambda tokens, positions, i: self.steps.forward(tokens[:, None], positions)[0][:, 0]  # noqa: E731
        return self._draft_loop(logits, rows[1], SamplingBatch(temperature, top_k, top_p, min_p, seeds, filters), G,
                                step)

    @property
    def cache_lengths(self) -> torch.Tensor:
        # Cached entries stay valid up to the first rejected draft, which verification enforces
        # by clipping these lengths to the target's (the sequence minus its unfed last token).
        return self.cache.lengths

    def keep_rows(self, rows: list[int]):
        if self.cache is None:  # no rows yet
            return
        self.cache.keep_rows(rows)
        self.fed = [self.fed[i] for i in rows]
