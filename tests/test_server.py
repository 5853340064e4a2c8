"""The OpenAI-compatible server, through the official openai client, on a loopback port opened
inside the test: seeded requests streamed concurrently equal offline generation, chat, bad
parameters answered with 400 while the server keeps serving, dropped clients aborting."""
import asyncio
import time

import httpx
import openai
import pytest

from specengine import Engine, SamplingParams

from engine_util import stop_across_tokens
from server_util import held_steps, running_server, stoppable_server, with_chat_template

MODEL = "tiny-pair"


@pytest.fixture(scope="module")
def offline(text_pair):
    """The same pair in an engine of its own: what each request gives offline."""
    return with_chat_template(Engine.from_pretrained(*text_pair, gamma=3))


@pytest.fixture(scope="module")
def server(text_pair):
    """(base_url, AsyncEngine, aborted ids) of a server on a free loopback port."""
    engine = with_chat_template(Engine.from_pretrained(*text_pair, gamma=3, max_batch_size=4))
    aborted = []
    abort = engine.abort

    def recording_abort(request_id):
        done = abort(request_id)
        if done:
            aborted.append(request_id)
        return done

    engine.abort = recording_abort
    with running_server(engine, MODEL) as (url, async_engine):
        yield url, async_engine, aborted


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def wait_idle(async_engine, seconds=10.0):
    deadline = time.monotonic() + seconds
    while async_engine.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests left running"
        time.sleep(0.01)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(server[0] + "/health").json()
    assert health["status"] == "ok" and health["running"] == 0


PROMPTS = ["def add(a, b):", "import os\n", "x = [1, 2,", "class Point:", "for i in range(", "# a comment\n"]


def seeded(i: int) -> dict:
    return dict(max_tokens=(12, 30, 7, 21, 16, 25)[i], temperature=(0.8, 0.0, 1.2, 1.0, 0.5, 0.9)[i], seed=40 + i,
                top_p=(1.0, 1.0, 0.9, 1.0, 0.95, 1.0)[i])


def test_concurrent_streams_equal_offline_generation(server, offline):
    """Six seeded streams at once (four rows: two wait) give exactly the offline texts."""
    base_url, async_engine, _ = server
    want = offline.generate(PROMPTS, [SamplingParams(max_new_tokens=seeded(i)["max_tokens"], ignore_eos=True,
                                                     **{k: v for k, v in seeded(i).items() if k != "max_tokens"})
                                      for i in range(len(PROMPTS))])

    async def one(client, i):
        stream = await client.completions.create(model=MODEL, prompt=PROMPTS[i], stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}, **seeded(i))
        text, finish, usage, chunks = "", None, None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
                chunks += 1
            if chunk.usage:
                usage = chunk.usage
        return text, finish, usage, chunks

    async def all_of_them():
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        return await asyncio.gather(*(one(client, i) for i in range(len(PROMPTS))))

    got = asyncio.run(all_of_them())
    for (text, finish, usage, chunks), result in zip(got, want):
        assert text == result.text and finish == "length"
        assert usage.completion_tokens == len(result.token_ids) and usage.prompt_tokens == len(result.prompt_token_ids)
    assert max(chunks for *_, chunks in got) > 1  # streamed, not sent at the end
    wait_idle(async_engine)
    assert async_engine.engine.scheduler.batch.cache.batch_size == 0


def test_completion_without_streaming_and_a_batch_of_prompts(client, offline):
    params = dict(max_tokens=10, temperature=0.0)
    want = offline.generate(PROMPTS[:3], SamplingParams(max_new_tokens=10, temperature=0.0))
    response = client.completions.create(model=MODEL, prompt=PROMPTS[:3], **params)
    assert [c.text for c in response.choices] == [r.text for r in want]
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert response.usage.completion_tokens == sum(len(r.token_ids) for r in want)
    ids = offline.tokenizer(PROMPTS[0])["input_ids"]
    assert client.completions.create(model=MODEL, prompt=ids, **params).choices[0].text == want[0].text


def test_chat_completion_streamed_and_not(client, offline):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Add two numbers."}]
    (want,) = offline.generate([offline.chat_prompt(messages)],
                               SamplingParams(max_new_tokens=20, temperature=0.7, seed=3))
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0.7, seed=3)
    assert response.choices[0].message.content == want.text and response.choices[0].message.role == "assistant"
    assert response.object == "chat.completion" and response.usage.completion_tokens == len(want.token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20,
                                            temperature=0.7, seed=3, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == {"stop": "stop", "length": "length"}[want.finish_reason]


def test_stop_strings_that_span_tokens(client, offline):
    free = offline.generate(["x = 1\n"], SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True))[0]
    stop = stop_across_tokens(offline.tokenizer, free)
    stream = client.completions.create(model=MODEL, prompt="x = 1\n", max_tokens=30, temperature=0, stream=True,
                                       stop=[stop, "never appears"], extra_body={"ignore_eos": True})
    pieces = [(c.choices[0].text, c.choices[0].finish_reason) for c in stream]
    text = "".join(p for p, _ in pieces)
    assert text == free.text[:free.text.find(stop)] and pieces[-1][1] == "stop"
    assert all(stop not in "".join(p for p, _ in pieces[:n]) for n in range(len(pieces) + 1))


@pytest.mark.parametrize("kwargs, param, message", [
    (dict(temperature=-1.0), "temperature", "greater than or equal to 0"),
    (dict(top_p=0.0), "top_p", "greater than 0"),
    (dict(max_tokens=0), "max_tokens", "greater than or equal to 1"),
    (dict(seed=-5), "seed", "greater than or equal to 0"),
    (dict(n=2), "n", "n must be 1"),
    (dict(logprobs=21), "logprobs", "in [0, 20]"),
    (dict(presence_penalty=0.5), "presence_penalty", "not supported"),
    (dict(stop=[""]), "stop", "non-empty"),
    (dict(extra_body={"top_k": -3}), "top_k", "greater than or equal to -1"),
    (dict(extra_body={"min_p": 1.5}), "min_p", "less than or equal to 1"),
    (dict(extra_body={"temprature": 0.5}), "temprature", "unrecognized request argument"),
    (dict(model="gpt-4"), "model", "does not exist"),
    (dict(prompt="word " * 600), "prompt", "no room to generate"),
    (dict(prompt=[]), "prompt", "prompt"),
    (dict(prompt=[1, 10**6]), "prompt", "prompt token ids must be integers"),
])
def test_bad_parameters_get_400_naming_them_and_the_server_keeps_serving(client, kwargs, param, message):
    request = dict(model=MODEL, prompt="x = ", max_tokens=4)
    request.update(kwargs)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**request)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and message in error["message"]
    assert client.completions.create(model=MODEL, prompt="x = ", max_tokens=3).choices[0].text is not None


def test_bad_chat_requests_get_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=3)
    assert caught.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}], max_tokens=3)
    assert caught.value.body["param"].startswith("messages")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert caught.value.body["param"] == "tools"


def test_a_dropped_stream_aborts_its_request(server, client):
    _, async_engine, aborted = server
    stream = client.completions.create(model=MODEL, prompt="def f(", max_tokens=400, temperature=1.0, seed=1,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    request_id = async_engine.engine.unfinished_request_ids[0]
    assert first.choices[0].text is not None
    stream.close()  # the client goes away mid-generation
    wait_idle(async_engine)
    assert request_id in aborted and async_engine.engine.num_running == 0


def test_a_dropped_non_streaming_request_aborts_it(server):
    """The client goes away while its request is in the engine (steps held there, so it cannot
    finish first however fast the machine): the server sees the disconnect and aborts it."""
    import json
    import socket

    base_url, async_engine, aborted = server
    engine = async_engine.engine
    body = json.dumps(dict(model=MODEL, prompt="def g(", max_tokens=450, temperature=1.0, seed=2,
                           ignore_eos=True)).encode()
    host, port = base_url.removeprefix("http://").split(":")
    before = len(aborted)
    with held_steps(engine) as release:
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.monotonic() + 30
            while not engine.has_unfinished_requests():
                assert time.monotonic() < deadline, "the request did not reach the engine"
                time.sleep(0.01)
            (request_id,) = engine.unfinished_request_ids
        # the connection is closed: the client went away mid-generation
        deadline = time.monotonic() + 30
        while request_id not in aborted:
            assert time.monotonic() < deadline, "the dropped request was not aborted"
            time.sleep(0.01)
        release()
    wait_idle(async_engine)
    assert aborted[before:] == [request_id] and engine.num_running == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("body, where", [
    ('{"model": "tiny-pair", "prompt": "x = ", "max_tokens": }', "line 1 column 56"),
    ('{\n  "prompt": "x = ",\n  "max_tokens": 3,\n}', "line 4 column 1"),
    ("prompt=x", "line 1 column 1"),
])
def test_a_body_that_is_not_json_gets_400_saying_where_and_naming_no_parameter(server, path, body, where):
    response = httpx.post(server[0] + path, content=body, headers={"Content-Type": "application/json"})
    error = response.json()["error"]
    assert response.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["message"].startswith("the request body is not valid JSON: ") and where in error["message"]
    assert error["param"] is None


def test_other_http_errors_have_the_openai_shape_too(server):
    response = httpx.post(server[0] + "/v1/completions", content=b'{"prompt": "\xff"}',
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] is None
    response = httpx.get(server[0] + "/v1/nowhere")
    assert response.status_code == 404 and response.json()["error"]["message"] == "Not Found"
    response = httpx.get(server[0] + "/v1/completions")
    assert response.status_code == 405 and "POST" in response.headers["allow"]


def test_one_clients_disconnect_never_ends_anothers_stream(server, client, offline):
    _, async_engine, aborted = server
    kept = dict(max_tokens=40, temperature=0.9, seed=7)
    (want,) = offline.generate(["def add(a, b):"], SamplingParams(max_new_tokens=40, temperature=0.9, seed=7,
                                                                  ignore_eos=True))
    stays = client.completions.create(model=MODEL, prompt="def add(a, b):", stream=True,
                                      extra_body={"ignore_eos": True}, **kept)
    leaves = client.completions.create(model=MODEL, prompt="def f(", max_tokens=400, temperature=1.0, seed=1,
                                       stream=True, extra_body={"ignore_eos": True})
    staying = iter(stays)
    pieces = [next(staying)]
    next(iter(leaves))
    before = len(aborted)
    leaves.close()  # one client goes away mid-generation, the other reads on
    pieces += list(staying)
    assert "".join(c.choices[0].text for c in pieces) == want.text
    assert pieces[-1].choices[0].finish_reason == "length"
    wait_idle(async_engine)
    assert len(aborted) == before + 1


def test_streams_that_disconnect_at_random_points_leave_the_others_exact(server, client, offline):
    """Ten concurrent streamed requests (the server runs four at a time, the rest wait); a drawn
    half of the clients go away after a drawn number of chunks. Every client that stays gets its
    offline text, every one that left got a prefix of it, and the server goes idle."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    _, async_engine, aborted = server
    draw = random.Random(30)
    prompts = ["def add(a, b):", "import os\n", "class A:", "x = [", "for i in range(", "# sum\n"]
    requests = [dict(prompt=prompts[i % len(prompts)], seed=100 + i, max_tokens=draw.randint(8, 30),
                     temperature=draw.choice([0.0, 0.8, 1.2]), leave_after=draw.choice([None, 0, 1, 3, 6]))
                for i in range(10)]
    want = offline.generate([r["prompt"] for r in requests],
                            [SamplingParams(max_new_tokens=r["max_tokens"], temperature=r["temperature"],
                                            seed=r["seed"], ignore_eos=True) for r in requests])

    def run(r):
        stream = client.completions.create(model=MODEL, prompt=r["prompt"], max_tokens=r["max_tokens"],
                                           temperature=r["temperature"], seed=r["seed"], stream=True,
                                           extra_body={"ignore_eos": True})
        text, reason = "", None
        for n, chunk in enumerate(stream):
            if r["leave_after"] is not None and n == r["leave_after"]:
                stream.close()  # the client goes away
                return text, "left"
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    before = len(aborted)
    with ThreadPoolExecutor(len(requests)) as pool:
        got = list(pool.map(run, requests))
    for r, (text, reason), result in zip(requests, got, want):
        if reason == "left":
            assert result.text.startswith(text)
        else:
            assert (text, reason) == (result.text, "length"), r
    wait_idle(async_engine)
    left = sum(reason == "left" for _, reason in got)
    assert 0 < left < len(requests) and len(aborted) - before <= left
    assert async_engine.engine.num_waiting == 0 and async_engine.engine.cache_rows_in_use == 0
    steps = async_engine.steps
    time.sleep(0.3)
    assert async_engine.steps == steps  # idle: the driver waits, it does not step


def test_a_stream_given_up_before_it_began_leaves_nothing_running(offline):
    """A client gone before its response started: the body is never iterated, so only the
    response itself can end its requests."""
    from specengine import AsyncEngine
    from specengine.server.app import _Choices, _Stream

    async def main():
        engine = AsyncEngine(offline)
        choices = _Choices(engine, [engine.add_request("def f(", SamplingParams(max_new_tokens=400, ignore_eos=True))])

        async def events():
            async for _ in choices.merged():
                yield "data: x\n\n"

        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            await asyncio.sleep(3600)  # nothing reaches a client that has gone

        await _Stream(events(), choices)({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
        left = offline.has_unfinished_requests(), dict(engine._streams)
        await engine.close()
        return left

    assert asyncio.run(main()) == (False, {})


def test_shutdown_lets_open_requests_run_for_the_grace_period_then_ends_them_with_abort(long_context_target):
    """The grace period is sized from this machine's own pace (the gaps between the stream's chunks
    before the stop), so the checks hold on a slow or busy machine: the stream goes on for several
    chunks after the stop, ends with "abort" no sooner than the grace period, and within a few of its
    own gaps after it."""
    import json
    import threading

    from specengine.server.app import SHUTDOWN_BACKSTOP_S

    engine = Engine.from_pretrained(long_context_target, gamma=3)
    with stoppable_server(engine, "long", grace=1.0) as (url, async_engine, uv):
        chunks, answers = [], []

        def stream():
            body = dict(prompt="def f(", max_tokens=6000, ignore_eos=True, seed=1, stream=True)
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        event = line[6:]
                        chunks.append((time.monotonic(), event if event == "[DONE]" else json.loads(event)))

        def whole():
            body = dict(prompt="x = ", max_tokens=6000, ignore_eos=True, seed=2)
            answers.append(httpx.post(url + "/v1/completions", json=body, timeout=600).json())

        clients = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for t in clients:
            t.start()
        deadline = time.monotonic() + 120
        while async_engine.engine.num_running < 2 or len(chunks) < 6:
            assert time.monotonic() < deadline, "the requests did not start"
            time.sleep(0.01)
        at = [a for a, _ in chunks[1:6]]
        pace = max(b - a for a, b in zip(at, at[1:]))  # this machine's time between chunks, both rows running
        grace = uv.grace = max(1.0, 10 * pace)
        uv.config.timeout_graceful_shutdown = grace + SHUTDOWN_BACKSTOP_S
        stopped = time.monotonic()
        uv.should_exit = True  # what SIGTERM and Ctrl-C do
        for t in clients:
            t.join(timeout=grace + 120)
        uv.thread.join(timeout=120)
        exited = time.monotonic()
    assert not uv.thread.is_alive()
    *events, done = chunks
    assert done[1] == "[DONE]"
    reasons = [event["choices"][0]["finish_reason"] for _, event in events]
    assert reasons[-1] == "abort" and set(reasons[:-1]) == {None}
    # The stream went on through the grace period (about 10 chunks; one may have been in flight at
    # the stop), and was ended when it ran out, not before, and not a backstop's wait later.
    ran_on = [a for a, event in events[:-1] if a > stopped]
    assert len(ran_on) >= 3, (len(ran_on), pace, grace)
    slack = max(0.5, 5 * max(pace, max(b - a for a, b in zip(ran_on, ran_on[1:]))))  # (0.5: a busy scheduler's wake-ups)
    assert grace <= events[-1][0] - stopped < grace + slack, (events[-1][0] - stopped, grace, slack)
    assert exited - stopped < grace + SHUTDOWN_BACKSTOP_S
    (answer,) = answers
    assert answer["choices"][0]["finish_reason"] == "abort" and answer["choices"][0]["text"]
    assert not engine.has_unfinished_requests()


def test_streamed_completions_of_several_prompts_carry_each_choices_index_and_all_finish(server, offline):
    """stream=True with three prompts: each chunk names its choice, every choice ends with its own
    finish reason, and each choice's text is its prompt's offline completion."""
    import json

    base_url = server[0]
    body = dict(model=MODEL, prompt=PROMPTS[:3], max_tokens=12, temperature=0.0, stream=True, ignore_eos=True)
    texts, reasons, order = ["", "", ""], [None, None, None], []
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for event in map(json.loads, lines[:-1]):
        (choice,) = event["choices"]
        i = choice["index"]
        assert reasons[i] is None, f"choice {i} went on after it finished"
        texts[i] += choice["text"]
        reasons[i] = choice["finish_reason"]
        order.append(i)
    assert set(order) == {0, 1, 2} and reasons == ["length"] * 3
    full = offline.generate(PROMPTS[:3], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    assert texts == [r.text for r in full]
    assert order != sorted(order)  # the choices' chunks interleave: they ran together


def test_a_prompt_the_engine_refuses_among_several_gets_400_naming_it_and_nothing_runs(server, monkeypatch):
    """Three prompts, one refused: the whole request gets 400 naming the prompt, before or after the
    others were added (those are aborted), and nothing of it runs or is left queued."""
    base_url, async_engine, aborted = server
    engine = async_engine.engine
    vocab = engine.target.config.vocab_size
    body = dict(model=MODEL, max_tokens=20, temperature=0.0)
    # A token id past the vocabulary: refused while the prompts are read, before any is added.
    before_steps, before_aborted = async_engine.steps, len(aborted)
    response = httpx.post(base_url + "/v1/completions", json={**body, "prompt": [[5, 6, 7], [8, vocab + 3], [9, 10]]},
                          timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and str(vocab + 3) in error["message"]
    assert not engine.has_unfinished_requests() and len(aborted) == before_aborted
    # Refused as the engine adds the second: the first, already added, is aborted, none runs.
    add = engine.add_request
    added = []

    def refusing(prompt, params=None, request_id=None):
        if len(added) == 1:
            raise ValueError("this prompt is refused (a planted refusal)")
        added.append(add(prompt, params, request_id))
        return added[-1]

    monkeypatch.setattr(engine, "add_request", refusing)
    with held_steps(engine):  # no step may run the first before the second is refused
        response = httpx.post(base_url + "/v1/completions", json={**body, "prompt": PROMPTS[:3]}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert "planted refusal" in response.json()["error"]["message"]
    assert aborted[before_aborted:] == added and not engine.has_unfinished_requests()
    monkeypatch.undo()
    # The server goes on serving.
    ok = httpx.post(base_url + "/v1/completions", json={**body, "prompt": PROMPTS[:2]}, timeout=60)
    assert ok.status_code == 200 and [c["index"] for c in ok.json()["choices"]] == [0, 1]
    assert async_engine.steps > before_steps


def test_a_step_that_fails_mid_request_ends_it_cleanly_and_the_server_keeps_serving(server, client, offline,
                                                                                      monkeypatch, caplog):
    """A round raises while a streamed and a non-streamed request run (both in the batch): each
    ends with the error, in OpenAI's shape (an error event and [DONE] in the stream, after the text
    it had; 500 for the other), the failure is logged once, and later requests, streamed or not,
    get exactly their offline text."""
    import threading

    base_url, async_engine, _ = server
    engine = async_engine.engine
    run = engine.runner.rounds.run
    rounds = []

    def failing(*args, **kwargs):
        rounds.append(1)
        if len(rounds) == 4:
            raise RuntimeError("a planted failure in the round")
        return run(*args, **kwargs)

    monkeypatch.setattr(engine.runner.rounds, "run", failing)
    params = dict(model=MODEL, max_tokens=200, temperature=0.0, extra_body={"ignore_eos": True})
    answers = []

    def whole():
        try:
            client.completions.create(prompt=PROMPTS[1], **params)
        except openai.APIStatusError as exc:
            answers.append(exc)

    other, chunks = threading.Thread(target=whole), []
    with caplog.at_level("ERROR", logger="specengine"), held_steps(engine) as release:
        stream = client.completions.create(prompt=PROMPTS[0], stream=True, **params)
        other.start()
        deadline = time.monotonic() + 30
        while engine.num_waiting < 2:  # both queued before the first round
            assert time.monotonic() < deadline, "the requests did not arrive"
            time.sleep(0.01)
        release()
        with pytest.raises(openai.APIError, match="the round failed .*a planted failure in the round"):
            for chunk in stream:
                chunks.append(chunk)
        other.join(timeout=120)
    assert len(rounds) >= 4 and chunks and all(c.choices[0].finish_reason is None for c in chunks)
    assert 0 < sum(len(c.choices[0].text) for c in chunks)
    (answer,) = answers
    assert answer.status_code == 500 and "a planted failure in the round" in answer.message
    assert answer.body["type"] == "server_error"
    assert sum("a step failed" in r.getMessage() for r in caplog.records) == 1
    wait_idle(async_engine)
    monkeypatch.undo()
    want = offline.generate(PROMPTS[2:4], SamplingParams(max_new_tokens=15, temperature=0.0, ignore_eos=True))
    again = dict(model=MODEL, max_tokens=15, temperature=0.0, extra_body={"ignore_eos": True})
    assert client.completions.create(prompt=PROMPTS[2], **again).choices[0].text == want[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=PROMPTS[3], stream=True, **again)
                       if c.choices)
    assert streamed == want[1].text
