"""How many prompt tokens a step may prefill (EngineConfig.prefill_chunk_tokens).

A joining request's prompt is prefilled a chunk a step, in the same step as a round of the rows
already decoding (engine.batch), so that those rows are held up by one chunk, not by the whole
prompt. The budget is the tokens of all of a step's chunks:

  an int   that many tokens a step, a multiple of CHUNK (chunks end on its multiples);
  None     no limit: every joining prompt is prefilled whole in its first step;
  "auto"   no limit while nothing decodes (nobody waits); while rows decode, what the prefill runs
           in about the time of a round, in multiples of CHUNK (at least one): a decoding row's step
           then takes about twice its round, and a prompt joins at about half the machine's prefill
           speed. Both times are measured as they run, so the budget follows the device, the
           models and the batch. With a split target every rank takes rank 0's budget (the ranks'
           calls must match).
"""
from __future__ import annotations

from ..layers.linear import GEMM_ROWS

# Chunks are multiples of this many tokens: the fewest per row whose products take a prefill's
# GEMM path (layers.linear), which every chunk of a long prompt must take (steps.feed.prefill_chunks).
# The prefix cache's blocks are multiples of it too.
CHUNK = GEMM_ROWS


class PrefillBudget:
    # Smoothing of the measured times (the weight of the newest).
    WEIGHT = 0.3

    def __init__(self, setting: int | str | None, tp=None):
        self.setting, self.tp = setting, tp
        self.prefill_s_per_token: float | None = None
        self.round_s: float | None = None

    def next(self, decoding: bool) -> int | None:
        """The budget of the next step's prefill (None: no limit); decoding: whether rows decode."""
        if self.setting != "auto":
            return self.setting
        if not decoding:
            budget = None
        elif self.prefill_s_per_token is None or self.round_s is None:
            budget = CHUNK
        else:
            budget = max(1, round(self.round_s / self.prefill_s_per_token / CHUNK)) * CHUNK
        if self.tp is not None:  # timings differ between ranks: rank 0's budget for all
            budget = self.tp.broadcast_int(-1 if budget is None else budget)
            budget = None if budget < 0 else budget
        return budget

    def observe_prefill(self, tokens: int, seconds: float):
        """A step's prefill of `tokens` prompt tokens took `seconds` (draft model included)."""
        if tokens >= CHUNK:  # shorter prompts take other products (layers.linear): not the chunks' pace
            self.prefill_s_per_token = self._smooth(self.prefill_s_per_token, seconds / tokens)

    def observe_round(self, seconds: float):
        """A round of the decoding rows took `seconds`."""
        self.round_s = self._smooth(self.round_s, seconds)

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.WEIGHT * (new - old)
