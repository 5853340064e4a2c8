"""GET /metrics: Prometheus' text format, parsed with prometheus_client's own parser. Counted from
fabricated outputs (what each output and each finish adds), then on a server on a loopback port
against the usage its responses reported, streamed and not, and for a client that went away."""
import asyncio
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specengine import Engine
from specengine.engine.request import DecodeStats, RequestOutput
from specengine.server.metrics import ServerMetrics

from server_util import CHATML, running_server

MODEL = "tiny-pair"
PROMPTS = ["def add(a, b):", "import os\n", "x = [1, 2,", "class Point:", "for i in range(", "# a comment\n"]


class Scrape:
    """One scrape: sample values by name and labels, and each family's type."""

    def __init__(self, text: str):
        self.samples, self.types = {}, {}
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for sample in family.samples:
                self.samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value

    def __call__(self, name: str, **labels) -> float:
        return self.samples["specengine:" + name, tuple(sorted(labels.items()))]

    def by_label(self, name: str, label: str) -> dict[str, float]:
        return {dict(labels)[label]: value for (n, labels), value in self.samples.items()
                if n == "specengine:" + name}

    def type_of(self, name: str) -> str:
        return self.types["specengine:" + name]

    def since(self, before: "Scrape") -> "Scrape":
        """What was counted between `before` and this scrape: each sample less its value then (gauges
        too, so compare those on the scrape itself). The module's server is shared by its tests, in
        whatever order they run, so a test compares counters as deltas, never against 0."""
        delta = Scrape("")
        delta.types = self.types
        delta.samples = {key: value - before.samples.get(key, 0.0) for key, value in self.samples.items()}
        return delta


def stats(prompt_tokens=0, generated=0, rounds=0, drafted=(), histogram=(), gamma=3) -> DecodeStats:
    """drafted: rounds by draft position; histogram: rounds by drafts accepted."""
    s = DecodeStats(gamma=gamma, prompt_tokens=prompt_tokens, generated_tokens=generated, rounds=rounds)
    if drafted:
        s.drafted_by_position, s.accepted_histogram = list(drafted), list(histogram)
        s.drafted, s.accepted = sum(drafted), sum(k * n for k, n in enumerate(histogram))
    return s


def test_outputs_and_finishes_are_counted():
    engine = SimpleNamespace(gamma=3, num_running=2, num_waiting=5)
    metrics = ServerMetrics(engine)
    before = Scrape(metrics.scrape().decode())
    assert before("request_success_total", finished_reason="stop") == 0
    assert before.by_label("spec_decode_num_accepted_tokens_per_pos_total", "position") == {"0": 0, "1": 0, "2": 0}
    assert before("num_requests_running") == 2 and before("num_requests_waiting") == 5

    metrics.added("a")
    s = stats(prompt_tokens=7)
    metrics.delivered([RequestOutput("a", [1, 2], "x", False, None, s)])
    time.sleep(0.01)
    metrics.delivered([RequestOutput("a", [3], "y", False, None, s), RequestOutput("b", [9], "z", False, None,
                                                                                     stats(prompt_tokens=4))])
    metrics.delivered([RequestOutput("a", [], "", False, None, s)])  # tokens held back: no gap measured
    # Three rounds: one of three drafts (all accepted), one of two (one accepted), one of none.
    final = stats(prompt_tokens=7, generated=5, rounds=3, drafted=[2, 2, 1], histogram=[1, 1, 0, 1])
    metrics.delivered([RequestOutput("a", [4], "w", True, "length", final)])
    metrics.delivered([RequestOutput("b", [], "", True, "abort", stats(prompt_tokens=4, generated=1))])

    got = Scrape(metrics.scrape().decode())
    assert got.type_of("prompt_tokens") == "counter" and got.type_of("time_to_first_token_seconds") == "histogram"
    assert got.type_of("num_requests_running") == "gauge" and got.type_of("spec_decode_gamma") == "histogram"
    assert got("prompt_tokens_total") == 11 and got("prompt_tokens_by_source_total", source="local_compute") == 11
    assert got("prompt_tokens_by_source_total", source="local_cache_hit") == 0
    # "a" delivered 4 tokens but finished with 5 (its usage's count): the counter takes the 5.
    assert got("generation_tokens_total") == 5 + 1
    # "b" was never added through the engine these metrics listen to: no time is measured for it.
    assert got("time_to_first_token_seconds_count") == 1 and got("e2e_request_latency_seconds_count") == 1
    assert got("inter_token_latency_seconds_count") == 2 and got("inter_token_latency_seconds_sum") >= 0.01
    assert got("e2e_request_latency_seconds_sum") >= got("time_to_first_token_seconds_sum") + 0.01
    assert got.by_label("request_success_total", "finished_reason") == {"stop": 0, "length": 1, "capacity": 0,
                                                                        "abort": 1}
    assert got("spec_decode_num_rounds_total") == 3 and got("spec_decode_num_drafts_total") == 2
    assert got("spec_decode_num_draft_tokens_total") == 5 and got("spec_decode_num_accepted_tokens_total") == 4
    assert got.by_label("spec_decode_num_draft_tokens_per_pos_total", "position") == {"0": 2, "1": 2, "2": 1}
    assert got.by_label("spec_decode_num_accepted_tokens_per_pos_total", "position") == {"0": 2, "1": 1, "2": 1}
    # Rounds by drafts proposed: one round of none, one of two, one of three.
    buckets = got.by_label("spec_decode_gamma_bucket", "le")
    assert buckets == {"0.0": 1, "1.0": 1, "2.0": 2, "3.0": 3, "+Inf": 3}
    assert got("spec_decode_gamma_count") == 3 and got("spec_decode_gamma_sum") == 5
    assert metrics._in_flight == {}  # nothing kept of finished requests


@pytest.fixture(scope="module")
def server(text_pair):
    """(base_url, AsyncEngine) of a server of its own: its counters count only this module's requests."""
    engine = Engine.from_pretrained(*text_pair, gamma=3, max_batch_size=4)
    engine.tokenizer.chat_template = CHATML
    with running_server(engine, MODEL) as (url, async_engine):
        yield url, async_engine


def scrape(base_url: str) -> Scrape:
    response = httpx.get(base_url + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return Scrape(response.text)


def test_metrics_agree_with_the_usage_the_responses_reported(server):
    base_url, async_engine = server
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    before = scrape(base_url)
    usages, reasons = [], []  # one usage per response; one finish reason per engine request

    # Not streamed: two prompts in one request, greedy.
    response = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=10, temperature=0.0)
    usages.append(response.usage)
    reasons += [c.finish_reason for c in response.choices]
    # A stop string from that greedy text ends the same request early.
    text = response.choices[0].text
    assert len(text) >= 4
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0.0,
                                         stop=[text[2:4]])
    usages.append(response.usage)
    reasons.append(response.choices[0].finish_reason)
    assert reasons[-1] == "stop"

    # Streamed: six at once on four rows (two wait), seeded.
    async def stream(client, i):
        chunks = await client.completions.create(model=MODEL, prompt=PROMPTS[i], stream=True, max_tokens=6 + 3 * i,
                                                 temperature=0.8, seed=i, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        usage, reason = None, None
        async for chunk in chunks:
            if chunk.choices:
                reason = chunk.choices[0].finish_reason or reason
            usage = chunk.usage or usage
        return usage, reason

    async def streams():
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        return await asyncio.gather(*(stream(client, i) for i in range(len(PROMPTS))))

    for usage, reason in asyncio.run(streams()):
        usages.append(usage)
        reasons.append(reason)

    # Chat, streamed and not.
    messages = [{"role": "user", "content": "Reverse a string."}]
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usage, reason = None, None
    for chunk in chunks:
        if chunk.choices:
            reason = chunk.choices[0].finish_reason or reason
        usage = chunk.usage or usage
    usages.append(usage)
    reasons.append(reason)
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.0)
    usages.append(response.usage)
    reasons.append(response.choices[0].finish_reason)

    now = scrape(base_url)
    got = now.since(before)
    requests = len(reasons)
    assert requests == 11 and all(u is not None for u in usages)
    assert got("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert got("prompt_tokens_by_source_total", source="local_compute") == got("prompt_tokens_total")
    generated = got("generation_tokens_total")
    assert generated == sum(u.completion_tokens for u in usages)
    # The server reports a full context as "length" too; none filled it here.
    assert got.by_label("request_success_total", "finished_reason") == {
        "stop": reasons.count("stop"), "length": reasons.count("length"), "capacity": 0, "abort": 0}
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert got(name + "_count") == requests and got(name + "_sum") > 0, name
        assert got(name + "_bucket", le="+Inf") == requests, name
    assert 0 < got("inter_token_latency_seconds_count") <= generated - requests
    assert got("e2e_request_latency_seconds_sum") > got("time_to_first_token_seconds_sum")

    drafted, accepted = got("spec_decode_num_draft_tokens_total"), got("spec_decode_num_accepted_tokens_total")
    per_pos = got.by_label("spec_decode_num_accepted_tokens_per_pos_total", "position")
    drafted_per_pos = got.by_label("spec_decode_num_draft_tokens_per_pos_total", "position")
    assert set(per_pos) == set(drafted_per_pos) == {"0", "1", "2"}
    assert sum(per_pos.values()) == accepted and sum(drafted_per_pos.values()) == drafted
    assert 0 < accepted <= drafted
    assert all(per_pos[p] <= drafted_per_pos[p] for p in per_pos)
    rounds = got("spec_decode_num_rounds_total")
    # Every round emits 1 to gamma + 1 tokens; rounds by drafts proposed add up to the drafts.
    assert generated / 4 <= rounds <= generated
    assert got("spec_decode_num_drafts_total") == drafted_per_pos["0"] <= rounds
    assert got("spec_decode_gamma_count") == rounds and got("spec_decode_gamma_sum") == drafted
    assert now("num_requests_running") == 0 and now("num_requests_waiting") == 0
    assert async_engine.listeners  # the server's metrics listen to its engine


def test_a_client_that_goes_away_is_counted_as_an_abort(server):
    base_url, async_engine = server
    before = scrape(base_url)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=400, temperature=1.0, seed=1,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 20
    aborts = before("request_success_total", finished_reason="abort")
    while (got := scrape(base_url))("request_success_total", finished_reason="abort") == aborts:
        assert time.monotonic() < deadline, "the abort was not counted"
        time.sleep(0.05)
    assert got("e2e_request_latency_seconds_count") == before("e2e_request_latency_seconds_count") + 1
    assert got("time_to_first_token_seconds_count") == before("time_to_first_token_seconds_count") + 1
    assert 0 < got("generation_tokens_total") - before("generation_tokens_total") < 400
    assert got("num_requests_running") == 0 and got("num_requests_waiting") == 0
