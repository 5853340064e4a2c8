"""Per-request sampling parameters, validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_SEED = 2**63 - 1
# The most alternatives a position reports (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Defaults follow Hugging Face / vLLM conventions.

    temperature 0 is greedy. top_k 0 and top_p 1 and min_p 0 switch those warps off.
    Warps apply in the order temperature, top-k, top-p, min-p, identically to the
    target's and the draft's distributions. seed makes a request reproducible and
    independent of the batch it runs in. stop strings end the text before them.

    logprobs k (None: off) reports, for each generated token, its log-probability and the k most
    probable tokens at its position (0 <= k <= MAX_LOGPROBS), under the target's distribution
    after these warps: what target-only decoding samples from (greedy: the unwarped
    log-softmax, as vLLM reports). prompt_logprobs k does the same for every prompt token but
    the first (a decoder-only target's; an echo of the prompt).
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None (off) or an integer in [0, {MAX_LOGPROBS}]: the log-probability "
                                 f"of each token and that many alternatives, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
