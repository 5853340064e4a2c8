"""How much prompt a step may prefill (EngineConfig.prefill_chunk_tokens).

A prefilling request's prompt is prefilled a chunk a step, in the same step as a round of the rows
already decoding (engine.scheduler plans the chunks), so that those rows are held up by one chunk, not by the whole
prompt. The budget is the tokens of all of a step's chunks:

  an int   that many tokens a step, a multiple of CHUNK (chunks end on its multiples);
  None     no limit: every prefilling prompt is prefilled whole in its first step;
  "auto"   no limit while nothing decodes (nobody waits); while rows decode, what the prefill runs
           in about half a round's time (ROUND_SHARE): a decoding row's step then takes about
           1.5 of its rounds, and a prompt joins at about a third of the machine's prefill speed. That is a multiple of CHUNK tokens while a chunk takes less than that;
           when one chunk takes longer, the chunk's target forward is spread over steps, a share
           of its layers a step
           (models.llama.forward_layers), so that no step waits for a whole chunk. Both times are
           measured as they run, so the budget follows the device, the models and the batch. With
           a split target every rank takes rank 0's budget (the ranks' calls must match).

A chunk's time per token is learnt from chunks only: a whole prompt prefilled while nothing
decodes spreads each call's fixed cost (every weight read and dequantized for the GEMMs) over all
its tokens and rows, so its time per token understates a chunk's. A chunk also costs more the
further into its prompt it lies (its attention reads more keys; measured:
bench/results/join-stall-2026-12-03.md), so a slower chunk counts at once, while a faster one is
only averaged in. A step that ran a share of a
chunk's layers counts as that share of its tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ops.product import GEMM_MIN_TOKENS_PER_ROW

# Chunks are multiples of this many tokens: the fewest per row whose products take a prefill's
# GEMM path (ops.product), which every chunk of a long prompt must take (steps.feed.prefill_chunks),
# so it follows that threshold. The prefix cache's blocks are multiples of it too.
CHUNK = GEMM_MIN_TOKENS_PER_ROW


@dataclass(frozen=True)
class PrefillShare:
    """What one step may prefill."""
    tokens: int | None        # prompt tokens of the chunks it may start (None: no limit)
    layers: int | None = None  # of a chunk's target layers, how many a step runs (None: all at once)


class PrefillBudget:
    # Smoothing of the measured times (the weight of the newest).
    WEIGHT = 0.3
    # What a step's prefill may take, in rounds: a running row's step then takes about 1.5 of its
    # rounds. Well under one round, so that a step that runs slower than measured (the last chunk
    # of a prompt, whose row then joins the round; a busy machine) stays within 3 rounds
    # (bench/bench_join_stall.py: at 1 and at 0.75, steps of 3-3.8 rounds in 1 and 3 runs of 10).
    ROUND_SHARE = 0.5

    def __init__(self, setting: int | str | None, tp=None, layers: int | None = None):
        """layers: the target's decoder layers, when a chunk's forward can be spread over steps
        (models.llama.forward_layers); None when it cannot (an encoder-decoder's prefill is cut
        by encoder blocks instead)."""
        self.setting, self.tp, self.layers = setting, tp, layers
        self.prefill_s_per_token: float | None = None  # of chunks (see the module)
        self.round_s: float | None = None
        self._chunked = False  # whether the last budget given was a limit (next)

    def next(self, decoding: bool) -> PrefillShare:
        """What the next step may prefill; decoding: whether rows decode."""
        if self.setting != "auto":
            return PrefillShare(self.setting)
        tokens = layers = None
        if decoding:
            tokens = CHUNK
            if self.prefill_s_per_token is not None and self.round_s is not None:
                # the time a step's prefill may take, in chunks
                chunks = self.ROUND_SHARE * self.round_s / (self.prefill_s_per_token * CHUNK)
                if chunks >= 1 or self.layers is None:
                    tokens = max(1, round(chunks)) * CHUNK
                else:
                    layers = max(1, round(chunks * self.layers))
                    layers = None if layers >= self.layers else layers
            elif self.layers is not None:  # nothing measured: a quarter of a chunk, measured so
                layers = -(-self.layers // 4)
        if self.tp is not None:  # timings differ between ranks: rank 0's budget for all
            tokens, layers = self._rank0s(tokens), self._rank0s(layers)
        self._chunked = tokens is not None
        return PrefillShare(tokens, layers)

    def _rank0s(self, n: int | None) -> int | None:
        n = self.tp.broadcast_int(-1 if n is None else n)
        return None if n < 0 else n

    def observe_prefill(self, tokens: int, share: float, seconds: float):
        """A step's prefill worked on chunks of `tokens` prompt tokens, running `share` of their
        target layers (1.0: whole chunks), in `seconds` (draft model included), under the budget
        next() gave last."""
        # Shorter prompts take other products (ops.product), and unlimited steps prefill whole
        # prompts: neither is the chunks' pace.
        if self._chunked and tokens >= CHUNK and share > 0:
            rate = seconds / (tokens * share)
            old = self.prefill_s_per_token
            self.prefill_s_per_token = rate if old is None or rate > old else self._smooth(old, rate)

    def observe_round(self, seconds: float):
        """A round of the decoding rows took `seconds`."""
        self.round_s = self._smooth(self.round_s, seconds)

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.WEIGHT * (new - old)
