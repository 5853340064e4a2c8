"""Fault injection: random schedules of add_request, step, generate, stream and abort on one engine,
on every path the engine runs (host rounds with a draft model, the n-gram drafter and none, the
fixed-shape steps, blocks of rounds from device state, gamma="auto", a T5 pair). Whatever the
schedule: no call raises, the engine drains, every request that was not aborted gets exactly the
tokens it gets alone, an aborted one a prefix of them, and no row or cache entry is left held.

Schedules are drawn by hypothesis (derandomized: CI runs the same ones every time)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from specengine import Engine, SamplingParams
from specengine.drafters.model import ModelDrafter
from specengine.drafters.ngram import NgramDrafter
from specengine.engine.gamma import CostModel

from engine_util import tiny_model

V, EOS = 32, 7
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [3, 1, 4, 1, 5, 9, 2, 6], [2, 2, 2, 2, 2]]
# Greedy and seeded sampling with every warp; lengths from 1 token; some end at EOS.
PARAMS = [
    SamplingParams(max_new_tokens=9, temperature=0.0),
    SamplingParams(max_new_tokens=14, temperature=1.0, seed=3, ignore_eos=True),
    SamplingParams(max_new_tokens=1, temperature=0.0),
    SamplingParams(max_new_tokens=11, temperature=0.8, top_k=5, seed=4),
    SamplingParams(max_new_tokens=17, temperature=1.2, top_p=0.8, min_p=0.05, seed=5, ignore_eos=True),
    SamplingParams(max_new_tokens=6, temperature=1.0, seed=6),
]
# With a tokenizer: text prompts, and stop strings (single characters and pairs, which random
# models' text soon holds, across token boundaries too).
TEXT_PROMPTS = ["def f(x):", "import os\n", "x", "class A:\n    pass\n", "# a comment"]
TEXT_PARAMS = [
    SamplingParams(max_new_tokens=12, temperature=0.0, stop=("e",)),
    SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, stop=("in", ":")),
    SamplingParams(max_new_tokens=1, temperature=0.0),
    SamplingParams(max_new_tokens=10, temperature=0.8, top_k=5, seed=4, ignore_eos=True),
    SamplingParams(max_new_tokens=14, temperature=1.2, top_p=0.8, seed=5, stop=("s",)),
    SamplingParams(max_new_tokens=6, temperature=1.0, seed=6),
]
# An EOS-prone pair (logits scaled up: confident, so drafts are accepted and EOS comes early).
MODELS = (tiny_model(V, seed=0, eos=EOS, logit_scale=3.0), tiny_model(V, seed=5, num_layers=1, logit_scale=3.0))
FLAT_COSTS = {b: CostModel(0.1, tuple(1.0 + 0.05 * k for k in range(5))) for b in (1, 8)}


@functools.cache
def text_models():
    from specengine.devtools.tiny import train_tokenizer

    tokenizer = train_tokenizer(vocab_size=300)
    vocab = len(tokenizer)
    return (tiny_model(vocab, seed=0, eos=tokenizer.eos_token_id, logit_scale=2.0),
            tiny_model(vocab, seed=5, num_layers=1, logit_scale=2.0), tokenizer)


@functools.cache
def t5_folder() -> str:
    import tempfile

    from specengine.devtools.tiny import make_t5_config, save_random_t5_checkpoint

    folder = tempfile.mkdtemp(prefix="specengine-faults-t5-")
    cfg = make_t5_config(vocab_size=V, eos_token_id=EOS, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                         relative_attention_num_buckets=8, relative_attention_max_distance=12)
    save_random_t5_checkpoint(folder, cfg, seed=0, init_scale=2.0)
    return folder


def t5_engine() -> Engine:
    return Engine.from_pretrained(t5_folder(), drafter="ngram", gamma=2)


def text_engine() -> Engine:
    target, draft, tokenizer = text_models()
    return Engine(target, tokenizer, ModelDrafter(draft, len(tokenizer), len(tokenizer)), gamma=3)


PATHS = {
    "model": lambda: Engine(MODELS[0], drafter=ModelDrafter(MODELS[1], V, V), gamma=3),
    "ngram": lambda: Engine(MODELS[0], drafter=NgramDrafter(1, 2), gamma=2),
    "target-only": lambda: Engine(MODELS[0]),
    "fixed-shape steps": lambda: Engine(MODELS[0], drafter=ModelDrafter(MODELS[1], V, V), gamma=2,
                                        cuda_graphs=True, max_batch_size=3),
    "blocks": lambda: Engine(MODELS[0], drafter=ModelDrafter(MODELS[1], V, V), gamma=2, cuda_graphs=True,
                             max_batch_size=4, rounds_per_read=4),
    "auto gamma": lambda: Engine(MODELS[0], drafter=ModelDrafter(MODELS[1], V, V), gamma="auto", max_gamma=4,
                                 costs=FLAT_COSTS),
    "t5": t5_engine,
    "text, stop strings": text_engine,
}


def prompts_and_params(path: str) -> tuple[list, list[SamplingParams]]:
    return (TEXT_PROMPTS, TEXT_PARAMS) if path == "text, stop strings" else (PROMPTS, PARAMS)


@functools.cache
def engine_for(path: str) -> Engine:
    """The engine under test, one per path, kept across examples: state left by one schedule would
    show in the next."""
    return PATHS[path]()


@functools.cache
def reference_engine(path: str) -> Engine:
    return PATHS[path]()


@functools.cache
def alone(path: str, prompt: int, params: int) -> tuple[tuple[int, ...], str, str | None]:
    """(tokens, finish reason, text) of a request generated alone, on an engine of its own."""
    prompts, all_params = prompts_and_params(path)
    (result,) = reference_engine(path).generate([prompts[prompt]], all_params[params])
    return tuple(result.token_ids), result.finish_reason, result.text


def same_tokens_as_alone(path: str, params: int) -> bool:
    """Whether a request's tokens are its tokens alone whatever ran beside it. gamma="auto" picks
    each round's gamma from timings and the batch's acceptance: a sampled request's tokens then
    follow the exact distribution, but which tokens depends on the drafts (greedy ones do not)."""
    return path != "auto gamma" or prompts_and_params(path)[1][params].temperature == 0


def check_tokens(path: str, prompt: int, params: int, tokens: tuple, reason: str, partial: bool = False):
    want, want_reason, _ = alone(path, prompt, params)
    if not same_tokens_as_alone(path, params):
        assert len(tokens) <= prompts_and_params(path)[1][params].max_new_tokens and reason in (want_reason, "stop",
                                                                                                 "abort")
    elif partial:
        assert tokens == want[:len(tokens)]
    else:
        assert (tokens, reason) == (want, want_reason)


@dataclass
class Add:
    prompt: int
    params: int


@dataclass
class Step:
    pass


@dataclass
class Abort:
    which: int  # an index into the requests added so far (any row, any state), or -1: an unknown id


@dataclass
class Generate:
    prompts: list[int]
    params: int


@dataclass
class Stream:
    prompt: int
    params: int
    pieces: int  # stop reading after this many outputs (0: read to the end)


# Weighted towards what builds a batch worth breaking: requests joining, steps, aborts.
ADD = st.builds(Add, st.integers(0, len(PROMPTS) - 1), st.integers(0, len(PARAMS) - 1))
ABORT = st.builds(Abort, st.integers(-1, 5))
OPS = st.one_of(
    ADD, ADD, ADD, st.builds(Step), st.builds(Step), st.builds(Step), ABORT, ABORT,
    st.builds(Generate, st.lists(st.integers(0, len(PROMPTS) - 1), min_size=1, max_size=3),
              st.integers(0, len(PARAMS) - 1)),
    st.builds(Stream, st.integers(0, len(PROMPTS) - 1), st.integers(0, len(PARAMS) - 1), st.integers(0, 3)),
)
# The reported case: three requests, two steps, abort the first (not the batch's last row).
REPORTED = [Add(0, 1), Add(1, 1), Add(3, 1), Step(), Step(), Abort(0), Step(), Add(2, 0), Abort(1)]


def run_schedule(path: str, schedule: list) -> None:
    engine = engine_for(path)
    PROMPTS, PARAMS = prompts_and_params(path)  # noqa: N806
    added: list[tuple[str, int, int]] = []  # (request id, prompt, params) of add_request
    outputs: dict[str, list] = {}
    aborted: set[str] = set()

    def record(outs):
        for out in outs:
            assert not outputs.get(out.request_id) or not outputs[out.request_id][-1].finished, \
                f"{out.request_id} reported after it finished"
            outputs.setdefault(out.request_id, []).append(out)

    for op in schedule:
        if isinstance(op, Add):
            added.append((engine.add_request(PROMPTS[op.prompt], PARAMS[op.params]), op.prompt, op.params))
        elif isinstance(op, Step):
            record(engine.step())
        elif isinstance(op, Abort):
            if op.which < 0 or op.which >= len(added):
                assert engine.abort("no-such-request") is False
                continue
            request_id = added[op.which][0]
            live = request_id not in aborted and not (outputs.get(request_id) and outputs[request_id][-1].finished)
            assert engine.abort(request_id) is live
            if live:
                aborted.add(request_id)
            assert engine.abort(request_id) is False  # twice: nothing left to end
        elif isinstance(op, Generate):
            params = PARAMS[op.params]
            if engine.has_unfinished_requests():
                with pytest.raises(RuntimeError, match="requests in flight"):
                    engine.generate([PROMPTS[p] for p in op.prompts], params)
                continue
            results = engine.generate([PROMPTS[p] for p in op.prompts], params)
            for p, result in zip(op.prompts, results):
                check_tokens(path, p, op.params, tuple(result.token_ids), result.finish_reason)
            assert not engine.has_unfinished_requests() and engine.num_running == 0
        elif isinstance(op, Stream):
            if engine.tokenizer is None:
                continue  # stream() yields text
            if engine.has_unfinished_requests():
                with pytest.raises(RuntimeError, match="requests in flight"):
                    next(engine.stream(PROMPTS[op.prompt], PARAMS[op.params]))
                continue
            pieces = engine.stream(PROMPTS[op.prompt], PARAMS[op.params])
            text = "".join(piece for _, piece in zip(range(op.pieces or 10_000), pieces))
            pieces.close()  # left early: the request must not keep its row
            want = alone(path, op.prompt, op.params)[2]
            if same_tokens_as_alone(path, op.params):
                assert want.startswith(text) and (op.pieces or text == want)
            assert not engine.has_unfinished_requests() and engine.num_running == 0

    # Drain: every request ends within a bounded number of steps (the engine never spins).
    for _ in range(200):
        if not (engine.has_unfinished_requests() or engine.has_pending_outputs()):
            break
        record(engine.step())
    assert not engine.has_unfinished_requests() and not engine.has_pending_outputs(), "the engine did not drain"
    assert engine.num_running == 0 and engine.num_waiting == 0 and engine.cache_rows_in_use == 0
    drafter_cache = getattr(engine.drafter, "cache", None)
    assert drafter_cache is None or drafter_cache.batch_size == 0

    for request_id, prompt, params in added:
        outs = outputs[request_id]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], request_id
        tokens = tuple(t for o in outs for t in o.new_token_ids)
        if request_id in aborted:
            assert outs[-1].finish_reason == "abort"
        check_tokens(path, prompt, params, tokens, outs[-1].finish_reason, partial=request_id in aborted)


@pytest.mark.parametrize("path", list(PATHS))
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(schedule=st.lists(OPS, min_size=1, max_size=20))
@example(schedule=REPORTED)
def test_random_schedules_drain_and_each_request_gets_its_own_tokens(path, schedule):
    run_schedule(path, schedule)


def test_aborting_a_middle_row_leaves_the_others_alone():
    """The reported case: three requests, two steps, abort the first (not the batch's last row)."""
    engine = PATHS["model"]()
    ids = [engine.add_request(PROMPTS[i], PARAMS[1]) for i in range(3)]
    outputs = {i: [] for i in ids}
    for _ in range(2):
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert engine.abort(ids[0]) and engine.num_running == 2
    while engine.has_unfinished_requests() or engine.has_pending_outputs():
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert outputs[ids[0]][-1].finish_reason == "abort"
    for i, request_id in enumerate(ids[1:], 1):
        tokens = tuple(t for o in outputs[request_id] for t in o.new_token_ids)
        assert (tokens, outputs[request_id][-1].finish_reason) == alone("model", i, 1)[:2]
    assert engine.cache_rows_in_use == 0 and engine.drafter.cache.batch_size == 0


def test_a_row_with_broken_logits_ends_alone():
    """A row whose logits turn NaN ends with the reason; the rows beside it keep their tokens."""
    target = tiny_model(V, seed=0, logit_scale=3.0)
    with torch.no_grad():
        target.model.embed_tokens.weight[30] = float("nan")  # only a sequence holding token 30 breaks
    for engine in (Engine(target, drafter=NgramDrafter(1, 2), gamma=2), Engine(target)):
        params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        good = engine.add_request([1, 2, 3], params)
        bad = engine.add_request([4, 30, 5], params)
        outputs = {good: [], bad: []}
        failures = 0
        while engine.has_unfinished_requests() or engine.has_pending_outputs():
            try:
                outs = engine.step()
            except ValueError as exc:
                assert "target logits contain NaN" in str(exc)
                failures += 1
                continue
            for out in outs:
                outputs[out.request_id].append(out)
        assert failures == 1
        assert outputs[bad][-1].finish_reason == "abort" and "target logits contain NaN" in outputs[bad][-1].message
        tokens = [t for o in outputs[good] for t in o.new_token_ids]
        assert tokens == Engine(target).generate([[1, 2, 3]], params)[0].token_ids


def test_a_failing_row_move_ends_the_running_requests_with_the_reason(monkeypatch):
    """Should freeing an aborted request's row fail, the others end (reported, with why) rather than
    decode from caches in an unknown state, and the engine serves on."""
    engine = PATHS["model"]()
    ids = [engine.add_request(PROMPTS[i], PARAMS[0]) for i in range(3)]
    engine.step()

    def broken(rows):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.scheduler.batch.cache, "keep_rows", broken)
    assert engine.abort(ids[0])
    monkeypatch.undo()
    outs = {o.request_id: o for o in engine.step()}
    assert set(outs) == set(ids) and all(o.finish_reason == "abort" for o in outs.values())
    assert "device lost" in outs[ids[1]].message
    assert not engine.has_unfinished_requests() and engine.num_running == 0
    assert engine.generate([PROMPTS[0]], PARAMS[0])[0].token_ids == list(alone("model", 0, 0)[0])


@pytest.mark.parametrize("prompt, params, message", [
    (None, None, "prompt must be a string or a list of token ids, got NoneType"),
    (3.5, None, "prompt must be a string or a list of token ids, got float"),
    ([1, 2], {"temperature": 0}, "params must be SamplingParams or a list of them, got dict"),
])
def test_bad_arguments_are_named(prompt, params, message):
    engine = engine_for("target-only")
    with pytest.raises(TypeError, match=message):
        engine.add_request(prompt, params)
    with pytest.raises(TypeError, match="request_id must be a string, got int"):
        engine.add_request([1, 2], request_id=7)
    with pytest.raises(TypeError, match="request_id must be a string, got NoneType"):
        engine.abort(None)
    assert not engine.has_unfinished_requests()
