"""The prefix cache (engine.prefix_cache): blocks of prompt KV by chained content hash, reused by
later requests starting alike. Outputs are the same with and without it (greedy, seeded, in any
batch), with prefixes that overlap, were evicted, or came from an aborted request; the cached
entries are the prefill's bit for bit, the draft model's too; stats and metrics count the hits."""
import pytest
import torch

from specengine import Engine, SamplingParams
from specengine.engine.config import EngineConfig
from specengine.engine.prefix_cache import BLOCK, PrefixCache, block_keys

from engine_util import make_engine

V = 32


@pytest.fixture(scope="module")
def models(tiny_pair):
    return tiny_pair


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = tokens(200, seed=1)       # a shared preamble: three full blocks and a part
FEW_SHOT = SYSTEM + tokens(90, seed=2)


# Prompts that share prefixes of every kind: whole blocks, a block and a part, one inside another,
# none, a prompt that is another's prefix, one that ends on a block edge, and an agent's transcript
# (an earlier prompt plus more).
PROMPTS = [SYSTEM + tokens(30, 3), SYSTEM + tokens(70, 4), FEW_SHOT + tokens(20, 5), tokens(150, 6), SYSTEM[:129],
           FEW_SHOT[:257], SYSTEM + tokens(30, 3) + tokens(100, 7), SYSTEM[:40]]
PARAMS = [SamplingParams(max_new_tokens=12, temperature=(0.0, 1.0, 0.7)[i % 3], seed=i) for i in range(len(PROMPTS))]


def test_block_keys_chain_over_the_whole_prefix():
    a, b = tokens(3 * BLOCK + 5, 1), tokens(BLOCK, 2)
    keys = block_keys(a)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert block_keys(a[:2 * BLOCK]) == keys[:2]
    # The same block after another prefix is another key.
    assert block_keys(b + a[BLOCK:2 * BLOCK])[1] != keys[1]


def test_least_recently_used_blocks_go_first_and_a_prefix_loses_its_tail_first():
    block = lambda x: [(torch.full((1, BLOCK, 1, 1), float(x)), torch.zeros(1, BLOCK, 1, 1))]  # noqa: E731
    nbytes = 2 * BLOCK * 4
    cache = PrefixCache(budget=5 * nbytes)
    a, b = tokens(3 * BLOCK, 1), tokens(3 * BLOCK, 2)
    ka, kb = block_keys(a), block_keys(b)
    cache.store(ka, a, 0, [(torch.cat([block(i)[0][0] for i in range(3)], 1), torch.zeros(1, 3 * BLOCK, 1, 1))])
    cache.store(kb, b, 0, [(torch.zeros(1, 2 * BLOCK, 1, 1), torch.zeros(1, 2 * BLOCK, 1, 1))])
    assert len(cache) == 5 and cache.bytes == 5 * nbytes
    found = cache.match(ka, a)  # a used again: b is now the least recently used
    assert [float(f.kv[0][0][0, 0, 0, 0]) for f in found] == [0.0, 1.0, 2.0]
    cache.store(kb, b, 2, [(torch.zeros(1, BLOCK, 1, 1), torch.zeros(1, BLOCK, 1, 1))])  # b's third block
    # One block out, the least recently used of another prefix: a's tail (its head was marked used after it).
    assert len(cache.match(kb, b)) == 3 and len(cache.match(ka, a)) == 2
    assert cache.evicted_blocks == 1 and cache.bytes <= cache.budget
    # A prefix longer than the budget keeps its head.
    small = PrefixCache(budget=2 * nbytes)
    small.store(ka, a, 0, [(torch.zeros(1, 3 * BLOCK, 1, 1), torch.zeros(1, 3 * BLOCK, 1, 1))])
    assert len(small.match(ka, a)) == 2
    # A block whose tokens differ from the prompt's never matches, whatever its key.
    assert cache.match(ka, b[:BLOCK] + a[BLOCK:]) == []


def results(engine, prompts, params):
    return [(r.token_ids, r.stats.cached_prompt_tokens) for r in engine.generate(prompts, params)]


@pytest.mark.parametrize("kwargs", [dict(prefill_chunk_tokens=64), dict(prefill_chunk_tokens=None),
                                    dict(cuda_graphs=True, max_batch_size=4, prefill_chunk_tokens=128)])
def test_outputs_are_the_same_with_and_without_the_cache(models, kwargs):
    without = make_engine(models, prefix_cache_bytes=0, **kwargs)
    want = [t for t, _ in results(without, PROMPTS, PARAMS)]
    engine = make_engine(models, **kwargs)
    one_at_a_time = [results(engine, [p], s)[0] for p, s in zip(PROMPTS, PARAMS)]
    assert [t for t, _ in one_at_a_time] == want
    # What each found: the blocks of earlier prompts' prefills (whole blocks of prompt[:-1]).
    assert [c for _, c in one_at_a_time] == [0, 192, 192, 0, 128, 256, 192, 0]
    # Again, all in one batch (each now finds at least its own blocks) and in another order.
    again = results(engine, PROMPTS, PARAMS)
    assert [t for t, _ in again] == want
    assert all(c == (len(p) - 1) // BLOCK * BLOCK for (_, c), p in zip(again, PROMPTS))
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    assert [t for t, _ in results(engine, [PROMPTS[i] for i in order], [PARAMS[i] for i in order])] == \
        [want[i] for i in order]


def test_the_entries_a_request_gets_are_its_own_prefills_bit_for_bit(models):
    """Target and draft: a row given cached blocks holds what an uncached prefill writes."""
    def rows_after_prefill(engine, prompt):
        engine.add_request(prompt, SamplingParams(max_new_tokens=20, temperature=0), "x")
        while engine.num_prefilling or engine.num_waiting:
            engine.step()
        engine.scheduler.waiting.clear()
        n = len(prompt) - 1
        (target_row,) = [i for i, r in enumerate(engine.scheduler.decoding) if r.request_id == "x"]
        entries = [(c.k[:, target_row, :n].clone(), c.v[:, target_row, :n].clone())
                   for c in (engine.scheduler.batch.cache, engine.drafter.cache)]
        engine.abort("x")
        engine.step()
        return entries

    prompt = FEW_SHOT + tokens(40, 9)
    cached = make_engine(models, prefill_chunk_tokens=64)
    cached.generate([FEW_SHOT[:150]], SamplingParams(max_new_tokens=2))  # two blocks in the cache
    cached.generate([SYSTEM + tokens(100, 10)], SamplingParams(max_new_tokens=2))  # one more overlapping
    got = rows_after_prefill(cached, prompt)
    assert cached.prefix_cache.stats()["hit_tokens"] >= 3 * BLOCK
    want = rows_after_prefill(make_engine(models, prefix_cache_bytes=0, prefill_chunk_tokens=None), prompt)
    for (k, v), (k2, v2) in zip(got, want):
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_evicted_prefixes_are_prefilled_again_with_the_same_tokens(models):
    without = make_engine(models, prefix_cache_bytes=0)
    want = [t for t, _ in results(without, PROMPTS, PARAMS)]
    # Room for two blocks (each: target 2 layers and draft 1 of 64 positions x 2 heads x 8 x 4 bytes, k and v).
    block_bytes = 2 * 3 * BLOCK * 2 * 8 * 4
    engine = make_engine(models, prefix_cache_bytes=2 * block_bytes)
    got = [results(engine, [p], s)[0] for p, s in zip(PROMPTS, PARAMS)]
    assert [t for t, _ in got] == want
    stats = engine.prefix_cache.stats()
    assert stats["bytes"] <= 2 * block_bytes and stats["evicted_blocks"] > 0 and len(engine.prefix_cache) == 2
    assert 0 < sum(c for _, c in got) < 192 + 192 + 128 + 256 + 192


def test_an_aborted_prefill_leaves_only_whole_blocks_and_they_are_exact(models):
    engine = make_engine(models, prefill_chunk_tokens=64)
    want = results(make_engine(models, prefix_cache_bytes=0), PROMPTS[:3], PARAMS[:3])
    gone = engine.add_request(FEW_SHOT + tokens(300, 11), SamplingParams(max_new_tokens=5))
    engine.step()
    engine.step()  # two chunks of 64: two blocks stored
    assert engine.abort(gone)
    engine.step()
    assert len(engine.prefix_cache) == 2 and engine.cache_rows_in_use == 0
    got = [results(engine, [p], s)[0] for p, s in zip(PROMPTS[:3], PARAMS[:3])]
    assert [t for t, _ in got] == [t for t, _ in want]
    assert got[0][1] == 2 * BLOCK  # found the aborted request's blocks


def test_stats_and_metrics_count_the_prompt_tokens_from_the_cache(models):
    pytest.importorskip("prometheus_client")
    from specengine.server.metrics import ServerMetrics

    engine = make_engine(models)
    metrics = ServerMetrics(engine)
    for i, p in enumerate([SYSTEM + tokens(10, 3), SYSTEM + tokens(10, 4)]):
        engine.add_request(p, SamplingParams(max_new_tokens=3), f"r{i}")
        while engine.has_unfinished_requests():
            metrics.delivered(engine.step())
    text = metrics.scrape().decode()
    assert 'specengine:prompt_tokens_by_source_total{source="local_cache_hit"} 192.0' in text
    assert 'specengine:prompt_tokens_by_source_total{source="local_compute"} 228.0' in text  # 420 - 192
    assert "specengine:prefix_cache_hits_total 192.0" in text and "specengine:prefix_cache_queries_total 420.0" in text


def test_bad_budgets_are_named():
    for bad in (-1, 1.5, "big", True):
        with pytest.raises(ValueError, match="prefix_cache_bytes"):
            EngineConfig(prefix_cache_bytes=bad)


def cross_vocab_drafter(models):
    """The pair's draft model read through a map of another vocabulary: 24 of the target's 32 ids
    shared in another order, the other 8 spelled in two draft tokens each (one of the draft's own)."""
    from specengine.drafters.cross_vocab import CrossVocabDrafter
    from specengine.drafters.vocab_map import VocabMap

    shared_t = list(range(24))
    shared_d = [(7 * i + 3) % 24 for i in shared_t]
    forms = {t: (24 + t % 8, (5 * t) % 24) for t in range(24, V)}
    return CrossVocabDrafter(models[1], VocabMap(V, V, shared_t, shared_d, forms.__getitem__))


@pytest.mark.parametrize("drafter", ["none", "ngram", "suffix", "cross-vocab"])
def test_every_drafter_gives_the_same_outputs_with_the_cache_and_chunks_as_without(models, drafter):
    """Target-only, n-gram, suffix and cross-vocabulary drafting (the draft model's tests are above):
    with the prefix cache and a prompt prefilled 64 tokens a step, requests one at a time (later
    ones finding earlier ones' blocks) and then joining a batch of three rows as others leave give
    the tokens of an engine with neither."""
    def engine(**kwargs):
        if drafter == "cross-vocab":
            return Engine(models[0], drafter=cross_vocab_drafter(models), gamma=3, max_batch_size=3, **kwargs)
        return make_engine(models, drafter, max_batch_size=3, **kwargs)

    prompts, params = [PROMPTS[i] for i in (0, 1, 2, 4, 7)], [PARAMS[i] for i in (0, 1, 2, 4, 7)]

    def run(engine):
        """Each request alone, then all joining a batch: the suffix drafter drafts from earlier
        outputs, so both engines see the same requests in the same order."""
        alone = [engine.generate([p], s)[0] for p, s in zip(prompts, params)]
        return alone, engine.generate(prompts, params)

    want = [[r.token_ids for r in rs] for rs in run(engine(prefix_cache_bytes=0, prefill_chunk_tokens=None))]
    cached = engine(prefill_chunk_tokens=64)
    alone, batched = run(cached)
    assert [r.token_ids for r in alone] == want[0]
    assert [r.token_ids for r in batched] == want[1]
    assert sum(r.stats.cached_prompt_tokens for r in alone) >= 4 * BLOCK  # the cache was used
    assert all(r.stats.cached_prompt_tokens > 0 for r, p in zip(batched, prompts) if len(p) - 1 >= BLOCK)
    if drafter != "none":
        assert cached.last_run_stats.drafted > 0  # drafts were made, and verified
