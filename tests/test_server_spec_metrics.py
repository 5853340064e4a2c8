"""Each request's speculative statistics in the server's responses, in vLLM's per-request object
(`metrics.speculative_decoding`): its fields from a request's DecodeStats, and through the HTTP
server and the openai client (extra fields in `model_extra`), completions and chat, streamed (on
the final usage chunk) and not, with a draft identical to its target (every draft accepted at
T=0) and with a weaker draft (the figures of the same request offline)."""
import openai
import pytest

from specengine import Engine, SamplingParams
from specengine.engine.outputs import Outputs
from specengine.engine.request import DecodeStats, Request
from specengine.engine.rounds import RoundResult
from specengine.server.spec_metrics import speculative_decoding

from server_util import running_server, with_chat_template

MODEL = "tiny"
VLLM_FIELDS = ("mean_acceptance_length", "draft_acceptance_rate", "acceptance_histogram",
               "acceptance_histogram_by_draft_length", "num_spec_steps", "num_accepted_draft_tokens",
               "num_draft_tokens", "num_spec_tokens")


def test_the_object_from_a_requests_rounds():
    """Rounds of known drafts and acceptances (gamma 4): one without drafts, and drafts of 4, 4, 2, 3."""
    outputs = Outputs(None, (), 1000)
    r = Request("r", [1, 2], SamplingParams(max_new_tokens=100, ignore_eos=True), 0, DecodeStats(gamma=4))
    for emitted, drafted in ((1, 0), (5, 4), (2, 4), (3, 2), (1, 3)):
        outputs.apply(r, RoundResult(tokens=[7] * emitted, emitted=[emitted], drafted=[drafted], draft_calls=drafted))
    got = speculative_decoding(r.stats)
    assert got == {
        "mean_acceptance_length": 1 + 7 / 4,       # 4 + 1 + 2 + 0 accepted over the 4 rounds that drafted
        "draft_acceptance_rate": 7 / 13,
        "acceptance_histogram": [1, 1, 1, 0, 1],   # rounds that accepted 0 ... 4 drafts
        "acceptance_histogram_by_draft_length": {"2": [0, 0, 1], "3": [1, 0, 0, 0], "4": [0, 1, 0, 0, 1]},
        "num_spec_steps": 4,
        "num_accepted_draft_tokens": 7,
        "num_draft_tokens": 13,
        "num_spec_tokens": 4,
        "num_rounds": 5,
        "num_draft_tokens_per_pos": [4, 4, 3, 2],
        "num_accepted_draft_tokens_per_pos": [3, 2, 1, 1],
    }
    # A request that never drafted: vLLM's zero-step figures, no division by zero.
    none = speculative_decoding(DecodeStats(gamma=2, rounds=3))
    assert none["mean_acceptance_length"] == 1.0 and none["draft_acceptance_rate"] == 0.0
    assert none["acceptance_histogram"] == [0, 0, 0] and none["num_spec_steps"] == 0 and none["num_rounds"] == 3


@pytest.fixture(scope="module")
def self_draft(text_pair):
    """A pair whose draft is its target: at T=0 every draft is accepted."""
    return with_chat_template(Engine.from_pretrained(text_pair[0], text_pair[0], gamma=3))


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def spec(extra: dict | None) -> dict:
    assert extra is not None and set(extra) >= {"metrics"}, f"no metrics in {extra}"
    return extra["metrics"]["speculative_decoding"]


def assert_all_accepted(s: dict, completion_tokens: int):
    assert s["num_spec_tokens"] == 3 and s["num_draft_tokens"] > 0
    assert s["num_accepted_draft_tokens"] == s["num_draft_tokens"] and s["draft_acceptance_rate"] == 1.0
    # Each round accepted all it drafted: its row's last bucket.
    for k, row in s["acceptance_histogram_by_draft_length"].items():
        assert row[:-1] == [0] * int(k) and row[-1] > 0
    # Rounds near max_tokens draft fewer, the last perhaps none (a round, not a spec step).
    assert s["num_spec_steps"] == sum(s["acceptance_histogram"]) >= s["num_rounds"] - 1
    assert s["mean_acceptance_length"] == 1 + s["num_accepted_draft_tokens"] / s["num_spec_steps"]
    assert s["num_accepted_draft_tokens_per_pos"] == s["num_draft_tokens_per_pos"]
    # Every token came from a round: its bonus token or an accepted draft.
    assert completion_tokens == s["num_rounds"] + s["num_accepted_draft_tokens"]


def test_a_draft_equal_to_its_target_accepts_everything_in_every_response(self_draft):
    greedy = dict(temperature=0, extra_body={"ignore_eos": True})
    with running_server(self_draft, MODEL) as (url, _):
        client = client_of(url)
        done = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=23, **greedy)
        whole = spec(done.model_extra)
        assert_all_accepted(whole, done.usage.completion_tokens)
        assert set(whole) >= set(VLLM_FIELDS)

        chunks = list(client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=23, stream=True,
                                                stream_options={"include_usage": True}, **greedy))
        # Only the last chunk (the usage, no choices) carries them, as vLLM's stream does.
        assert all("metrics" not in (c.model_extra or {}) for c in chunks[:-1])
        assert chunks[-1].choices == [] and spec(chunks[-1].model_extra) == whole

        # Without include_usage a stream has no usage chunk, and so no metrics (vLLM's too).
        plain = list(client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=23, stream=True,
                                               **greedy))
        assert all("metrics" not in (c.model_extra or {}) for c in plain)

        messages = [{"role": "user", "content": "Say something."}]
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=17, **greedy)
        assert_all_accepted(spec(chat.model_extra), chat.usage.completion_tokens)
        chat_chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=17, stream=True,
                                                          stream_options={"include_usage": True}, **greedy))
        assert chat_chunks[-1].choices == [] and spec(chat_chunks[-1].model_extra) == spec(chat.model_extra)

        # A response of several generations: null, as vLLM's for n > 1.
        two = client.completions.create(model=MODEL, prompt=["def f(", "x = "], max_tokens=5, **greedy)
        assert len(two.choices) == 2 and two.model_extra["metrics"] == {"speculative_decoding": None}


def test_a_weaker_draft_reports_the_requests_own_figures(text_pair):
    """Seeded at T=1 with a draft that is not its target: some drafts rejected, at every position
    the figures the same request has offline."""
    engine = Engine.from_pretrained(*text_pair, gamma=4)
    params = dict(max_tokens=40, temperature=1.0, seed=11)
    offline = Engine.from_pretrained(*text_pair, gamma=4).generate(
        ["import os\n"], SamplingParams(max_new_tokens=40, temperature=1.0, seed=11, ignore_eos=True))[0]
    with running_server(engine, MODEL) as (url, _):
        client = client_of(url)
        done = client.completions.create(model=MODEL, prompt="import os\n", extra_body={"ignore_eos": True}, **params)
        chunks = list(client.completions.create(model=MODEL, prompt="import os\n", stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}, **params))
    got = spec(done.model_extra)
    assert done.choices[0].text == offline.text
    assert got == speculative_decoding(offline.stats) == spec(chunks[-1].model_extra)
    assert 0 < got["num_accepted_draft_tokens"] < got["num_draft_tokens"] == offline.stats.drafted
    assert got["num_draft_tokens_per_pos"] == offline.stats.drafted_by_position
    assert got["num_accepted_draft_tokens_per_pos"] == offline.stats.accepted_by_position


def test_target_only_responses_have_no_speculative_metrics(text_pair):
    with running_server(Engine.from_pretrained(text_pair[0]), MODEL) as (url, _):
        done = client_of(url).completions.create(model=MODEL, prompt="x", max_tokens=4)
    assert "metrics" not in (done.model_extra or {})
