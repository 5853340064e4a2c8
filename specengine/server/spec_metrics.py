"""A request's speculative statistics as a response carries them: vLLM's per-request object
(`metrics.speculative_decoding`, what `vllm serve --per-request-spec-decode-metrics summary`
returns, read by tools such as AIPerf), with specengine's counts by draft position and of every
round added under names of their own.

vLLM counts only verification steps that had drafts (its `num_spec_steps`); a round without
drafts (gamma="auto" at 0, an n-gram miss) is in `num_rounds` alone.
"""
from __future__ import annotations

from ..engine.request import DecodeStats


def speculative_decoding(stats: DecodeStats) -> dict:
    """The object for one request's stats (stats.gamma: the most drafts a round may propose)."""
    by_length = stats.accepted_histogram_by_draft_length
    histogram = [0] * (stats.gamma + 1)
    for row in by_length.values():
        for accepted, rounds in enumerate(row):
            histogram[accepted] += rounds
    steps = sum(histogram)
    return {
        # vLLM's fields, its definitions: drafts accepted exclude the bonus token each step adds.
        "mean_acceptance_length": 1.0 + stats.accepted / steps if steps else 1.0,
        "draft_acceptance_rate": stats.accepted / stats.drafted if stats.drafted else 0.0,
        "acceptance_histogram": histogram,
        "acceptance_histogram_by_draft_length": {str(k): list(row) for k, row in sorted(by_length.items())},
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": stats.accepted,
        "num_draft_tokens": stats.drafted,
        "num_spec_tokens": stats.gamma,
        # specengine's: every verification round, and drafts made and accepted at each position
        # (0-based; /metrics' spec_decode_num_*_tokens_per_pos for this request).
        "num_rounds": stats.rounds,
        "num_draft_tokens_per_pos": list(stats.drafted_by_position),
        "num_accepted_draft_tokens_per_pos": stats.accepted_by_position,
    }
