"""Requests that join a running batch, leave it, are aborted, and stream deltas (Engine.add_request /
step / abort), on tiny models: the tokens of every seeded request equal its offline generation."""
import time

import pytest
import torch

from specengine import Engine, SamplingParams
from specengine.drafters.model import ModelDrafter
from specengine.engine.text import settled_length
from specengine.engine.gamma import CostModel
from specengine.layers.kv_cache import StaticKVCache

from engine_util import make_engine, stop_across_tokens
from conftest import cpu_isa_limit

V = 32
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [3, 1, 4, 1, 5, 9, 2, 6]]


@pytest.fixture(scope="module")
def models(tiny_pair):
    return tiny_pair


def params(i: int, **kwargs) -> SamplingParams:
    """Mixed requests: greedy and sampled, different lengths, each with its own seed."""
    base = dict(max_new_tokens=(6, 17, 11, 23)[i % 4], temperature=(0.0, 1.0, 0.8, 1.3)[i % 4], seed=100 + i)
    return SamplingParams(**{**base, **kwargs})


def drive(engine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]]) -> dict[str, list]:
    """Run step() until nothing is left, adding arrivals[k] before step k; each request's outputs."""
    outputs: dict[str, list] = {}
    k = 0
    while engine.has_unfinished_requests() or any(s >= k for s in arrivals):
        for request_id, prompt, p in arrivals.get(k, []):
            engine.add_request(prompt, p, request_id)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        k += 1
    return outputs


def tokens_of(outputs) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


@pytest.mark.parametrize("drafter, kwargs", [
    ("model", {}), ("ngram", {}), ("none", {}),
    ("model", dict(cuda_graphs=True, max_batch_size=3)),  # fixed rows: later requests wait
    ("model", dict(cuda_graphs=True, max_batch_size=4, rounds_per_read=4)),  # blocks of rounds from device state
])
def test_requests_joining_mid_run_get_their_offline_tokens(models, drafter, kwargs):
    engine = make_engine(models, drafter, **kwargs)
    requests = [(f"r{i}", PROMPTS[i % 4], params(i)) for i in range(7)]
    alone = [engine.generate([prompt], p)[0].token_ids for _, prompt, p in requests]
    static = [r.token_ids for r in engine.generate([prompt for _, prompt, _ in requests], [p for *_, p in requests])]
    assert static == alone
    # Two at the start, then one joining at each of steps 1, 2, 4, 5 and 9 (some after others finished).
    outputs = drive(engine, {0: requests[:2], 1: requests[2:3], 2: requests[3:4], 4: requests[4:5],
                             5: requests[5:6], 9: requests[6:7]})
    for (request_id, _, p), want in zip(requests, alone):
        outs = outputs[request_id]
        assert tokens_of(outs) == want
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].finish_reason == "length" and outs[-1].stats.generated_tokens == p.max_new_tokens
        assert all(o.new_token_ids for o in outs)  # every step of a running request adds tokens
    assert engine.num_running == engine.num_waiting == 0 and engine.scheduler.batch.cache.batch_size == 0


def test_rows_past_max_batch_size_wait_first_come_first_served(models):
    engine = make_engine(models, cuda_graphs=True, max_batch_size=2)
    order = []
    ids = [engine.add_request(PROMPTS[i % 4], params(i, max_new_tokens=4 + i)) for i in range(6)]
    seen = set()
    while engine.has_unfinished_requests():
        assert engine.num_running <= 2
        for out in engine.step():
            if out.request_id not in seen:
                seen.add(out.request_id)
                order.append(out.request_id)
    assert order == ids  # admitted (first reported) in arrival order, none left behind


def test_abort_frees_the_row_at_once_and_is_reported(models):
    engine = make_engine(models, cuda_graphs=True, max_batch_size=2)
    want_b = engine.generate([PROMPTS[1]], params(1, max_new_tokens=40))[0].token_ids
    a = engine.add_request(PROMPTS[0], params(0, max_new_tokens=40))
    b = engine.add_request(PROMPTS[1], params(1, max_new_tokens=40))
    c = engine.add_request(PROMPTS[2], params(2, max_new_tokens=5))  # waits for a row
    outputs = engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 1
    assert engine.abort(a) and engine.num_running == 1 and engine.scheduler.batch.cache.batch_size == 1
    assert engine.abort(c) and engine.num_waiting == 0
    assert not engine.abort(a) and not engine.abort("no such request")
    outputs += engine.step()
    aborted = {o.request_id: o for o in outputs if o.finish_reason == "abort"}
    assert set(aborted) == {a, c} and all(o.finished and o.new_token_ids == [] for o in aborted.values())
    while engine.has_unfinished_requests():
        outputs += engine.step()
    # The request left alone decodes on as it does by itself.
    assert tokens_of([o for o in outputs if o.request_id == b]) == want_b


def test_auto_gamma_keeps_choosing_as_rows_come_and_go(models):
    target, _ = models
    # A perfect draft, costed as if it were cheap (this one is the target: it would never pay).
    costs = CostModel(draft_step_s=1e-4, verify_s=(1e-2,) * 5)
    engine = Engine(target, drafter=ModelDrafter(target, V, V), gamma="auto", max_gamma=4, costs=costs)
    greedy = SamplingParams(max_new_tokens=30, temperature=0.0)
    want = {i: Engine(target).generate([PROMPTS[i % 4]], greedy)[0].token_ids for i in range(5)}
    outputs = drive(engine, {0: [("r0", PROMPTS[0], greedy)], 3: [("r1", PROMPTS[1], greedy)],
                             4: [("r2", PROMPTS[2], greedy), ("r3", PROMPTS[3], greedy)],
                             8: [("r4", PROMPTS[0], greedy)]})
    assert {int(k[1:]): tokens_of(v) for k, v in outputs.items()} == want
    assert sum(o[-1].stats.accepted for o in outputs.values()) > 0  # it drafted


def test_cache_grows_with_the_sequences_not_with_what_they_may_reach(models):
    """An eager cache holds what its rows use: it grows (copying the running rows' entries) as
    they lengthen and as rows join, not to prompt + max_new_tokens up front."""
    engine = make_engine(models)
    short, long = params(0, max_new_tokens=8, temperature=1.0), params(1, max_new_tokens=200)
    want_short = engine.generate([PROMPTS[0]], short)[0].token_ids
    want_long = engine.generate([PROMPTS[1]], long)[0].token_ids
    fresh = make_engine(models)
    fresh.add_request(PROMPTS[1], long, "long")
    first = fresh.step()
    assert fresh.scheduler.batch.cache.capacity < len(PROMPTS[1]) + 200 / 2  # not sized for all it may reach
    rest = drive(fresh, {0: [("short", PROMPTS[0], short)]})
    assert tokens_of(first + rest["long"]) == want_long and tokens_of(rest["short"]) == want_short
    assert fresh.scheduler.batch.cache.capacity >= len(PROMPTS[1]) + 200 - 1 and fresh.scheduler.batch.cache.allocated_rows == 2


def test_reserve_keeps_rows_and_entries():
    cache = StaticKVCache(2, 2, 8, 1, 4, torch.float32, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    cache.lengths.copy_(torch.tensor([5, 3]))
    k, v = cache.k.clone(), cache.v.clone()
    cache.reserve(3, 20)
    assert cache.allocated_rows == 4 and cache.capacity == 20 and cache.lengths.tolist() == [5, 3]
    assert torch.equal(cache.k[:, :2, :8], k[:, :, :8]) and torch.equal(cache.v[:, :2, :8], v[:, :, :8])
    view = cache.add_rows(2)
    assert cache.batch_size == 4 and view.batch_size == 2 and view.lengths.tolist() == [0, 0]
    view.layer(1)[0][1, 4] = 7.0  # a view shares the cache's storage
    assert torch.all(cache.k[1, 3, 4] == 7.0)
    fixed = StaticKVCache(1, 2, 8, 1, 4, torch.float32, "cpu", growable=False)
    with pytest.raises(ValueError, match="fixed at 2 rows of 8 positions"):
        fixed.reserve(3, 8)


def test_bad_requests_are_refused_at_add_request_and_leave_nothing_queued(models):
    engine = make_engine(models)
    engine.add_request(PROMPTS[0], params(0), request_id="x")
    with pytest.raises(ValueError, match="request_id 'x' is already in flight"):
        engine.add_request(PROMPTS[1], params(1), request_id="x")
    with pytest.raises(TypeError, match="request_id must be a string, got int"):
        engine.add_request(PROMPTS[1], params(1), request_id=7)
    with pytest.raises(ValueError, match=r"prompt token ids must be integers in \[0, 32\)"):
        engine.add_request([1, 99])
    with pytest.raises(TypeError, match="params must be SamplingParams"):
        engine.add_request([1, 2], {"temperature": 0})
    with pytest.raises(RuntimeError, match="would also run the 1 requests in flight"):
        engine.generate([[1, 2]])
    assert engine.num_waiting == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.step() == []  # nothing to do


# ---- text deltas ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def text_engine(text_pair):
    return Engine.from_pretrained(*text_pair, gamma=3)


def test_deltas_add_up_to_the_offline_text(text_engine):
    engine = text_engine
    prompts = ["def add(a, b):", "import os\n", "x = [1, 2,"]
    ps = [SamplingParams(max_new_tokens=n, temperature=t, seed=s, ignore_eos=True)
          for n, t, s in [(25, 0.9, 1), (14, 0.0, 2), (31, 1.2, 3)]]
    want = engine.generate(prompts, ps)
    outputs = drive(engine, {0: [("a", prompts[0], ps[0])], 2: [("b", prompts[1], ps[1]), ("c", prompts[2], ps[2])]})
    for request_id, result in zip("abc", want):
        outs = outputs[request_id]
        assert tokens_of(outs) == result.token_ids
        assert "".join(o.new_text for o in outs) == result.text
        # what was sent is always a prefix of the text so far (nothing is taken back)
        for n in range(1, len(outs) + 1):
            sent = "".join(o.new_text for o in outs[:n])
            assert engine.tokenizer.decode(tokens_of(outs[:n]), skip_special_tokens=True).startswith(sent)


def test_a_stop_string_spanning_tokens_is_never_sent(text_engine):
    engine = text_engine
    free = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    full = engine.generate(["x = 1\n"], free)[0]
    stop = stop_across_tokens(engine.tokenizer, full)
    stopped = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True, stop=(stop,))
    want = engine.generate(["x = 1\n"], stopped)[0]
    assert want.finish_reason == "stop" and want.text == full.text[:full.text.find(stop)]
    outputs = drive(engine, {0: [("s", "x = 1\n", stopped)]})["s"]
    sent = ""
    for out in outputs:
        sent += out.new_text
        assert stop not in sent and (out.finished or not any(sent.endswith(stop[:k]) for k in range(1, len(stop))))
    assert sent == want.text and outputs[-1].finish_reason == "stop"


def test_a_stream_stopped_early_frees_its_row(text_engine):
    pieces = text_engine.stream("def f(", SamplingParams(max_new_tokens=40, ignore_eos=True, seed=3))
    next(pieces)
    assert text_engine.has_unfinished_requests()
    pieces.close()
    assert not text_engine.has_unfinished_requests() and text_engine.num_running == 0
    with pytest.raises(ValueError, match=r"stream\(\) needs a tokenizer"):
        next(Engine(text_engine.target).stream([1, 2]))


@pytest.mark.parametrize("text, stop, settled", [
    ("hello wor", ("world",), 6),          # "wor" may become "world"
    ("hello", ("world",), 5),
    ("abc\ufffd", (), 3),                  # an unfinished UTF-8 sequence
    ("abc\ufffd\ufffd", ("c",), 3),        # "c" is a whole stop string, so it is not held (it would have ended it)
    ("a<|im", ("<|im_end|>", "<|e"), 1),
    ("", ("x",), 0),
])
def test_settled_length(text, stop, settled):
    assert settled_length(text, stop) == settled


# ---- AsyncEngine ------------------------------------------------------------------------------

def test_async_streams_equal_offline_and_a_cancelled_one_is_aborted(models):
    import asyncio

    from specengine import AsyncEngine

    engine = make_engine(models, cuda_graphs=True, max_batch_size=3)
    want = [engine.generate([PROMPTS[i % 4]], params(i))[0].token_ids for i in range(5)]
    async_engine = AsyncEngine(engine)

    async def collect(i):
        return [t async for out in async_engine.generate_async(PROMPTS[i % 4], params(i)) for t in out.new_token_ids]

    async def cancelled():
        stream = async_engine.generate_async(PROMPTS[0], params(0, max_new_tokens=200), request_id="dropped")
        await stream.__anext__()
        await stream.aclose()  # the consumer goes away
        return "dropped" not in engine.unfinished_request_ids

    async def main():
        with pytest.raises(ValueError, match="prompt is empty"):
            await async_engine.generate_async([], params(0)).__anext__()
        results = await asyncio.gather(*(collect(i) for i in range(5)), cancelled())
        await async_engine.close()
        return results

    *got, dropped_freed = asyncio.run(main())
    assert got == want and dropped_freed and not engine.has_unfinished_requests()


def test_the_driver_waits_once_requests_finish(models):
    """No step runs while nothing is unfinished: the driver awaits its wake event. Counted, not
    timed: in the window neither step() nor the checks a spinning loop would make are called."""
    import asyncio

    from specengine import AsyncEngine

    engine = make_engine(models)
    async_engine = AsyncEngine(engine)
    calls = []
    for name in ("step", "has_unfinished_requests", "has_pending_outputs"):
        method = getattr(engine, name)
        setattr(engine, name, lambda method=method, name=name: calls.append(name) or method())

    async def main():
        outs = [out async for out in async_engine.generate_async(PROMPTS[0], params(0))]
        for _ in range(10):  # the driver runs on this loop: it reaches its wait within a few passes
            await asyncio.sleep(0)
        before = len(calls)
        for _ in range(100):
            await asyncio.sleep(0)  # a loop that spins with sleep(0) is seen here ...
        await asyncio.sleep(0.3)    # ... and one that polls on a timer here
        idle = calls[before:], async_engine._driver.done()
        await async_engine.close()
        return outs, idle

    outs, (made, done) = asyncio.run(main())
    assert outs[-1].finished and made == [] and not done


class _OddEngine:
    """What AsyncEngine calls of an Engine, broken on purpose: each request is `unfinished` but
    neither running nor waiting, or its step raises once; abort() may fail to end a request."""

    def __init__(self, lose: bool = False, fail: bool = False, abort_works: bool = True):
        self.lose, self.fail, self.abort_works = lose, fail, abort_works
        self._unfinished, self._pending = {}, []
        self.num_running = self.num_waiting = 0
        self.steps = 0

    def add_request(self, prompt, params=None, request_id=None):
        self._unfinished[request_id] = prompt
        if not self.lose:
            self.num_running += 1
        return request_id

    def _final(self, request_id, reason, message):
        from specengine.engine.request import DecodeStats, RequestOutput

        return RequestOutput(request_id, [], "", True, reason, DecodeStats(gamma=1), message)

    def step(self):
        self.steps += 1
        outputs, self._pending = self._pending, []
        if self.num_running:
            if self.fail:
                self.fail = False
                self._pending = [self._final(r, "abort", "aborted: the round failed") for r in self._unfinished]
                self._unfinished.clear()
                self.num_running = 0
                raise RuntimeError("the round failed")
            outputs += [self._final(r, "length", "") for r in self._unfinished]
            self._unfinished.clear()
            self.num_running = 0
        return outputs

    def abort(self, request_id):
        if not self.abort_works or request_id not in self._unfinished:
            return False
        del self._unfinished[request_id]
        self._pending.append(self._final(request_id, "abort", "aborted"))
        return True

    def has_unfinished_requests(self):
        return bool(self._unfinished)

    @property
    def unfinished_request_ids(self):
        return list(self._unfinished)

    def has_pending_outputs(self):
        return bool(self._pending)


def _read_one(engine, answered: bool = True, seconds: float = 0.5):
    """(the outputs of one request, steps run, seconds watched, the async engine). answered: the
    reader is waited on for as long as it takes (on a slow machine too), then the driver watched
    for `seconds` more; otherwise the reader gets no answer in `seconds` (outputs None)."""
    import asyncio

    from specengine import AsyncEngine

    async_engine = AsyncEngine(engine)

    async def main():
        started = time.monotonic()
        async_engine.add_request([1], request_id="r")

        async def read():
            return [out async for out in async_engine.outputs("r")]

        reader = asyncio.create_task(read())
        if answered:
            outs = await asyncio.wait_for(reader, 120)
            await asyncio.sleep(seconds)
        else:
            await asyncio.sleep(seconds)
            assert not reader.done(), "the request was answered"
            reader.cancel()
            outs = None
        watched = time.monotonic() - started
        await async_engine.close()
        return outs, engine.steps, watched

    return *asyncio.run(main()), async_engine


def test_a_request_the_engine_lost_is_ended_not_spun_on(caplog):
    """Unfinished, neither running nor waiting: stepping would return nothing forever. The driver
    logs it once, ends the request (its reader gets an answer) and waits."""
    with caplog.at_level("ERROR", logger="specengine"):
        outs, steps, _, _ = _read_one(_OddEngine(lose=True))
    (out,) = outs
    assert out.finish_reason == "abort" and "lost track" in out.message
    assert steps <= 3
    assert sum("neither running nor waiting" in r.getMessage() for r in caplog.records) == 1


def test_a_request_that_cannot_be_ended_is_waited_on_not_spun_on(caplog):
    with caplog.at_level("ERROR", logger="specengine"):
        outs, steps, watched, _ = _read_one(_OddEngine(lose=True, abort_works=False), answered=False, seconds=1.5)
    assert outs is None and 1 <= steps <= 2 + watched  # re-checked once a second (however long the watch took)
    assert sum("neither running nor waiting" in r.getMessage() for r in caplog.records) == 1


def test_a_failed_step_is_logged_with_its_traceback(caplog):
    with caplog.at_level("ERROR", logger="specengine"):
        outs, steps, _, _ = _read_one(_OddEngine(fail=True))
    (out,) = outs
    assert out.finish_reason == "abort" and steps == 2
    (record,) = [r for r in caplog.records if "a step failed" in r.getMessage()]
    assert record.exc_info and "the round failed" in str(record.exc_info[1])


def test_an_open_streams_id_is_not_reused_and_close_ends_open_streams(models):
    import asyncio

    from specengine import AsyncEngine

    async_engine = AsyncEngine(make_engine(models))

    async def main():
        async_engine.add_request(PROMPTS[0], params(0, max_new_tokens=2), request_id="x")
        while async_engine.engine.has_unfinished_requests():
            await asyncio.sleep(0.01)
        # Finished, but its reader has not read it yet: a second "x" would take its outputs.
        with pytest.raises(ValueError, match="'x' is already in flight"):
            async_engine.add_request(PROMPTS[1], params(1), request_id="x")
        first = [out async for out in async_engine.outputs("x")]
        async_engine.add_request(PROMPTS[1], params(1, max_new_tokens=500), request_id="x")  # free again
        outputs = async_engine.outputs("x")
        await outputs.__anext__()
        await async_engine.close()
        rest = [out async for out in outputs]  # the open stream ends rather than wait forever
        return first, rest

    first, rest = asyncio.run(main())
    assert first[-1].finish_reason == "length"
    assert rest[-1].finished and rest[-1].finish_reason == "abort" and rest[-1].message == "the engine was closed"


# ---- batch invariance of the numbers themselves --------------------------------------------------

@pytest.fixture(scope="module")
def wide_bf16_model(tmp_path_factory):
    """A bfloat16 checkpoint of two SmolLM2-sized layers: sgemm's result for a row of the down
    projection (1536 -> 576) changed with the rows in the call."""
    from specengine.models import load_model
    from specengine.devtools.tiny import make_config, save_random_checkpoint

    folder = tmp_path_factory.mktemp("wide")
    save_random_checkpoint(folder, make_config(vocab_size=64, hidden_size=576, intermediate_size=1536, num_layers=2,
                                                   num_heads=9, num_kv_heads=3),
                           seed=4, init_std=0.1, dtype=torch.bfloat16)
    return load_model(folder)


def cache_rows_after(model, prompts, groups):
    """K/V entries of each prompt (all but its last token), prefilled in one call per group (lists
    of prompt indices, padded to the group's longest)."""
    from specengine.steps.feed import feed

    entries = {}
    for group in groups:
        cache = model.new_cache(len(group), 128)
        cache.reset(len(group))
        with torch.inference_mode():
            feed(model, cache, [prompts[i][:-1] for i in group], cached=[0] * len(group))
        for row, i in enumerate(group):
            n = len(prompts[i]) - 1
            entries[i] = (cache.k[:, row, :n].clone(), cache.v[:, row, :n].clone())
    return entries


@pytest.mark.parametrize("isa,block", [("amx", "per row"), ("avx512", "fixed"), ("avx512", "one GEMM per call")])
def test_a_prompts_cache_entries_do_not_depend_on_the_prompts_prefilled_with_it(wide_bf16_model, isa, block,
                                                                                monkeypatch):
    """The AMX GEMM sums each row on its own; the widened-weight sgemm runs in fixed blocks of rows."""
    from specengine.ops import product
    from specengine.ops.product import GEMM_MIN_TOKENS_PER_ROW

    if block == "one GEMM per call":
        # Planted: a product whose summation order follows the rows in the call, as one sgemm over
        # all of them does on some BLAS builds (others keep rows independent: the plant must not
        # depend on which).
        def by_call(x, w, bias):
            step = 64 * (1 + x.numel() // x.shape[-1] % 3)
            out = sum(torch.nn.functional.linear(x[..., k:k + step], w[:, k:k + step].float())
                      for k in range(0, x.shape[-1], step))
            return out if bias is None else out + bias
        monkeypatch.setattr(product, "gemm_blocks_cpp", by_call)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (41, 90, 12, 66, 35, 100)]
    # The engine never mixes prompts below GEMM_MIN_TOKENS_PER_ROW tokens with longer ones in a
    # call (they take another product, see ops.product); the longer ones go in one call.
    long = [i for i in range(len(prompts)) if len(prompts[i]) - 1 >= GEMM_MIN_TOKENS_PER_ROW]
    short = [[i] for i in range(len(prompts)) if i not in long]
    with cpu_isa_limit(isa):
        alone = cache_rows_after(wide_bf16_model, prompts, [[i] for i in range(len(prompts))])
        together = cache_rows_after(wide_bf16_model, prompts, [long] + short)
    same = all(torch.equal(alone[i][0], together[i][0]) and torch.equal(alone[i][1], together[i][1])
               for i in range(len(prompts)))
    assert same == (block != "one GEMM per call")


def test_a_failed_prefill_ends_only_the_joiners(models, monkeypatch):
    from specengine.engine import runner

    engine = make_engine(models)
    want = engine.generate([PROMPTS[1]], params(1))[0].token_ids
    outputs = drive(engine, {0: [("runs", PROMPTS[1], params(1, max_new_tokens=4))]})  # its id is free again after
    engine.add_request(PROMPTS[1], params(1), "runs")
    first = engine.step()
    engine.add_request(PROMPTS[3], params(3), "joins")
    real = runner.prefill_chunks

    def broken(*args):
        real(*args)  # rows fed, then the failure
        raise RuntimeError("out of memory")

    monkeypatch.setattr(runner, "prefill_chunks", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.step()
    monkeypatch.undo()
    assert engine.num_running == 1 and engine.cache_rows_in_use == 1 and engine.drafter.cache.batch_size == 1
    rest = drive(engine, {})
    (joined,) = rest.pop("joins")
    assert joined.finish_reason == "abort" and "its prefill failed" in joined.message
    assert tokens_of(first + rest["runs"]) == want and outputs["runs"][-1].finished
