"""How an Engine decodes: every option in one place, checked when it is made."""
from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from ..ops.product import GEMM_MIN_TOKENS_PER_ROW
from ..ops.verify import IMPLEMENTATIONS
from .prefill_budget import CHUNK

# The most draft tokens a round may verify: a verification's gamma + 1 tokens per row stay below
# the GEMM threshold, so that every verification takes the decode path and a row's logits are
# the bits target-only decoding computes (greedy output token-identical to it).
MAX_GAMMA = GEMM_MIN_TOKENS_PER_ROW - 2


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class EngineConfig:
    """gamma: "auto" (default) to choose the draft tokens of every round (up to max_gamma, one
    value for the batch; 0, target-only decoding, where drafting does not pay) from step costs
    measured on this machine and each request's running acceptance rate, or a fixed number of
    draft tokens per round; gamma and max_gamma at most MAX_GAMMA. Without a drafter every round
    is target-only and gamma is not used.
    max_seq_len: the context a request may fill (default: the target's).
    eos_token_ids: tokens that end a request (default: the target config's, else the tokenizer's).
    verify_impl: "auto" (C++ on CPU, Triton on CUDA), "cpp", "triton" or "reference" (plain torch).
    nvtx: mark the prefill, draft, verify (target forward) and accept phases for Nsight Systems.
    time_phases: time those phases; each run's totals land in Engine.last_run_phases.
    cuda_graphs: run the target's verifications and the draft model's steps as fixed-shape steps
    on persistent caches of max_batch_size rows (steps.graphs), replayed from CUDA graphs on a
    GPU; on a CPU the same path runs eagerly.
    max_batch_size: the most requests decoding at once (default 8 with cuda_graphs, otherwise no
    limit: the cache grows as requests join); the others wait in arrival order.
    rounds_per_read: with cuda_graphs, run up to this many rounds from device state before reading
    their results back (a block, engine.rounds); tokens are the same as round by round. Its old
    name, check_every, is still accepted (with a DeprecationWarning).
    prefill_chunk_tokens: prompt tokens a step prefills while other requests decode (prefilling
    prompts are prefilled a chunk a step, interleaved with the rounds): "auto" (measured: about a
    round's time of prefill; no limit while nothing decodes), a multiple of prefill_budget.CHUNK
    (the GEMM threshold, 32 tokens), or None (0): each prompt whole in the step it joins
    (engine.prefill_budget). Tokens are the same either way.
    prefix_cache_bytes: memory for the prefix cache, which keeps the target's and the draft
    model's keys and values of prompts' blocks of prefix_cache.BLOCK tokens for later requests starting alike
    (engine.prefix_cache; decoder-only targets): "auto" (512 MiB on a CPU, a tenth of a GPU's
    memory) or bytes (0: off). Tokens are the same either way."""
    gamma: int | str = "auto"
    max_gamma: int = 8
    max_seq_len: int | None = None
    eos_token_ids: tuple[int, ...] | None = None
    verify_impl: str = "auto"
    nvtx: bool = False
    time_phases: bool = False
    cuda_graphs: bool = False
    max_batch_size: int | None = None
    rounds_per_read: int = 1
    prefill_chunk_tokens: int | str | None = "auto"
    prefix_cache_bytes: int | str = "auto"

    def __post_init__(self):
        if self.gamma != "auto" and not (_positive_int(self.gamma) and self.gamma <= MAX_GAMMA):
            raise ValueError(f"gamma must be an integer in [1, {MAX_GAMMA}] (MAX_GAMMA: a verification of gamma + 1 "
                             f"tokens per row stays below the GEMM threshold) or 'auto' when drafting, "
                             f"got {self.gamma!r}")
        if not (_positive_int(self.max_gamma) and self.max_gamma <= MAX_GAMMA):
            raise ValueError(f"max_gamma must be an integer in [1, {MAX_GAMMA}] (MAX_GAMMA: a verification of "
                             f"gamma + 1 tokens per row stays below the GEMM threshold), got {self.max_gamma!r}")
        if self.max_seq_len is not None and not (isinstance(self.max_seq_len, int) and self.max_seq_len >= 2):
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.eos_token_ids is not None:
            if not isinstance(self.eos_token_ids, Sequence) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.eos_token_ids):
                raise ValueError(f"eos_token_ids must be token ids, got {self.eos_token_ids!r}")
            object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        if self.verify_impl not in IMPLEMENTATIONS:
            raise ValueError(f"verify_impl must be one of {IMPLEMENTATIONS}, got {self.verify_impl!r}")
        if not _positive_int(self.rounds_per_read):
            raise ValueError(f"rounds_per_read must be a positive integer, got {self.rounds_per_read!r}")
        if self.rounds_per_read > 1 and not self.cuda_graphs:
            raise ValueError("rounds_per_read > 1 runs rounds from device state on the fixed-shape steps: "
                             "it needs cuda_graphs=True")
        if self.max_batch_size is None and self.cuda_graphs:
            object.__setattr__(self, "max_batch_size", 8)
        if self.max_batch_size is not None and not _positive_int(self.max_batch_size):
            raise ValueError(f"max_batch_size must be a positive integer, got {self.max_batch_size!r}")
        chunk = self.prefill_chunk_tokens
        if chunk == 0:
            object.__setattr__(self, "prefill_chunk_tokens", None)
        elif chunk is not None and chunk != "auto" and not (_positive_int(chunk) and chunk % CHUNK == 0):
            raise ValueError(f"prefill_chunk_tokens must be 'auto', None (0: whole prompts) or a positive multiple "
                             f"of {CHUNK}, got {chunk!r}")
        cache = self.prefix_cache_bytes
        if cache != "auto" and not (isinstance(cache, int) and not isinstance(cache, bool) and cache >= 0):
            raise ValueError(f"prefix_cache_bytes must be 'auto' or a number of bytes >= 0 (0: off), got {cache!r}")



# ---- check_every: rounds_per_read's old name, still accepted (EngineConfig, Engine and
# Engine.from_pretrained keywords) and read, with a DeprecationWarning

def _warn_check_every():
    # Pointed at the first caller outside specengine: the user's call, which is what must change.
    level, frame = 3, sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("specengine."):
        level, frame = level + 1, frame.f_back
    warnings.warn("check_every is now called rounds_per_read", DeprecationWarning, stacklevel=level)


def _accepting_check_every(init):
    @functools.wraps(init)
    def __init__(self, *args, check_every: int | None = None, **kwargs):
        if check_every is not None:
            _warn_check_every()
            if "rounds_per_read" in kwargs:
                raise ValueError("pass rounds_per_read (check_every is its old name), not both")
            kwargs["rounds_per_read"] = check_every
        init(self, *args, **kwargs)
    return __init__


def _check_every(config: EngineConfig) -> int:
    _warn_check_every()
    return config.rounds_per_read


EngineConfig.__init__ = _accepting_check_every(EngineConfig.__init__)
EngineConfig.check_every = property(_check_every, doc="rounds_per_read's old name (deprecated)")
