"""The server's Prometheus metrics (GET /metrics, in Prometheus' text format).

Named as vLLM names the same figures, under a `specengine:` prefix in place of `vllm:`, so that a
dashboard built for vLLM reads them with the prefix changed; what vLLM has no figure for is named in
its manner. Counters are exposed with the `_total` suffix Prometheus gives them. Each server has a
registry of its own (not prometheus_client's global one): tests run several servers in one process.

What is counted, and when:
- as outputs are delivered (AsyncEngine's listeners see every output, a request's last one even
  when its client has gone): prompt tokens (at a request's first output: by source, computed or
  from the prefix cache, and the prefix cache's queries and hits), generation tokens, time to
  first token (from AsyncEngine.add_request to the first output carrying tokens), the gaps between
  a request's outputs that carry tokens (one round: 1..gamma+1 tokens; a block of rounds with
  rounds_per_read > 1);
- when a request finishes: its finish reason, its latency, and its speculative-decoding counters
  from its final DecodeStats (rounds, drafts, acceptances by draft position, drafts per round);
- at each scrape: the requests running and waiting, read from the engine;
- as the server refuses them (server/limits.py), requests refused, by reason. A refused request
  never reaches the engine: none of the figures above counts it.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from ..engine.engine import Engine
from ..engine.request import FINISH_REASONS, DecodeStats, RequestOutput
from .limits import REFUSAL_REASONS

PREFIX = "specengine:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds: from a GPU's round of a few milliseconds to a long answer on a CPU.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                       5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0)
# Where prompt tokens come from, as vLLM's prompt_tokens_by_source labels them: prefilled, or copied
# from the prefix cache (engine.prefix_cache).
PROMPT_SOURCES = ("local_compute", "local_cache_hit")


@dataclass
class _InFlight:
    """What the metrics know of a request not yet finished."""
    added_at: float | None        # perf_counter() at add_request; None if added before they listened
    last_tokens_at: float | None = None  # when its last output carrying tokens was delivered
    generation_tokens: int = 0    # its tokens counted so far
    prompt_counted: bool = False


class ServerMetrics:
    """The metrics of one server over one engine: an AsyncEngine listener (added(), delivered())
    and scrape() for GET /metrics. Used from the event loop's thread, as the engine is."""

    def __init__(self, engine: Engine):
        self.registry = registry = CollectorRegistry()
        self._in_flight: dict[str, _InFlight] = {}
        self.max_gamma = engine.gamma  # 0 without a drafter; max_gamma with gamma="auto"

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=registry)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=registry)

        Gauge(PREFIX + "num_requests_running", "Requests holding a row of the running batch: decoding, or "
              "being prefilled.",
              registry=registry).set_function(lambda: engine.num_running)
        Gauge(PREFIX + "num_requests_waiting", "Requests waiting for a row of the running batch.",
              registry=registry).set_function(lambda: engine.num_waiting)
        self.request_success = counter("request_success", "Finished requests, by finish reason (the engine's: "
                                       "capacity is a full context, abort an aborted or failed request).",
                                       ("finished_reason",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests (counted at their first output).")
        self.prompt_tokens_by_source = counter("prompt_tokens_by_source",
                                               "Prompt tokens by where their KV came from.", ("source",))
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens of the requests, looked up in "
                                            "the prefix cache (counted at their first output).")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens whose keys and values came from the "
                                         "prefix cache.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.ttft = histogram("time_to_first_token_seconds",
                              "Time from a request's arrival to its first output carrying tokens.", TTFT_BUCKETS)
        self.inter_token = histogram("inter_token_latency_seconds",
                                     "Time between a request's successive outputs carrying tokens (one round: "
                                     "1 to gamma + 1 tokens).", INTER_TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from a request's arrival to its last output.",
                             E2E_BUCKETS)
        self.rounds = counter("spec_decode_num_rounds", "Rounds: target verification calls, drafting or not "
                              "(generation_tokens over them is the tokens per target call).")
        self.drafts = counter("spec_decode_num_drafts", "Rounds that drafted at least one token.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (0-based).", ("position",))
        self.draft_tokens_per_pos = counter("spec_decode_num_draft_tokens_per_pos",
                                            "Draft tokens proposed at each draft position (0-based): acceptance "
                                            "at a position is accepted_tokens_per_pos over this.", ("position",))
        self.requests_refused = counter("requests_refused", "HTTP requests the server refused before they reached "
                                        "the engine, by reason (see server/limits.py).", ("reason",))
        self.rounds_by_gamma = _RoundsByGamma(self.max_gamma)
        registry.register(self.rounds_by_gamma)
        # Every label value known in advance is exposed from the start (at 0), as a rate needs.
        for reason in FINISH_REASONS:
            self.request_success.labels(reason)
        for source in PROMPT_SOURCES:
            self.prompt_tokens_by_source.labels(source)
        for reason in REFUSAL_REASONS:
            self.requests_refused.labels(reason)
        for position in range(self.max_gamma):
            self.accepted_per_pos.labels(str(position))
            self.draft_tokens_per_pos.labels(str(position))

    def refused(self, reason: str):
        """An HTTP request refused by a limit (one of REFUSAL_REASONS)."""
        self.requests_refused.labels(reason).inc()

    # ---- the AsyncEngine listener ---------------------------------------------------------------

    def added(self, request_id: str):
        self._in_flight[request_id] = _InFlight(added_at=time.perf_counter())

    def delivered(self, outputs: list[RequestOutput]):
        now = time.perf_counter()
        for out in outputs:
            request = self._in_flight.get(out.request_id)
            if request is None:
                request = self._in_flight[out.request_id] = _InFlight(added_at=None)
            if not request.prompt_counted:
                request.prompt_counted = True
                cached = out.stats.cached_prompt_tokens
                self.prompt_tokens.inc(out.stats.prompt_tokens)
                self.prompt_tokens_by_source.labels("local_compute").inc(out.stats.prompt_tokens - cached)
                self.prompt_tokens_by_source.labels("local_cache_hit").inc(cached)
                self.prefix_cache_queries.inc(out.stats.prompt_tokens)
                self.prefix_cache_hits.inc(cached)
            if out.new_token_ids:
                request.generation_tokens += len(out.new_token_ids)
                self.generation_tokens.inc(len(out.new_token_ids))
                if request.last_tokens_at is not None:
                    self.inter_token.observe(now - request.last_tokens_at)
                elif request.added_at is not None:
                    self.ttft.observe(now - request.added_at)
                request.last_tokens_at = now
            if out.finished:
                del self._in_flight[out.request_id]
                self._finished(out, request, now)

    def _finished(self, out: RequestOutput, request: _InFlight, now: float):
        s = out.stats
        # The request's tokens are those its outputs carried; should its count say more, it is
        # the count that the response's usage reports.
        if s.generated_tokens > request.generation_tokens:
            self.generation_tokens.inc(s.generated_tokens - request.generation_tokens)
        self.request_success.labels(out.finish_reason or "abort").inc()
        if request.added_at is not None:
            self.e2e.observe(now - request.added_at)
        self._count_rounds(s)

    def _count_rounds(self, s: DecodeStats):
        self.rounds.inc(s.rounds)
        self.draft_tokens.inc(s.drafted)
        self.accepted_tokens.inc(s.accepted)
        for position, (drafted, accepted) in enumerate(zip(s.drafted_by_position, s.accepted_by_position)):
            self.draft_tokens_per_pos.labels(str(position)).inc(drafted)
            self.accepted_per_pos.labels(str(position)).inc(accepted)
        self.drafts.inc(s.drafted_by_position[0] if s.drafted_by_position else 0)
        # Rounds by drafts proposed: those that drafted at least g, less those that drafted more.
        at_least = [s.rounds, *s.drafted_by_position, 0]
        for gamma in range(len(at_least) - 1):
            self.rounds_by_gamma.add(gamma, at_least[gamma] - at_least[gamma + 1])

    def scrape(self) -> bytes:
        """Every metric, in Prometheus' text format (CONTENT_TYPE)."""
        return generate_latest(self.registry)


class _RoundsByGamma:
    """The histogram spec_decode_gamma: rounds by drafts proposed (the gamma chosen for the round;
    fewer near a request's token limit, or where a model-free drafter finds fewer). A collector of
    its own because a finished request brings all its rounds at once, and prometheus_client's
    Histogram takes one observation a call."""

    NAME = PREFIX + "spec_decode_gamma"
    DOC = "Rounds by draft tokens proposed: the gamma chosen for each round."

    def __init__(self, max_gamma: int):
        self.rounds = [0] * (max_gamma + 1)  # by drafts proposed

    def add(self, gamma: int, rounds: int):
        self.rounds[gamma] += rounds

    def describe(self):
        return [HistogramMetricFamily(self.NAME, self.DOC)]

    def collect(self):
        family = HistogramMetricFamily(self.NAME, self.DOC)
        cumulative = list(itertools.accumulate(self.rounds))
        buckets = [(floatToGoString(g), n) for g, n in enumerate(cumulative)] + [("+Inf", cumulative[-1])]
        family.add_metric([], buckets, sum_value=sum(g * n for g, n in enumerate(self.rounds)))
        yield family
