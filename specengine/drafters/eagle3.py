"""The EAGLE-3 drafter: a draft head (models.eagle3) that reads the target's own features.

The target captures the residual stream entering the head's feature_layers in every forward
(LlamaForCausalLM.capture_features, set by the engine from this drafter's feature_layers), and
the engine hands this drafter the features of the positions each forward settled
(take_features): a prompt's, from its prefill chunks (or the prefix cache's blocks), when it
joins; after each host round, those of the tokens verification kept (the row's last token and
the accepted drafts: the features of rejected drafts are dropped there). No target forward is
spent on the drafter.

A row's head cache holds "pairs": at position t, the target's features at t with the token at
t + 1 (what the published heads were trained on, at vLLM's positions). A row of a sequence of n
tokens can hold pairs 0 .. n - 2, since the target has seen tokens 0 .. n - 2 when the round
starts. A round's draft phase (_draft_phase), for every row:
  1. catch up: feed the pairs the head lacks (fed .. n - 2; one after the accepted tokens of the
     last round, more after rounds at gamma 0 or a prompt), their features fused by the head's fc;
  2. draft 1 comes from the output at the last pair, at position n; then draft i + 1 from feeding
     (the head's own output before its final norm, draft i) at position n - 2 + i, as EAGLE-3
     drafts: the head never sees a target feature for a token the target has not verified.
The chain's entries are never kept: the next round feeds the verified tokens with the target's
features over them (a row's cache is set back to its pairs, fed). q is the head's softmax over
its draft vocabulary mapped to the target's ids (d2t), -inf elsewhere: exact.

The draft phase runs three ways, one computation: eagerly on the rows in use (a long catch-up's
pairs before its last PIECE first, in pieces); on a padded bucket of the persistent cache when
every row lacks at most gamma + 1 pairs (what one round's verification settles), a CUDA graph per
(bucket, gamma, filters) on a GPU; and inside a round run from device state (engine.rounds),
whose catch-up is the round before's verification: its features, its tokens and how many it
kept, written into this drafter's catch-up buffers by the round itself (take_features_in_round)
without a read. The catch-up buffers of a (bucket, gamma) are one set, in the head's dtype (what
fc reads: the same bits as fusing float32 features).

Bits: every call of the head feeds fewer than ops.product.GEMM_MIN_TOKENS_PER_ROW tokens per row
(long catch-ups go in pieces), so its products take the decode path in every call, and a row's
entries and q are the same whatever rows, chunks, pieces or padding it was fed with (each row's
products and each query's attention are computed on their own): seeded sampling stays batch
invariant, a prompt fed from the prefix cache's blocks drafts as one prefilled whole, and rounds
from device state draft what host rounds draft.
"""
from __future__ import annotations

import torch

from ..models.eagle3 import Eagle3Head
from ..ops.product import GEMM_MIN_TOKENS_PER_ROW
from ..sampling.batch import SamplingBatch, fill_sampling_buffers, sampling_buffers
from ..steps.feed import to_device
from ..steps.graphs import FixedShapeSteps
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
        self.steps: FixedShapeSteps | None = None  # the persistent cache and its captured phases
        self.fed: list[int] = []                   # per row: pairs held (positions 0 .. fed - 1)
        self.pending: list[torch.Tensor] = []      # per row: features [m, F] of positions fed .. fed + m - 1
        # A block's catch-up buffers (see device_round_state), from its start to the read after it.
        self._block: dict[str, torch.Tensor] | None = None

    @property
    def feature_width(self) -> int:
        """F: the target's captured states side by side (LlamaForCausalLM.capture_features)."""
        return len(self.feature_layers) * self.model.config.target_hidden_size

    # ---- rows

    def use_static_steps(self, max_batch_size: int, capacity: int):
        self.steps = FixedShapeSteps(self.model, max_batch_size, capacity)

    def join_rows(self, prompts: list[list[int]], capacity: int, sources: list[list[int]] | None = None):
        if sources is not None:
            raise ValueError("an EAGLE-3 head reads a decoder-only target's features")
        if self.cache is None:
            self.cache = (self.steps.new_batch(0) if self.steps is not None
                          else self.model.new_cache(len(prompts), capacity))
            self.cache.reset(0)
        self.cache.reserve(self.cache.batch_size + len(prompts), max(capacity, self.cache.capacity))
        self.cache.add_rows(len(prompts))
        self.fed += [0] * len(prompts)
        # Their prompts' features come next (take_features), as the engine hands them over.
        self.pending += [torch.zeros(0, self.feature_width, device=self.model.device) for _ in prompts]

    def keep_rows(self, rows: list[int]):
        self._block = None  # (rows leave after a read: a block's state was taken back, or its round failed)
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
        self._block = None  # a host round: what a block before it left was taken back at its read
        lacking = self._lacking(sequences)
        longest = max(len(s) for s in sequences)
        if longest + G > self.cache.capacity:  # room for the chain, at least doubling
            self.cache.reserve(self.cache.allocated_rows, max(longest + G, 2 * self.cache.capacity))
        if self.steps is not None and max(lacking) <= G + 1:
            tokens, logits = self._fixed_shape_phase(sequences, lacking, sampling, G)
        else:
            tokens, logits = self._eager_phase(sequences, lacking, sampling, G)
        # A one-token sequence has no pair yet (the target has seen none of its tokens): no drafts.
        num_drafts = [budget if len(s) >= 2 else 0 for s, budget in zip(sequences, budgets)]
        self.pending = [p[n:] for p, n in zip(self.pending, lacking)]
        self.fed = [len(s) - 1 for s in sequences]
        return Proposal(tokens, to_device(num_drafts, torch.int64, device), logits, draft_calls=G)

    def _lacking(self, sequences: list[list[int]]) -> list[int]:
        """The pairs each row's head cache lacks (fed .. len - 2), checked against what it holds."""
        lacking = [len(s) - 1 - fed for s, fed in zip(sequences, self.fed)]
        short = [b for b, n in enumerate(lacking) if n > self.pending[b].shape[0]]
        if short:
            raise RuntimeError(f"rows {short} lack the target's features of tokens they hold (not handed over)")
        return lacking

    def _pairs(self, sequences: list[list[int]], skip: list[int], counts: list[int], width: int,
               rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's pairs from position fed + skip[b], counts[b] of them, right-padded to width,
        for a batch of `rows` rows (rows past the sequences: padding at the spill slot). Returns
        tokens [rows, width] int64, features [rows, width, F] in the head's dtype, and [2, rows]
        int64: each row's first pair's position and the index of its last pair (0 without pairs)."""
        capacity, device = self.cache.capacity, self.model.device
        starts = [fed + k for fed, k in zip(self.fed, skip)]
        tokens = [(s[p + 1:p + 1 + n] + [0] * width)[:width] for s, p, n in zip(sequences, starts, counts)]
        features = torch.zeros(rows, width, self.feature_width, dtype=self.model.dtype, device=device)
        for b, (k, n) in enumerate(zip(skip, counts)):
            features[b, :n] = self.pending[b][k:k + n]
        padding = rows - len(sequences)
        return (to_device(tokens + [[0] * width] * padding, torch.int64, device), features,
                to_device([starts + [capacity] * padding, [max(n - 1, 0) for n in counts] + [0] * padding],
                          torch.int64, device))

    def _eager_phase(self, sequences: list[list[int]], lacking: list[int], sampling: SamplingBatch,
                     G: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft phase on the rows in use. Each row's pairs before its last PIECE are fed
        first, in calls of at most PIECE tokens per row; the last piece is the phase's catch-up.
        Attention spans the longest row so far, known on the host."""
        B, device = len(sequences), self.model.device
        last_piece = [min(n, self.PIECE) for n in lacking]
        done = [0] * B
        while True:
            takes = [min(n - p - d, self.PIECE) for n, p, d in zip(lacking, last_piece, done)]
            if max(takes) <= 0:
                break
            width = max(takes)
            tokens, features, (starts, _) = self._pairs(sequences, done, takes, width, B)
            self.model(tokens, starts, self.cache, kv_len=self._fed_after(done) + width,
                       hidden=self.model.fuse(features))
            done = [d + k for d, k in zip(done, takes)]
        width = max(max(last_piece), 1)
        tokens, features, (starts, last) = self._pairs(sequences, done, last_piece, width, B)
        first = to_device([len(s) for s in sequences], torch.int64, device)
        longest = max(len(s) for s in sequences)
        kv_lens = [self._fed_after(done) + width] + [longest + i for i in range(G - 1)]
        return self._draft_phase(tokens, features, starts, last, first, sampling, G, kv_lens)

    def _fed_after(self, done: list[int]) -> int:
        """The most pairs a row holds once done[b] more of its own are fed (a call's keys start there)."""
        return max(fed + d for fed, d in zip(self.fed, done))

    def _fixed_shape_phase(self, sequences: list[list[int]], lacking: list[int], sampling: SamplingBatch,
                           G: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft phase on a padded bucket of the persistent cache, each row catching up on
        gamma + 1 pairs (its own, then padding): captured as a CUDA graph per (bucket, G, filters)
        on a GPU."""
        B, device = len(sequences), self.model.device
        bucket, capacity = self.steps.bucket(B), self.steps.cache.capacity
        key = ("draft phase", bucket, G, sampling.filters)
        buffers = self.steps.graphs.buffers(key, lambda: dict(
            first=torch.zeros(bucket, dtype=torch.int64, device=device), **sampling_buffers(bucket, device)))
        catch_up = self._catch_up(sequences, lacking, bucket, G)
        # Padding rows draft at the spill slot: their chain's first pair one past it, clamped there.
        buffers["first"].copy_(to_device([len(s) for s in sequences] + [capacity + 1] * (bucket - B), torch.int64,
                                         device))
        fill_sampling_buffers(buffers, sampling)

        def phase(first, temperature, top_k, top_p, min_p, seeds):
            bucket_sampling = SamplingBatch(temperature, top_k, top_p, min_p, seeds, sampling.filters)
            return self._draft_phase(catch_up["tokens"], catch_up["features"], catch_up["pairs"][0],
                                     catch_up["pairs"][1], first, bucket_sampling, G, [capacity] * G)
        tokens, logits = self.steps.graphs.run(key, phase)
        return tokens[:B], logits[:B]

    def _catch_up(self, sequences: list[list[int]], lacking: list[int], bucket: int,
                  G: int) -> dict[str, torch.Tensor]:
        """The static catch-up buffers of a bucket at gamma G (one set, shared by the captured
        phase of host rounds and a block's rounds), filled with each row's lacking pairs (see
        _pairs): tokens [bucket, G+1] int64, features [bucket, G+1, F], pairs [2, bucket] int64."""
        device = self.model.device
        buffers = self.steps.graphs.buffers(("catch-up", bucket, G), lambda: dict(
            tokens=torch.zeros(bucket, G + 1, dtype=torch.int64, device=device),
            features=torch.zeros(bucket, G + 1, self.feature_width, dtype=self.model.dtype, device=device),
            pairs=torch.zeros(2, bucket, dtype=torch.int64, device=device)))
        for name, filled in zip(("tokens", "features", "pairs"),
                                self._pairs(sequences, [0] * len(sequences), lacking, G + 1, bucket)):
            buffers[name].copy_(filled)
        return buffers

    def _draft_phase(self, tokens: torch.Tensor, features: torch.Tensor, starts: torch.Tensor, last: torch.Tensor,
                     first: torch.Tensor, sampling: SamplingBatch, G: int,
                     kv_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """G drafts for each of the cache's first R rows (see the module).

        tokens [R, W] int64 and features [R, W, F] (the head's dtype): each row's catch-up pairs, right-padded;
        starts [R] int64: the first pair's position; last [R] int64: the index of its last pair;
        first [R] int64: its first draft's position (its sequence's length). kv_lens [G] (host
        ints): the keys each call attends over, the catch-up's then each chain step's.
        Returns the drafts [R, G] int64 and q's logits [R, G, V]."""
        head, R = self.model, tokens.shape[0]
        out = head(tokens, starts, self.cache, kv_len=kv_lens[0], hidden=head.fuse(features))  # [R, W, H]
        hidden = out[torch.arange(R, device=out.device), last][:, None]  # [R, 1, H]: the output at the last pair
        positions = first[:, None] + torch.arange(G, device=first.device)  # [R, G]: the drafts' (their uniforms' key)

        def step(token: torch.Tensor, i: int) -> torch.Tensor:
            nonlocal hidden  # chain step i feeds (its output before, draft i) at the pair's position first - 1 + i
            hidden = head(token[:, None], first - 1 + i, self.cache, kv_len=kv_lens[i + 1], hidden=hidden)
            return head.logits(hidden)[:, 0]
        return sample_drafts(head.logits(hidden[:, 0]), positions, sampling, self._fit_vocab, self.num_real_tokens,
                             step)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's logits over the target's vocabulary [B, V], -inf past the tokenizer's ids."""
        if self.num_real_tokens == self.vocab_size:
            return logits
        return torch.cat([logits[:, :self.num_real_tokens],
                          logits.new_full((logits.shape[0], self.vocab_size - self.num_real_tokens), float("-inf"))],
                         dim=1)

    # ---- rounds run from device state

    def runs_in_device_rounds(self, sequences: list[list[int]], gamma: int) -> bool:
        """With static steps, whether each row lacks between 1 and gamma + 1 pairs: what one round's
        verification settles, which a round from device state feeds (a one-token row has none to
        draft from; after rounds at gamma 0 a row lacks more)."""
        return self.steps is not None and all(1 <= n <= gamma + 1 for n in self._lacking(sequences))

    def device_round_state(self, sequences: list[list[int]], bucket: int, gamma: int) -> tuple[torch.Tensor, ...]:
        """The catch-up buffers of a block's rounds (tokens [bucket, G+1], features [bucket, G+1, F],
        pairs [2, bucket]: see _pairs), filled from the pairs each row lacks now; each round then
        writes the next round's (take_features_in_round), and the read after the block takes the
        last round's back (verified)."""
        self._block = self._catch_up(sequences, self._lacking(sequences), bucket, gamma)
        return tuple(self._block.values())

    def draft_phase_in_round(self, last_two: torch.Tensor, lengths: torch.Tensor, real: torch.Tensor,
                             sampling: SamplingBatch, G: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed-shape draft phase of a whole bucket inside a round run from device state, its
        catch-up from the buffers (see ModelDrafter.draft_phase_in_round for the arguments)."""
        capacity, block = self.steps.cache.capacity, self._block
        return self._draft_phase(block["tokens"], block["features"], block["pairs"][0], block["pairs"][1],
                                 torch.where(real, lengths, capacity + 1), sampling, G, [capacity] * G)

    def take_features_in_round(self, features: torch.Tensor, emitted: torch.Tensor, counts: torch.Tensor,
                               lengths: torch.Tensor, real: torch.Tensor):
        """After a round's verification inside a block: the next round's catch-up is this round's
        verified tokens. features [bucket, G+1, F] float32: the verification's (positions lengths - 1
        on); emitted [bucket, G+1] int64 (-1 past counts); counts [bucket] int64; lengths [bucket]
        int64: before the round; real [bucket] bool."""
        block, capacity = self._block, self.steps.cache.capacity
        block["tokens"].copy_(emitted.clamp(min=0))
        block["features"].copy_(features)
        block["pairs"].copy_(torch.stack([torch.where(real, lengths - 1, capacity), torch.where(real, counts - 1, 0)]))

    def verified(self, starts: list[int], gamma: int, lengths: list[int]):
        """After a block, the head has fed each row's pairs up to its last round's start, and holds
        the features of the tokens the last round kept in its catch-up buffers. (After a host
        round, propose advanced the rows and take_features follows.)"""
        if self._block is None:
            return
        features = self._block["features"]
        self.pending = [features[b, :n - start].clone() for b, (start, n) in enumerate(zip(starts, lengths))]
        self.fed = [start - 1 for start in starts]
        self._block = None
