"""Log-probabilities (SamplingParams.logprobs, prompt_logprobs; the server's logprobs, echo and
top_logprobs) against transformers' log-softmax of the same model on the same tokens, warped here
independently of the engine's warp code: target-only and speculative (several gammas, a draft
that accepts some drafts and rejects others), greedy and sampled, ragged batches, streamed, with
chunked prefill and the prefix cache; the server's formats through raw HTTP and the openai client."""
import json
import math
from dataclasses import replace

import httpx
import openai
import pytest
import torch

from specengine import Engine, SamplingParams
from specengine.devtools.tiny import stdlib_text
from specengine.sampling.params import MAX_LOGPROBS

from server_util import running_server, with_chat_template

TOLERANCE = 1e-4  # float32 logits of two implementations, and their log-softmax
MODEL = "tiny-pair"
PROMPTS = ["def add(a, b):", "import os\n", "x", "class Point:\n    def __init__(self"]
# Greedy (unwarped log-softmax), temperature, top-k (with more alternatives than it keeps: -inf
# ones), top-p, min-p; and one request that asks for nothing.
PARAMS = [dict(temperature=0.0, logprobs=5), dict(temperature=0.7, logprobs=3, seed=1),
          dict(temperature=0.7, top_k=6, logprobs=10, seed=2), dict(temperature=0.9, top_p=0.8, logprobs=4, seed=3),
          dict(temperature=1.0, min_p=0.05, logprobs=0, seed=4), dict(temperature=0.8, seed=5)]


@pytest.fixture(scope="module")
def hf_target(text_pair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(text_pair[0], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def near_draft(text_pair, tmp_path_factory):
    """The target with noise on its head: a draft that agrees with it often but not always, so
    rounds accept ragged numbers of drafts (the pair's own draft, unrelated, accepts almost none)."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("near-draft")
    model = AutoModelForCausalLM.from_pretrained(text_pair[0], dtype=torch.float32)
    with torch.no_grad():
        weight = model.lm_head.weight
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(5)) * weight.std() * 0.3)
    model.save_pretrained(folder)
    return folder


def reference_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits [T, V] of one sequence."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def warped_reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities [N, V] after params' warps, from logits [N, V], written here from the
    definitions (float64; not the engine's warp code): greedy reports the unwarped log-softmax."""
    x = logits.double()
    if params.temperature == 0:
        return x.log_softmax(-1)
    x = x / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        x = x.masked_fill(x < x.topk(params.top_k, dim=-1).values[:, -1:], -math.inf)
    if params.top_p < 1:
        probs = x.softmax(-1)
        ordered, order = probs.sort(dim=-1, descending=True)
        outside = (ordered.cumsum(-1) - ordered) >= params.top_p  # mass before each >= top_p
        x = x.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), -math.inf)
    if params.min_p > 0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), -math.inf)
    return x.log_softmax(-1)


def close(a: float, b: float) -> bool:
    return a == b or abs(a - b) < TOLERANCE  # -inf == -inf: a token the warps drop


def check_positions(entries, tokens: list[int], logits: torch.Tensor, params: SamplingParams, k: int):
    """entries (TokenLogprob per position) against the reference at logits [N, V] of the same
    positions: each token's log-probability, and k alternatives, the most probable."""
    assert len(entries) == len(tokens) == logits.shape[0]
    reference = warped_reference(logits, params)
    for n, (entry, token) in enumerate(zip(entries, tokens)):
        assert entry.token_id == token
        assert close(entry.logprob, reference[n, token].item()), (n, entry.logprob, reference[n, token].item())
        assert len(entry.top) == k and len({t for t, _ in entry.top}) == k
        for t, logprob in entry.top:
            assert close(logprob, reference[n, t].item())
        # The k most probable (as values: tokens within float rounding of each other may swap).
        best = reference[n].topk(k).values.tolist() if k else []
        assert all(close(got, want) for (_, got), want in zip(entry.top, best))


def check_result(hf, result, params: SamplingParams):
    """A Result's logprobs (and prompt_logprobs, when asked) against transformers on its tokens."""
    prompt = result.prompt_token_ids
    logits = reference_logits(hf, prompt + result.token_ids)
    if params.logprobs is None:
        assert result.logprobs is None
    else:
        check_positions(result.logprobs, result.token_ids, logits[len(prompt) - 1:-1], params, params.logprobs)
    if params.prompt_logprobs is None:
        assert result.prompt_logprobs is None
    else:
        assert result.prompt_logprobs[0] is None  # nothing precedes the first token
        check_positions(result.prompt_logprobs[1:], prompt[1:], logits[:len(prompt) - 1], params,
                        params.prompt_logprobs)


def ragged_batch(n: int = len(PARAMS), max_new_tokens: int = 14):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    return prompts, [SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **PARAMS[i]) for i in range(n)]


def without_logprobs(params: list[SamplingParams]) -> list[SamplingParams]:
    return [replace(p, logprobs=None, prompt_logprobs=None) for p in params]


def test_target_only_logprobs_equal_transformers_log_softmax(text_pair, hf_target):
    engine = Engine.from_pretrained(text_pair[0])
    prompts, params = ragged_batch()
    results = engine.generate(prompts, params)
    for result, p in zip(results, params):
        check_result(hf_target, result, p)
    # Asking for them changes no token.
    assert [r.token_ids for r in engine.generate(prompts, without_logprobs(params))] == [r.token_ids for r in results]


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_speculative_logprobs_equal_transformers_log_softmax_with_ragged_acceptance(text_pair, near_draft,
                                                                                     hf_target, gamma):
    engine = Engine.from_pretrained(text_pair[0], near_draft, gamma=gamma)
    prompts, params = ragged_batch()
    results = engine.generate(prompts, params)
    stats = engine.last_run_stats
    # Rounds that kept every draft, and rounds that rejected one, in the same batch.
    assert stats.accepted_histogram[gamma] > 0 and stats.rejections > 0
    for result, p in zip(results, params):
        check_result(hf_target, result, p)
    assert [r.token_ids for r in engine.generate(prompts, without_logprobs(params))] == [r.token_ids for r in results]


def test_the_reference_catches_a_wrong_distribution(text_pair, hf_target):
    """The checks above can fail: logprobs of the unwarped distribution are not those of T=0.7."""
    engine = Engine.from_pretrained(text_pair[0])
    params = SamplingParams(max_new_tokens=6, temperature=0.7, logprobs=2, seed=1)
    (result,) = engine.generate(["def add(a, b):"], params)
    with pytest.raises(AssertionError):
        check_result(hf_target, result, SamplingParams(max_new_tokens=6, temperature=1.0, logprobs=2))


def test_streamed_outputs_carry_the_logprobs_of_their_tokens(text_pair, near_draft, hf_target):
    """Each step's new_logprobs are those of its new_token_ids; requests that ask for nothing get
    None; stop strings and EOS cut the logprobs with the tokens."""
    engine = Engine.from_pretrained(text_pair[0], near_draft, gamma=3)
    prompts, params = ragged_batch()
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    tokens = {i: [] for i in ids}
    entries = {i: [] for i in ids}
    steps_with_tokens = 0
    while engine.has_unfinished_requests() or engine.has_pending_outputs():
        for out in engine.step():
            p = params[ids.index(out.request_id)]
            if p.logprobs is None:
                assert out.new_logprobs is None
                continue
            assert [e.token_id for e in out.new_logprobs] == out.new_token_ids
            tokens[out.request_id] += out.new_token_ids
            entries[out.request_id] += out.new_logprobs
            steps_with_tokens += bool(out.new_token_ids)
    assert steps_with_tokens > len(ids)  # streamed over several steps
    for request_id, p, prompt in zip(ids, params, prompts):
        if p.logprobs is None:
            continue
        prompt_ids = engine.tokenizer(prompt)["input_ids"]
        logits = reference_logits(hf_target, prompt_ids + tokens[request_id])
        check_positions(entries[request_id], tokens[request_id], logits[len(prompt_ids) - 1:-1], p, p.logprobs)


def test_stop_strings_cut_the_logprobs_with_the_tokens(text_pair, hf_target):
    engine = Engine.from_pretrained(text_pair[0])
    free = SamplingParams(max_new_tokens=24, temperature=0, logprobs=1, ignore_eos=True)
    (whole,) = engine.generate(["x = 1\n"], free)
    stop = whole.text[len(whole.text) // 2:len(whole.text) // 2 + 2]
    (cut,) = engine.generate(["x = 1\n"], replace(free, stop=(stop,)))
    assert cut.finish_reason == "stop" and len(cut.token_ids) < len(whole.token_ids)
    assert len(cut.logprobs) == len(cut.token_ids) and cut.logprobs == whole.logprobs[:len(cut.token_ids)]
    check_result(hf_target, cut, free)


def test_device_rounds_give_way_to_host_rounds_for_logprobs(text_pair, near_draft, hf_target):
    """rounds_per_read > 1 (fixed-shape steps, eager on a CPU): a batch with a row asking for logprobs
    runs host rounds, with the tokens of blocks."""
    options = dict(gamma=3, cuda_graphs=True, max_batch_size=8, rounds_per_read=4)
    prompts, params = ragged_batch()
    results = Engine.from_pretrained(text_pair[0], near_draft, **options).generate(prompts, params)
    for result, p in zip(results, params):
        check_result(hf_target, result, p)
    blocks = Engine.from_pretrained(text_pair[0], near_draft, **options).generate(prompts, without_logprobs(params))
    assert [r.token_ids for r in blocks] == [r.token_ids for r in results]


@pytest.mark.parametrize("name", ["tiny-llama.Q8_0.gguf", "tiny-llama-untied.Q4_K_M.gguf"])
def test_a_gguf_files_logprobs_equal_transformers_load_of_the_file(name):
    """The file's own model, its matrices as stored: target-only and drafted by n-grams."""
    from transformers import AutoModelForCausalLM

    from gguf_util import gguf_file
    from specengine.drafters.ngram import NgramDrafter
    from specengine.models import load_model
    from specengine.tokenizer import load_tokenizer

    path = gguf_file(name)
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=name, dtype=torch.float32).eval()
    ids = load_tokenizer(path)("def add(a, b):\n    return a + b\n\ndef add(a, b):")["input_ids"]
    ours = load_model(path)
    params = [SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True, logprobs=4, prompt_logprobs=2),
              SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.9, seed=1, ignore_eos=True, logprobs=3)]
    for drafter in (None, NgramDrafter()):
        engine = Engine(ours, drafter=drafter, gamma=3)
        for result, p in zip(engine.generate([ids, ids], params), params):
            check_result(theirs, result, p)
        assert (engine.last_run_stats.drafted > 0) == (drafter is not None)


LONG_PROMPT = stdlib_text(2000)[300:900]


@pytest.mark.parametrize("warps", [dict(temperature=0.0), dict(temperature=0.7, top_k=8, seed=3)])
def test_prompt_logprobs_through_chunked_prefill_and_the_prefix_cache(text_pair, near_draft, hf_target, warps):
    """A prompt prefilled in chunks of 32 tokens beside a decoding request, whose blocks the prefix
    cache already holds: the scored request prefills it whole (its hidden states give the
    logprobs), with the tokens of a request that took the cached blocks."""
    engine = Engine.from_pretrained(text_pair[0], near_draft, gamma=3, prefill_chunk_tokens=32)
    plain = SamplingParams(max_new_tokens=8, ignore_eos=True, **warps)
    scored = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=3, **warps)
    (first,) = engine.generate([LONG_PROMPT], plain)
    assert len(first.prompt_token_ids) > 2 * 64 and engine.prefix_cache.stats()["blocks"] >= 2
    # A request decoding while the scored prompt is prefilled a chunk a step.
    busy = engine.add_request("def add(a, b):", SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True))
    engine.step()
    request_id = engine.add_request(LONG_PROMPT, scored)
    request = engine.scheduler.unfinished[request_id]
    prefill_steps = 0
    while request_id in engine.scheduler.unfinished:
        prefill_steps += request in engine.scheduler.prefilling
        engine.step()
    engine.abort(busy)
    engine.step()
    result = engine.outputs.result(request)
    assert prefill_steps > 3  # in chunks
    assert result.stats.cached_prompt_tokens == 0 and first.stats.cached_prompt_tokens == 0
    assert result.token_ids == first.token_ids
    check_result(hf_target, result, scored)
    # The scored prefill's blocks are cached too: a plain request takes them.
    (again,) = engine.generate([LONG_PROMPT], plain)
    assert again.stats.cached_prompt_tokens > 0 and again.token_ids == first.token_ids


def test_a_one_token_prompt_has_no_prompt_logprob(text_pair):
    engine = Engine.from_pretrained(text_pair[0])
    (result,) = engine.generate([[5]], SamplingParams(max_new_tokens=3, prompt_logprobs=2))
    assert result.prompt_logprobs == [None] and result.logprobs is None


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, True, 2.0, "3"])
def test_bad_logprob_counts_are_refused(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})
    assert getattr(SamplingParams(**{name: MAX_LOGPROBS}), name) == MAX_LOGPROBS


def test_an_encoder_decoder_target_refuses_prompt_logprobs(tmp_path, tokenizer):
    from specengine.devtools.tiny import make_t5_config, save_random_t5_checkpoint

    config = make_t5_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    engine = Engine.from_pretrained(save_random_t5_checkpoint(tmp_path, config, tokenizer))
    with pytest.raises(ValueError, match="prompt_logprobs needs a decoder-only target"):
        engine.add_request("x = 1", SamplingParams(prompt_logprobs=1))
    (result,) = engine.generate(["x = 1"], SamplingParams(max_new_tokens=3, temperature=0, logprobs=1))
    assert [e.token_id for e in result.logprobs] == result.token_ids


# ---- the server ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(text_pair, near_draft):
    engine = with_chat_template(Engine.from_pretrained(text_pair[0], near_draft, gamma=3, max_batch_size=4))
    with running_server(engine, MODEL) as (url, _):
        yield url


@pytest.fixture(scope="module")
def offline(text_pair, near_draft):
    return with_chat_template(Engine.from_pretrained(text_pair[0], near_draft, gamma=3))


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def sse_events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def legacy_entries(logprobs: dict, token_ids: list[int]):
    """The legacy format's token_logprobs and top_logprobs as (logprob, {text: logprob}) pairs."""
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == len(
        token_ids) == len(logprobs["text_offset"])
    return list(zip(logprobs["token_logprobs"], logprobs["top_logprobs"]))


@pytest.mark.parametrize("warps", [dict(temperature=0.0), dict(temperature=0.8, seed=11)])
def test_completions_logprobs_and_echo_equal_transformers(server, offline, hf_target, warps):
    body = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=10, logprobs=3, echo=True, ignore_eos=True, **warps)
    choice = httpx.post(server + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=3, **warps)
    (want,) = offline.generate([PROMPTS[0]], params)
    check_result(hf_target, want, params)
    assert choice["text"] == PROMPTS[0] + want.text
    ids = want.prompt_token_ids + want.token_ids
    got = legacy_entries(choice["logprobs"], ids)
    pieces = [offline.tokenizer.decode([t]) for t in ids]
    assert choice["logprobs"]["tokens"] == pieces
    offsets = choice["logprobs"]["text_offset"]
    n = len(want.prompt_token_ids)
    assert offsets[0] == 0 and offsets[n] == len(PROMPTS[0])
    assert all(b - a == len(piece) for a, b, piece in zip(offsets[n:], offsets[n + 1:], pieces[n:]))
    assert got[0] == (None, None)  # the first prompt token
    for (logprob, top), entry in zip(got[1:], want.prompt_logprobs[1:] + want.logprobs):
        assert close(logprob, entry.logprob)
        assert top == {offline.tokenizer.decode([t]): pytest.approx(lp, abs=TOLERANCE) for t, lp in entry.top}

    # Streamed: the same, split over chunks; the echo comes with the first.
    events = sse_events(server + "/v1/completions", {**body, "stream": True})
    chunks = [e["choices"][0] for e in events]
    assert chunks[0]["text"].startswith(PROMPTS[0]) and "".join(c["text"] for c in chunks) == choice["text"]
    streamed = {key: [x for c in chunks if c["logprobs"] for x in c["logprobs"][key]] for key in choice["logprobs"]}
    assert streamed["tokens"] == choice["logprobs"]["tokens"]
    assert streamed["text_offset"] == choice["logprobs"]["text_offset"]
    assert streamed["token_logprobs"][0] is None
    assert streamed["token_logprobs"][1:] == pytest.approx(choice["logprobs"]["token_logprobs"][1:], abs=TOLERANCE)
    assert sum(bool(c["logprobs"]) for c in chunks) > 1


def test_completions_through_the_openai_client(client, offline, hf_target):
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_k=4, seed=5, ignore_eos=True, logprobs=6)
    (want,) = offline.generate([PROMPTS[1]], params)
    check_result(hf_target, want, params)
    response = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0.7, seed=5,
                                         logprobs=6, extra_body={"top_k": 4, "ignore_eos": True})
    logprobs = response.choices[0].logprobs
    assert response.choices[0].text == want.text
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(want.token_ids)
    for logprob, top, entry in zip(logprobs.token_logprobs, logprobs.top_logprobs, want.logprobs):
        assert close(logprob, entry.logprob)
        # top_k 4 keeps 4 tokens: the other alternatives are dropped, -inf, which JSON shows as -9999.
        assert sorted(top.values(), reverse=True)[4:] == [-9999.0] * (len(top) - 4)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0.7, seed=5,
                                       logprobs=6, stream=True, extra_body={"top_k": 4, "ignore_eos": True})
    streamed = [lp for chunk in stream if chunk.choices[0].logprobs for lp in chunk.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(logprobs.token_logprobs, abs=TOLERANCE)


def test_chat_logprobs_through_the_openai_client_streamed_and_not(client, offline, hf_target):
    messages = [{"role": "user", "content": "Add two numbers."}]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    (want,) = offline.generate([offline.chat_prompt(messages)], params)
    check_result(hf_target, want, params)
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0.0,
                                              logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = response.choices[0].logprobs.content
    assert response.choices[0].message.content == want.text
    assert len(content) == len(want.token_ids)
    for item, entry in zip(content, want.logprobs):
        assert item.token == offline.tokenizer.decode([entry.token_id]) and close(item.logprob, entry.logprob)
        assert [(t.token, t.logprob) for t in item.top_logprobs] == [
            (offline.tokenizer.decode([t]), pytest.approx(lp, abs=TOLERANCE)) for t, lp in entry.top]
    # A byte-level token's bytes are its own: together they are the text's.
    special = offline.tokenizer.eos_token
    joined = bytes(b for item in content if item.token != special for b in item.bytes)
    assert joined.decode(errors="replace") == want.text

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0.0,
                                            logprobs=True, top_logprobs=2, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    assert [(i.token, i.bytes) for i in streamed] == [(i.token, i.bytes) for i in content]
    assert [i.logprob for i in streamed] == pytest.approx([i.logprob for i in content], abs=TOLERANCE)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text

    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", dict(logprobs=MAX_LOGPROBS + 1), "logprobs", f"in [0, {MAX_LOGPROBS}]"),
    ("/v1/completions", dict(logprobs=-1), "logprobs", f"in [0, {MAX_LOGPROBS}]"),
    ("/v1/completions", dict(logprobs=True), "logprobs", "valid integer"),
    ("/v1/chat/completions", dict(logprobs=True, top_logprobs=MAX_LOGPROBS + 1), "top_logprobs",
     f"in [0, {MAX_LOGPROBS}]"),
    ("/v1/chat/completions", dict(top_logprobs=2), "top_logprobs", "needs logprobs"),
])
def test_bad_logprob_fields_get_400_naming_them(server, path, body, param, message):
    request = dict(model=MODEL, max_tokens=3, **body)
    request.update(prompt="x = ") if path == "/v1/completions" else request.update(
        messages=[{"role": "user", "content": "hi"}])
    response = httpx.post(server + path, json=request, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and message in error["message"], error
