"""The server's access and limits (server/limits.py), over HTTP on a loopback port: raw requests
(httpx, and a socket where httpx would send what it announces) and the official openai client.
The API key (401 everywhere but /health and /metrics; /metrics too with protect_metrics), the
body's size (413, from Content-Length before the body is read, and for a body streamed without
one), prompts and stop strings per request and the context (400, or max_tokens clamped), a full
waiting queue (503 with Retry-After, made deterministic by holding the engine's steps), and each
refusal counted in /metrics by reason. Then `specengine serve`: its flags, $SPECENGINE_API_KEY,
and a key that appears in no log line."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specengine import Engine
from specengine.cli import API_KEY_VARIABLE, _server_limits, build_parser
from specengine.server.limits import REFUSAL_REASONS, ServerLimits

from server_util import free_port, held_steps, running_server, with_chat_template

MODEL = "tiny-pair"
KEY = "sk-test-5f0c9a2e7b41"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 128  # each engine's max_seq_len: the tiny pair's context is 512, and runs to its end cost time
MESSAGES = [{"role": "user", "content": "Reverse a string."}]


def engine_of(text_pair, max_batch_size: int) -> Engine:
    return with_chat_template(Engine.from_pretrained(*text_pair, gamma=3, max_batch_size=max_batch_size,
                                                     max_seq_len=CONTEXT))


@pytest.fixture(scope="module")
def guarded(text_pair):
    """(base_url, AsyncEngine) of a server with a key, one row, one waiting request at most and
    bodies of 4 KiB at most."""
    limits = ServerLimits(api_key=KEY, max_waiting=1, max_body_bytes=4096)
    with running_server(engine_of(text_pair, max_batch_size=1), MODEL, limits) as served:
        yield served


@pytest.fixture(scope="module")
def limited(text_pair):
    """(base_url, AsyncEngine) of a server without a key, taking 3 prompts and 2 stop strings a
    request, its other limits the defaults."""
    limits = ServerLimits(max_prompts_per_request=3, max_stop_strings=2)
    with running_server(engine_of(text_pair, max_batch_size=4), MODEL, limits) as served:
        yield served


def client_of(base_url: str, api_key: str = "unused", timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)


def scrape(base_url: str, headers: dict | None = None) -> dict[tuple[str, tuple], float]:
    response = httpx.get(base_url + "/metrics", headers=headers)
    assert response.status_code == 200
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def refusals(base_url: str, headers: dict | None = None) -> dict[str, float]:
    return {dict(labels)["reason"]: value for (name, labels), value in scrape(base_url, headers).items()
            if name == "specengine:requests_refused_total"}


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    """The status, OpenAI's error shape, and the key in no part of it."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert (error["param"], error["code"]) == (param, code)
    assert KEY not in response.text and KEY not in str(response.headers)
    return error


# ---- the limits themselves --------------------------------------------------------------------


@pytest.mark.parametrize("fields, message", [
    (dict(api_key=""), "api_key must be a non-empty string of printable ASCII"),
    (dict(api_key="two words"), "api_key must be a non-empty string of printable ASCII"),
    (dict(api_key="clé-secrète"), "api_key must be a non-empty string of printable ASCII"),
    (dict(protect_metrics=True), "protect_metrics needs an api_key"),
    (dict(max_waiting=-1), "max_waiting must be an integer >= 0, got -1"),
    (dict(max_waiting=1.5), "max_waiting must be an integer >= 0, got 1.5"),
    (dict(max_body_bytes=0), "max_body_bytes must be an integer >= 1, got 0"),
    (dict(max_prompts_per_request=0), "max_prompts_per_request must be an integer >= 1, got 0"),
    (dict(max_stop_strings=-1), "max_stop_strings must be an integer >= 0, got -1"),
])
def test_bad_limits_are_refused_naming_the_field_and_never_the_key(fields, message):
    with pytest.raises(ValueError) as caught:
        ServerLimits(**fields)
    assert str(caught.value).startswith(message)
    if fields.get("api_key"):
        assert fields["api_key"] not in str(caught.value)


def test_the_key_is_in_no_repr():
    limits = ServerLimits(api_key=KEY, protect_metrics=True)
    assert KEY not in repr(limits) and KEY not in str(limits) and "protect_metrics=True" in repr(limits)


# ---- the API key ------------------------------------------------------------------------------


def test_without_the_key_every_endpoint_but_health_and_metrics_answers_401(guarded):
    base_url, async_engine = guarded
    before, steps = refusals(base_url), async_engine.steps
    completion = dict(model=MODEL, prompt="x = ", max_tokens=2)
    endpoints = [("GET", "/v1/models", None), ("POST", "/v1/completions", completion),
                 ("POST", "/v1/chat/completions", dict(model=MODEL, messages=MESSAGES, max_tokens=2)),
                 ("GET", "/v1/nowhere", None), ("GET", "/openapi.json", None)]
    wrong = [{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Bearer {KEY[:-1]}"},
             {"Authorization": f"Bearer {KEY}0"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
             {"Authorization": "Bearer"}, {"X-Api-Key": KEY}]
    for method, path, body in endpoints:
        for headers in wrong:
            response = httpx.request(method, base_url + path, json=body, headers=headers)
            error = assert_openai_error(response, 401, code="invalid_api_key")
            assert "Authorization: Bearer" in error["message"]
            assert response.headers["www-authenticate"] == "Bearer"
    assert not async_engine.engine.has_unfinished_requests() and async_engine.steps == steps  # nothing reached it
    # With the key (the scheme in any case):
    assert httpx.get(base_url + "/v1/models", headers=AUTH).json()["data"][0]["id"] == MODEL
    response = httpx.post(base_url + "/v1/completions", json=completion, headers={"Authorization": f"bearer {KEY}"})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(base_url + "/v1/nowhere", headers=AUTH).status_code == 404
    # Probes and scrapes carry no key.
    assert httpx.get(base_url + "/health").json()["status"] == "ok"
    after = refusals(base_url)
    assert after["unauthorized"] - before["unauthorized"] == len(endpoints) * len(wrong)
    assert all(after[reason] == before[reason] for reason in REFUSAL_REASONS if reason != "unauthorized")


def test_the_openai_client_is_served_with_the_key_and_refused_with_another(guarded):
    base_url, _ = guarded
    wrong = client_of(base_url, api_key="sk-not-the-key")
    for call in (lambda c: c.models.list(),
                 lambda c: c.completions.create(model=MODEL, prompt="x = ", max_tokens=2),
                 lambda c: c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)):
        with pytest.raises(openai.AuthenticationError) as caught:
            call(wrong)
        assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    right = client_of(base_url, api_key=KEY)
    assert [m.id for m in right.models.list().data] == [MODEL]
    # ignore_eos: these sample, and a drawn end-of-sequence would end them before their lengths.
    assert right.completions.create(model=MODEL, prompt="x = ", max_tokens=2,
                                    extra_body={"ignore_eos": True}).usage.completion_tokens == 2
    stream = right.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True,
                                           extra_body={"ignore_eos": True})
    assert [chunk.choices[0].finish_reason for chunk in stream][-1] == "length"


def test_protect_metrics_makes_metrics_need_the_key_too(text_pair):
    limits = ServerLimits(api_key=KEY, protect_metrics=True)
    with running_server(engine_of(text_pair, max_batch_size=1), MODEL, limits) as (base_url, _):
        assert_openai_error(httpx.get(base_url + "/metrics"), 401, code="invalid_api_key")
        assert_openai_error(httpx.get(base_url + "/metrics", headers={"Authorization": "Bearer x"}), 401,
                            code="invalid_api_key")
        assert httpx.get(base_url + "/health").status_code == 200
        # Every reason is there from the start (a rate needs it), the two 401s counted.
        assert refusals(base_url, AUTH) == {reason: 2 if reason == "unauthorized" else 0 for reason in REFUSAL_REASONS}


def test_without_a_key_no_endpoint_needs_one(limited):
    base_url, _ = limited
    assert httpx.get(base_url + "/v1/models").status_code == 200
    response = httpx.post(base_url + "/v1/completions", json=dict(model=MODEL, prompt="x = ", max_tokens=2),
                          headers={"Authorization": "Bearer anything"})
    assert response.status_code == 200


# ---- the body's size --------------------------------------------------------------------------


def raw_exchange(base_url: str, head: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """Send a request's head (and body) as written, and read one response: (status, headers, body).
    The socket's timeout fails the test if the server waits for more than was sent."""
    address = urlsplit(base_url)
    with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        top, _, rest = data.partition(b"\r\n\r\n")
        status_line, *lines = top.decode().split("\r\n")
        headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
        while len(rest) < int(headers["content-length"]):
            rest += sock.recv(65536)
    return int(status_line.split()[1]), headers, rest


def test_a_body_announced_past_the_limit_is_refused_before_it_is_sent(guarded):
    """Content-Length alone decides: the server answers 413 though none of the body came."""
    base_url, async_engine = guarded
    before = refusals(base_url)
    head = ("POST /v1/completions HTTP/1.1\nHost: test\nContent-Type: application/json\n"
            f"Authorization: Bearer {KEY}\nContent-Length: 4097\n")
    status, headers, body = raw_exchange(base_url, head)
    error = json.loads(body)["error"]
    assert status == 413 and headers["content-type"] == "application/json"
    assert error["message"] == "the request body is 4097 bytes; this server takes at most 4096 bytes"
    assert error["type"] == "invalid_request_error" and error["param"] is None
    # The key is checked first: a client without it learns nothing of the limits.
    status, _, body = raw_exchange(base_url, head.replace(KEY, "sk-wrong"))
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    after = refusals(base_url)
    assert after["body_too_large"] - before["body_too_large"] == 1
    assert after["unauthorized"] - before["unauthorized"] == 1
    assert not async_engine.engine.has_unfinished_requests()


def padded(body: bytes, size: int) -> bytes:
    """A JSON body padded with spaces to `size` bytes (whitespace JSON ignores)."""
    assert len(body) <= size
    return body + b" " * (size - len(body))


def test_bodies_past_the_limit_get_413_with_or_without_a_content_length(guarded):
    base_url, _ = guarded
    before = refusals(base_url)
    request = b'{"model": "tiny-pair", "prompt": "x = ", "max_tokens": 2}'
    headers = {**AUTH, "Content-Type": "application/json"}

    def chunks(body: bytes):  # httpx sends an iterator as Transfer-Encoding: chunked, without a length
        for start in range(0, len(body), 1000):
            yield body[start:start + 1000]

    # At the limit it is served, announced or streamed; a byte past it is refused, either way.
    for size, status in ((4096, 200), (4097, 413)):
        for content in (padded(request, size), chunks(padded(request, size))):
            response = httpx.post(base_url + "/v1/completions", content=content, headers=headers)
            if status == 200:
                assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
            else:
                error = assert_openai_error(response, 413)
                assert "this server takes at most 4096 bytes" in error["message"]
    # The openai client's body: a prompt of 5,000 characters.
    with pytest.raises(openai.APIStatusError) as caught:
        client_of(base_url, KEY).completions.create(model=MODEL, prompt="x" * 5000, max_tokens=2)
    assert caught.value.status_code == 413 and "at most 4096 bytes" in caught.value.body["message"]
    assert refusals(base_url)["body_too_large"] - before["body_too_large"] == 3


def test_the_default_body_limit_is_one_mib(limited):
    base_url, _ = limited
    request = b'{"model": "tiny-pair", "prompt": "x = ", "max_tokens": 2}'
    headers = {"Content-Type": "application/json"}
    response = httpx.post(base_url + "/v1/completions", content=padded(request, 1 << 20), headers=headers)
    assert response.status_code == 200
    response = httpx.post(base_url + "/v1/completions", content=padded(request, (1 << 20) + 1), headers=headers)
    assert "at most 1048576 bytes" in assert_openai_error(response, 413)["message"]


# ---- prompts, stop strings and the context ----------------------------------------------------


def test_prompts_and_stop_strings_past_their_limits_get_400_naming_them(limited):
    base_url, async_engine = limited
    client = client_of(base_url)
    before = refusals(base_url)
    prompts = ["def f(", "x = ", "import os\n", "class A:"]
    assert len(client.completions.create(model=MODEL, prompt=prompts[:3], max_tokens=2).choices) == 3
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=prompts, max_tokens=2)
    assert caught.value.body["param"] == "prompt"
    assert caught.value.body["message"] == "prompt holds 4 prompts; this server takes at most 3 per request"
    token_prompts = [[5, 6, 7]] * 4  # token ids count alike
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=token_prompts, max_tokens=2)

    assert client.completions.create(model=MODEL, prompt="x = ", max_tokens=2, stop=["a", "b"]).choices
    for call in (lambda stop: client.completions.create(model=MODEL, prompt="x = ", max_tokens=2, stop=stop),
                 lambda stop: client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, stop=stop)):
        with pytest.raises(openai.BadRequestError) as caught:
            call(["a", "b", "c"])
        assert caught.value.body["param"] == "stop"
        assert caught.value.body["message"] == "stop holds 3 strings; this server takes at most 2 per request"
    after = refusals(base_url)
    assert after["too_many_prompts"] - before["too_many_prompts"] == 2
    assert after["too_many_stop_strings"] - before["too_many_stop_strings"] == 2
    assert not async_engine.engine.has_unfinished_requests()


def test_a_completion_past_the_context_gets_400_in_vllms_words(limited):
    base_url, async_engine = limited
    client = client_of(base_url)
    tokenizer = async_engine.engine.tokenizer
    before = scrape(base_url)
    prompt = "def add(a, b):"
    held = len(tokenizer(prompt)["input_ids"])
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=CONTEXT - held + 1)
    error = caught.value.body
    assert error["message"] == (f"This model's maximum context length is {CONTEXT} tokens. However, you requested "
                                f"{CONTEXT + 1} tokens ({held} in the prompt, {CONTEXT - held + 1} in the "
                                f"completion). Please reduce the length of the prompt or completion.")
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    # One prompt of a list that does not fit refuses the request: none of them runs.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=["x", prompt], max_tokens=CONTEXT - held + 1)
    chat_held = len(async_engine.engine.chat_prompt(MESSAGES))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=CONTEXT)
    assert caught.value.body["param"] == "messages" and caught.value.body["message"] == (
        f"This model's maximum context length is {CONTEXT} tokens. However, you requested {CONTEXT + chat_held} "
        f"tokens ({chat_held} in the messages, {CONTEXT} in the completion). Please reduce the length of the messages "
        f"or completion.")
    after = scrape(base_url)
    assert after["specengine:requests_refused_total", (("reason", "context_length"),)] - \
        before["specengine:requests_refused_total", (("reason", "context_length"),)] == 3
    assert after["specengine:prompt_tokens_total", ()] == before["specengine:prompt_tokens_total", ()]
    # Exactly the context: served, to its max_tokens.
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=CONTEXT - held, temperature=0.0,
                                         extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == CONTEXT - held and response.choices[0].finish_reason == "length"


def test_clamp_max_tokens_shortens_it_to_what_fits(text_pair):
    """Each prompt's max_tokens is shortened to its own room, and the request ends by it (finish
    reason "length"), not by a full context ("capacity")."""
    engine = engine_of(text_pair, max_batch_size=2)
    prompts = ["def add(a, b):", "import os\nimport sys\n" * 3]
    held = [len(engine.tokenizer(p)["input_ids"]) for p in prompts]
    assert held[0] < held[1] < CONTEXT - 10
    with running_server(engine, MODEL, ServerLimits(clamp_max_tokens=True)) as (base_url, _):
        client = client_of(base_url)
        response = client.completions.create(model=MODEL, prompt=prompts, max_tokens=10_000, temperature=0.0,
                                             extra_body={"ignore_eos": True})
        assert response.usage.completion_tokens == sum(CONTEXT - h for h in held)
        assert [c.finish_reason for c in response.choices] == ["length", "length"]
        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=CONTEXT, temperature=0.0,
                                              extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == CONTEXT - chat.usage.prompt_tokens
        finished = {dict(labels)["finished_reason"]: value for (name, labels), value in scrape(base_url).items()
                    if name == "specengine:request_success_total"}
        assert finished == {"stop": 0, "length": 3, "capacity": 0, "abort": 0}
        assert refusals(base_url)["context_length"] == 0


# ---- the waiting queue ------------------------------------------------------------------------


def read_events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def test_past_max_waiting_a_request_gets_503_with_retry_after_and_those_queued_are_served(guarded):
    """One row, one request may wait. While the engine's steps are held, two requests are queued
    (one would take the row at the next step, the other waits); a third gets 503, from raw HTTP
    and from the openai client, completions and chat. Released, the two run to their end."""
    base_url, async_engine = guarded
    inner = async_engine.engine
    before = refusals(base_url)
    client = client_of(base_url, KEY)
    completion = dict(model=MODEL, prompt="def f(", max_tokens=5, ignore_eos=True)
    chat = dict(model=MODEL, messages=MESSAGES, max_tokens=4, ignore_eos=True)
    # Three prompts could never be queued behind one row and one waiting place: 400, not a retry.
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=2)
    assert caught.value.body["message"] == ("prompt holds 3 prompts, more than this server ever holds at once "
                                            "(1 running and 1 waiting)")
    with held_steps(inner) as release:
        with httpx.stream("POST", base_url + "/v1/completions", json={**completion, "stream": True}, headers=AUTH,
                          timeout=60) as first, \
             httpx.stream("POST", base_url + "/v1/chat/completions", json={**chat, "stream": True}, headers=AUTH,
                          timeout=60) as second:
            assert first.status_code == second.status_code == 200  # their requests were added
            assert inner.num_waiting == 2 and inner.num_running == 0
            # A request let through would wait for the held steps: the timeouts end such a failure.
            refused = client_of(base_url, KEY, timeout=10)
            response = httpx.post(base_url + "/v1/completions", json=completion, headers=AUTH, timeout=10)
            error = assert_openai_error(response, 503)
            assert response.headers["retry-after"] == "1"
            assert error["message"] == "the server is busy: its queue of 1 waiting requests is full; retry after 1 s"
            with pytest.raises(openai.InternalServerError) as caught:
                refused.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
            assert caught.value.status_code == 503 and caught.value.response.headers["retry-after"] == "1"
            with pytest.raises(openai.InternalServerError):
                refused.completions.create(model=MODEL, prompt="x = ", max_tokens=2)
            assert inner.num_waiting == 2  # the refused ones were never added
            release()
            events = [read_events(first), read_events(second)]
    for stream in events:
        assert stream[-1] == "[DONE]"
        assert json.loads(stream[-2])["choices"][0]["finish_reason"] == "length"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[0][:-1])
    after = refusals(base_url)
    assert after["queue_full"] - before["queue_full"] == 3
    assert after["too_many_prompts"] - before["too_many_prompts"] == 1
    # Room again: served.
    assert client.completions.create(model=MODEL, prompt="x = ", max_tokens=2,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 2


# ---- specengine serve -------------------------------------------------------------------------


def serve_limits(argv: list[str]) -> ServerLimits:
    return _server_limits(build_parser().parse_args(["serve", *argv]))


def test_serve_takes_the_key_from_the_flag_before_the_environment(monkeypatch):
    monkeypatch.delenv(API_KEY_VARIABLE, raising=False)
    assert serve_limits([]).api_key is None
    assert serve_limits(["--api-key", "flag-key"]).api_key == "flag-key"
    monkeypatch.setenv(API_KEY_VARIABLE, "env-key")
    assert serve_limits([]).api_key == "env-key"
    assert serve_limits(["--api-key", "flag-key"]).api_key == "flag-key"
    monkeypatch.setenv(API_KEY_VARIABLE, "")
    with pytest.raises(ValueError, match=f"{API_KEY_VARIABLE} is set but empty"):
        serve_limits([])
    limits = serve_limits(["--api-key", "k", "--protect-metrics", "--max-waiting", "7", "--max-body-bytes", "100",
                           "--max-prompts-per-request", "5", "--max-stop-strings", "3", "--clamp-max-tokens"])
    assert limits == ServerLimits(api_key="k", protect_metrics=True, max_waiting=7, max_body_bytes=100,
                                  max_prompts_per_request=5, max_stop_strings=3, clamp_max_tokens=True)
    assert serve_limits(["--api-key", "k"]) == ServerLimits(api_key="k")  # the flags' defaults are ServerLimits'


def test_serve_help_names_the_limits(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--api-key KEY", "--protect-metrics", "--max-waiting N", "--max-body-bytes N",
                 "--max-prompts-per-request N", "--max-stop-strings N", "--clamp-max-tokens", API_KEY_VARIABLE):
        assert flag in text, flag


@pytest.mark.parametrize("argv, message", [
    (["--max-waiting", "-1"], "max_waiting must be an integer >= 0, got -1"),
    (["--protect-metrics"], "protect_metrics needs an api_key"),
    (["--api-key", "two words"], "api_key must be a non-empty string of printable ASCII"),
])
def test_serve_refuses_bad_limits_before_loading(text_pair, capsys, monkeypatch, argv, message):
    from specengine.cli import main as cli_main

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(Engine, "from_pretrained", no_load)
    monkeypatch.delenv(API_KEY_VARIABLE, raising=False)
    assert cli_main(["serve", "--target", str(text_pair[0]), "--port", str(free_port()), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specengine: error: " + message) and err.count("\n") == 1 and "two words" not in err


def test_serve_needs_the_flags_key_over_the_environments_and_logs_neither(text_pair, tmp_path):
    flag_key, env_key = "sk-flag-93b1d0", "sk-env-4c7e22"
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        server = subprocess.Popen([sys.executable, "-m", "specengine", "serve", "--target", str(text_pair[0]),
                                   "--gamma", "2", "--port", str(port), "--api-key", flag_key, "--log-level", "debug"],
                                  stdout=stdout, stderr=stderr, env={**os.environ, API_KEY_VARIABLE: env_key})
        try:
            deadline = time.monotonic() + 120
            while "serving" not in err.read_text():
                assert server.poll() is None and time.monotonic() < deadline, err.read_text()
                time.sleep(0.1)
            assert httpx.get(base_url + "/health").status_code == 200
            assert httpx.get(base_url + "/v1/models").status_code == 401
            assert httpx.get(base_url + "/v1/models", headers={"Authorization": f"Bearer {env_key}"}).status_code == 401
            models = httpx.get(base_url + "/v1/models", headers={"Authorization": f"Bearer {flag_key}"})
            assert models.status_code == 200 and flag_key not in models.text
            response = httpx.post(base_url + "/v1/completions", headers={"Authorization": f"Bearer {flag_key}"},
                                  json=dict(prompt="x = ", max_tokens=2))
            assert response.status_code == 200
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)
    said = err.read_text() + out.read_text()
    assert "requests need the API key" in said and "GET /v1/models" in said  # what was logged
    assert flag_key not in said and env_key not in said
