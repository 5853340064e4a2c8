"""A growable KV cache's memory is never zeroed (layers.kv_cache): positions a row has not written
hold whatever the allocator gave. Here that memory is NaN (kv_cache.unwritten patched), and every
backend must give the logits and tokens that zeroed memory gives: ragged rows, drafting past
shorter rows, a long prompt joining running streams a chunk a step (the cache growing), a prefix
cache hit, rows leaving, and T5's cross-attention. Growing the cache and moving rows copies each
row up to its length where its owner keeps nothing past it, and whole rows otherwise."""
import math

import pytest
import torch

from specengine import Engine, SamplingParams
from specengine.devtools.tiny import make_t5_config, save_random_t5_checkpoint
from specengine.drafters.model import ModelDrafter
from specengine.layers import kv_cache
from specengine.layers.kv_cache import StaticKVCache
from specengine.models import load_model
from specengine.steps.feed import feed

V = 97  # the conftest checkpoints' vocabulary
BACKENDS = ["cpp-layers", "cpp-ops", "torch", "triton"]  # "triton" in Triton's interpreter on a CPU


def nan_memory(shape, dtype, device):
    return torch.full(shape, math.nan, dtype=dtype, device=device)


def zero_memory(shape, dtype, device):
    return torch.zeros(shape, dtype=dtype, device=device)


def with_memory(monkeypatch, memory, run):
    """run() with every cache allocated from here on given `memory` for its unwritten entries."""
    with monkeypatch.context() as patch:
        patch.setattr(kv_cache, "unwritten", memory)
        return run()


def models_on(checkpoint, backend: str, case: str):
    """A target of this conftest case and a draft (another case, same vocabulary), bfloat16-stored
    matrices with float32 compute (what "cpp-layers" needs), both on `backend`."""
    target = load_model(checkpoint(case, torch.bfloat16))
    draft = load_model(checkpoint("qwen2-qkv-bias", torch.bfloat16))
    for model in (target, draft):
        model.use_backend(backend)
    return target, draft


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["llama3-rope-gqa", "mistral-sliding"])
def test_ragged_calls_give_the_same_bits_over_unwritten_nan(case, backend, checkpoint, monkeypatch):
    """Rows of 3, 11 and 40 tokens fed in one call (right-padded), then steps of 4 and 1 tokens whose
    kv_len reaches past the shorter rows (as verification and drafting do): the same logits, bit
    for bit, whether the memory the rows never wrote is NaN or zero."""
    target, _ = models_on(checkpoint, backend, case)
    prompts = [prompt(3, 0), prompt(11, 1), prompt(40, 2)]

    def run():
        cache = target.new_cache(4, 64)  # a spare row, never written
        cache.reset(3)
        out = []
        with torch.inference_mode():
            out.append(target.logits(feed(target, cache, prompts)))
            lengths = [len(p) for p in prompts]
            tokens = torch.tensor([[5, 6, 7, 8]] * 3)
            out.append(target.logits(target(tokens, cache.lengths.clone(), cache, kv_len=max(lengths) + 4)))
            cache.lengths.add_(torch.tensor([1, 4, 2]))  # rows accept unequally; the rest is stale
            lengths = cache.lengths.tolist()
            out.append(target.logits(target(torch.tensor([[9]] * 3), cache.lengths.clone(), cache,
                                            kv_len=max(lengths) + 1)))
        return out

    want = with_memory(monkeypatch, zero_memory, run)
    got = with_memory(monkeypatch, nan_memory, run)
    assert target.triton_fallback_reason is None
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        assert torch.equal(g, w)


def run_join(target, draft, prefill_chunk_tokens):
    """Three streams decoding; a 100-token prompt joins (a chunk a step: the caches grow by rows and
    positions) and a prompt starting with its first 64 tokens joins later (a prefix cache hit);
    streams end at different steps (rows move). Each request's tokens, and whether the target's
    cache holds NaN (the memory really was NaN where nothing wrote)."""
    engine = Engine(target, drafter=ModelDrafter(draft, V, V), gamma=3, prefill_chunk_tokens=prefill_chunk_tokens)
    long = prompt(100, 9)
    arrivals = {0: [("a", prompt(5, 3), 12), ("b", prompt(9, 4), 30), ("c", prompt(14, 5), 20)],
                3: [("long", long, 16)], 9: [("shared", long[:64] + prompt(7, 6), 8)]}
    tokens: dict[str, list[int]] = {}
    step = 0
    with torch.inference_mode():
        while engine.has_unfinished_requests() or step <= max(arrivals):
            for request_id, p, n in arrivals.get(step, []):
                engine.add_request(p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True), request_id)
            for out in engine.step():
                assert out.finish_reason in (None, "length"), out
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            step += 1
    assert engine.prefix_cache.hit_tokens >= 64
    return tokens, bool(torch.isnan(engine.scheduler.batch.cache.k).any())


# Not "triton": in the interpreter this run takes minutes; its calls are of the kinds the ragged
# test above checks on every backend (ragged prefills, verification and drafting past shorter rows).
@pytest.mark.parametrize("backend", ["cpp-layers", "cpp-ops", "torch"])
def test_joins_growth_and_prefix_hits_give_the_same_tokens_over_unwritten_nan(backend, checkpoint, monkeypatch):
    target, draft = models_on(checkpoint, backend, "llama3-rope-gqa")
    chunk = 32
    want, zero_has_nan = with_memory(monkeypatch, zero_memory, lambda: run_join(target, draft, chunk))
    got, nan_has_nan = with_memory(monkeypatch, nan_memory, lambda: run_join(target, draft, chunk))
    assert not zero_has_nan and nan_has_nan
    assert got == want and sorted(got) == ["a", "b", "c", "long", "shared"]
    assert target.triton_fallback_reason is None and draft.triton_fallback_reason is None


@pytest.mark.parametrize("backend", ["cpp-ops", "torch"])
def test_t5_cross_and_self_attention_ignore_unwritten_nan(backend, tmp_path, monkeypatch):
    """Sources of unequal lengths joining at different steps: self-attention rows and cross-attention
    rows past each row's source hold NaN, and the tokens are those of zeroed memory."""
    config = make_t5_config(vocab_size=V, relative_attention_num_buckets=8, relative_attention_max_distance=12)
    target = load_model(save_random_t5_checkpoint(tmp_path / "t5", config, seed=0, init_scale=2.0))
    target.use_backend(backend)

    def run():
        engine = Engine(target)
        arrivals = {0: [("a", prompt(4, 1) + [1], 10)], 2: [("b", prompt(17, 2) + [1], 6)],
                    3: [("c", prompt(2, 3) + [1], 9)]}
        tokens, step = {}, 0
        with torch.inference_mode():
            while engine.has_unfinished_requests() or step <= max(arrivals):
                for request_id, p, n in arrivals.get(step, []):
                    engine.add_request(p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
                                       request_id)
                for out in engine.step():
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                step += 1
        return tokens

    want = with_memory(monkeypatch, zero_memory, run)
    assert with_memory(monkeypatch, nan_memory, run) == want


# ---- what growing and moving rows copy ---------------------------------------------------------

def numbered_cache(rows: int, capacity: int, filled: list[int], lengths: list[int]) -> StaticKVCache:
    """A growable cache (memory NaN) whose first len(filled) rows are in use, hold entries numbered
    by row and position up to filled (NaN past them) and have these lengths (entries between a
    length and filled: stale drafts). Its owner keeps nothing past a row's length."""
    cache = StaticKVCache(2, rows, capacity, 1, 2, torch.float32, "cpu")
    cache.entries_end_at_lengths = True
    cache.reset(len(filled))
    for row, n in enumerate(filled):
        cache.k[:, row, :n] = 100 * row + torch.arange(n, dtype=torch.float32)[:, None, None]
        cache.v[:, row, :n] = -cache.k[:, row, :n]
    cache.lengths.copy_(torch.tensor(lengths))
    return cache


def assert_holds(cache: StaticKVCache, row: int, numbered_as: int, n: int):
    """Row `row` holds the first n entries row `numbered_as` was given."""
    want = (100 * numbered_as + torch.arange(n, dtype=torch.float32)[:, None, None]).expand(2, n, 1, 2)
    assert torch.equal(cache.k[:, row, :n], want) and torch.equal(cache.v[:, row, :n], -want)


def test_growing_copies_rows_up_to_their_lengths_and_zeroes_nothing(monkeypatch):
    monkeypatch.setattr(kv_cache, "unwritten", nan_memory)
    cache = numbered_cache(2, 8, filled=[5, 3], lengths=[5, 2])  # row 1's third entry: a stale draft
    cache.reserve(3, 20)
    assert (cache.allocated_rows, cache.capacity, cache.lengths.tolist()) == (4, 20, [5, 2])
    assert_holds(cache, 0, 0, 5)
    assert_holds(cache, 1, 1, 2)
    assert torch.isnan(cache.k[:, 0, 5:]).all() and torch.isnan(cache.k[:, 1, 2:]).all()  # nothing more copied
    assert torch.isnan(cache.k[:, 2:]).all() and torch.isnan(cache.v[:, 2:]).all()  # new rows: never zeroed


def test_an_owner_that_keeps_entries_past_the_lengths_gets_whole_rows(monkeypatch):
    monkeypatch.setattr(kv_cache, "unwritten", nan_memory)
    cache = numbered_cache(2, 8, filled=[5, 3], lengths=[5, 2])
    cache.entries_end_at_lengths = False  # as the cross-vocabulary drafter's cache
    cache.reserve(3, 20)
    assert_holds(cache, 1, 1, 3)
    cache.keep_rows([1])
    assert_holds(cache, 0, 1, 3)


def test_moving_rows_copies_them_up_to_their_lengths(monkeypatch):
    monkeypatch.setattr(kv_cache, "unwritten", nan_memory)
    cache = numbered_cache(4, 8, filled=[6, 2, 4, 7], lengths=[6, 2, 4, 5])
    cache.keep_rows([1, 3])  # rows 0 and 2 left; row 3 holds 5 of its 7
    assert cache.lengths.tolist() == [2, 5]
    assert_holds(cache, 0, 1, 2)
    assert_holds(cache, 1, 3, 5)
    assert torch.isnan(cache.k[:, 1, 5:]).all()  # what row 1 had there (nothing), not row 3's stale entries


def test_rows_kept_in_order_move_each_read_before_it_is_written(monkeypatch):
    """Rows leaving from the middle: the rows kept move down in order (one slice copy a row, each
    read before a later one writes it: row 3 is a source and then a destination): every row moved
    holds its own entries exactly, up to its length and no further."""
    monkeypatch.setattr(kv_cache, "unwritten", nan_memory)
    lengths = [4, 3, 4, 3, 2, 4, 3]
    cache = numbered_cache(7, 8, filled=lengths, lengths=lengths)
    cache.keep_rows([2, 3, 4, 5, 6])
    assert cache.lengths.tolist() == [4, 3, 2, 4, 3]
    for row, source in enumerate([2, 3, 4, 5, 6]):
        assert_holds(cache, row, source, lengths[source])
    # row 2 takes row 4's 2 entries and nothing more: its own old entries 2 and 3 stay
    assert torch.equal(cache.k[:, 2, 2:4, 0, 0], torch.tensor([[202.0, 203.0]] * 2))


def test_promoting_staged_rows_out_of_order_reads_each_before_writing(monkeypatch):
    """Staged rows 0 and 2 of three finish first: they come first, the unfinished row 1 follows
    (rows 2 and 3 trade places: each is read before either is written)."""
    monkeypatch.setattr(kv_cache, "unwritten", nan_memory)
    cache = numbered_cache(4, 8, filled=[3, 6, 2, 5], lengths=[3, 6, 2, 5])
    cache.batch_size, cache.staged = 1, 3  # rows 1-3 staged, their lengths what they prefilled
    cache.promote([0, 2])
    assert (cache.batch_size, cache.staged, cache.lengths.tolist()) == (3, 1, [3, 6, 5])
    assert_holds(cache, 0, 0, 3)
    assert_holds(cache, 1, 1, 6)
    assert_holds(cache, 2, 3, 5)
    assert_holds(cache, 3, 2, 2)


def test_a_fixed_cache_is_zeroed_once(monkeypatch):
    """Its padding rows (fixed-shape steps) attend past every key of their rows: they must read zeros."""
    monkeypatch.setattr(kv_cache, "unwritten", nan_memory)
    fixed = StaticKVCache(2, 3, 8, 1, 2, torch.float32, "cpu", growable=False)
    assert torch.equal(fixed.k, torch.zeros_like(fixed.k)) and torch.equal(fixed.v, torch.zeros_like(fixed.v))
