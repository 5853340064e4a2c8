"""Chunked prefill (engine.scheduler, engine.runner, engine.prefill_budget): a joining prompt is prefilled a chunk a
step, interleaved with the running rows' rounds, and every token is the one an unchunked prefill
gives: cache entries bit for bit at chunk edges, greedy and seeded outputs on every path (the
fixed-shape steps and device rounds too, whose padding rows may be staged rows), requests aborted
mid-prefill, and T5's encoder cut by blocks."""
import functools

import pytest
import torch

from specengine import Engine, SamplingParams
from specengine.drafters.model import ModelDrafter
from specengine.engine.config import EngineConfig
from specengine.engine.prefill_budget import PrefillBudget, PrefillShare

from engine_util import make_engine

V = 32


@pytest.fixture(scope="module")
def models(tiny_pair):
    return tiny_pair


@pytest.fixture(scope="module")
def wide_bf16(tmp_path_factory):
    """Two SmolLM2-sized layers with bfloat16-stored matrices: the blocked GEMMs of a prefill, and
    one C++ call per layer for calls under GEMM_MIN_TOKENS_PER_ROW tokens (ops.product, models.backend)."""
    from specengine.devtools.tiny import make_config, save_random_checkpoint
    from specengine.models import load_model

    folder = tmp_path_factory.mktemp("wide")
    save_random_checkpoint(folder, make_config(vocab_size=64, hidden_size=576, intermediate_size=1536, num_layers=2,
                                               num_heads=9, num_kv_heads=3, max_position_embeddings=1024),
                           seed=4, init_std=0.1, dtype=torch.bfloat16)
    return load_model(folder)


def prompt(n: int, seed: int = 0, vocab: int = V) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class FixedShare(PrefillBudget):
    """A budget of `tokens` a step, `layers` of a chunk's layers a step, whether rows decode or not."""

    def __init__(self, tokens: int | None, layers: int | None):
        super().__init__(tokens)
        self.share = PrefillShare(tokens, layers)

    def next(self, decoding: bool) -> PrefillShare:
        return self.share


def prefilled_rows(model, prompts: list[list[int]], budget: int | None,
                   layers: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each prompt's K/V entries after a prefill under this budget a step, `layers` of a chunk's
    layers a step (all prompts joining at once): the scheduler's plans, their prefill only."""
    engine = Engine(model, prefill_chunk_tokens=budget, prefix_cache_bytes=0)
    scheduler, runner, steps = engine.scheduler, engine.runner, 0
    scheduler.prefill_budget = FixedShare(budget, layers)
    batch = runner.batch
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            engine.add_request(p, request_id=str(i))
        runner.prefill(scheduler.schedule())
        steps += 1
        while batch.prefilling:
            runner.prefill(scheduler.schedule())
            steps += 1
    chunks = 1 if budget is None else -(-sum(len(p) - 1 for p in prompts) // budget)
    assert steps >= chunks + (layers is not None)  # chunks of 32 tokens or more ran over several steps
    rows = {r.request_id: i for i, r in enumerate(batch.requests)}
    return [(batch.cache.k[:, rows[str(i)], :len(p) - 1].clone(), batch.cache.v[:, rows[str(i)], :len(p) - 1].clone())
            for i, p in enumerate(prompts)]


@pytest.mark.parametrize("which", ["float32 C++ ops", "bfloat16 whole layers and blocked GEMMs"])
def test_cache_entries_are_those_of_an_unchunked_prefill_at_every_chunk_edge(models, wide_bf16, which):
    model = models[0] if which.startswith("float32") else wide_bf16
    vocab = model.config.vocab_size
    # Prefill lengths (prompt - 1) at and around GEMM_MIN_TOKENS_PER_ROW (32) and the chunk edges.
    lengths = [2, 31, 32, 33, 34, 64, 65, 66, 128, 129, 130, 200]
    prompts = [prompt(n, seed=n, vocab=vocab) for n in lengths]
    whole = [prefilled_rows(model, [p], None)[0] for p in prompts]
    for budget, layers in ((32, None), (96, None), (32, 1)):
        # FIFO: chunks end mid-prompt and at prompt ends; with layers, a chunk's forward over two steps
        chunked = prefilled_rows(model, prompts, budget, layers)
        for p, want, got in zip(prompts, whole, chunked):
            assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), (len(p), budget, layers)


make_engine = functools.partial(make_engine, prefix_cache_bytes=0)  # chunking alone (the prefix cache's own file mixes both)


REQUESTS = [(prompt(n, seed=n), SamplingParams(max_new_tokens=m, temperature=t, seed=100 + n))
            for n, m, t in ((300, 12, 1.0), (7, 30, 0.0), (96, 25, 0.8), (129, 10, 0.0), (65, 20, 1.3))]


@pytest.mark.parametrize("drafter, kwargs", [
    ("model", {}), ("ngram", {}), ("none", {}),
    ("model", dict(cuda_graphs=True, max_batch_size=4)),  # padding rows of the bucket are staged rows
    ("model", dict(cuda_graphs=True, max_batch_size=4, rounds_per_read=4)),
])
def test_outputs_equal_unchunked_prefill_with_prompts_joining_running_rows(models, drafter, kwargs):
    unchunked = make_engine(models, drafter, prefill_chunk_tokens=None, **kwargs)
    want = [unchunked.generate([p], s)[0].token_ids for p, s in REQUESTS]
    engine = make_engine(models, drafter, prefill_chunk_tokens=64, **kwargs)
    assert [r.token_ids for r in engine.generate([p for p, _ in REQUESTS], [s for _, s in REQUESTS])] == want
    # Prefilling one at a time while the others decode: every running row gains tokens every step.
    outputs, step = {}, 0
    pending = list(enumerate(REQUESTS))
    while engine.has_unfinished_requests() or pending:
        if pending and step % 3 == 0:
            i, (p, s) = pending.pop(0)
            engine.add_request(p, s, f"r{i}")
        decoding = {r.request_id for r in engine.scheduler.decoding}
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert out.new_token_ids or out.request_id not in decoding
        assert all(r in {o for o in outputs} for r in decoding)
        step += 1
    assert [outputs[f"r{i}"] for i in range(len(REQUESTS))] == want
    assert engine.cache_rows_in_use == engine.num_running == 0


def test_a_long_prompt_joins_a_chunk_a_step_and_running_rows_keep_their_pace(models):
    engine = make_engine(models, prefill_chunk_tokens=64)
    runner = engine.add_request(prompt(5), SamplingParams(max_new_tokens=200, temperature=0))
    engine.step()
    joiner = engine.add_request(prompt(300, seed=1), SamplingParams(max_new_tokens=5, temperature=0))
    steps_to_join = 0
    while engine.num_prefilling or steps_to_join == 0:
        outs = {o.request_id: o for o in engine.step()}
        steps_to_join += 1
        assert outs[runner].new_token_ids  # a round every step
        calls = engine.scheduler.batch.prefilling[0].request.stats.target_calls if engine.num_prefilling else None
        assert calls in (None, steps_to_join)
    assert steps_to_join == 5  # 299 tokens: 64 a step
    assert joiner in {r.request_id for r in engine.scheduler.decoding}
    assert engine.scheduler.decoding[-1].stats.target_calls == 6  # five chunks, one round


class OneLayerAStep(PrefillBudget):
    """The auto budget as it is when a chunk takes longer than a round: 32 tokens, one layer a step."""

    def next(self, decoding: bool) -> PrefillShare:
        return PrefillShare(32, 1) if decoding else PrefillShare(None)


@pytest.mark.parametrize("drafter", ["model", "none"])
def test_chunks_run_a_few_layers_a_step_with_the_tokens_of_an_unchunked_prefill(models, drafter):
    """A chunk's forward spread over steps while rows decode, join and leave, a request is aborted
    and another's prompt is all in the prefix cache (it joins while chunks are pending): outputs
    are those of whole prompts."""
    target, draft = models
    cached_prompt = prompt(64 + 1, seed=41)  # two prefix-cache blocks, then its last token
    specs = [(prompt(200, seed=40), SamplingParams(max_new_tokens=12, temperature=1.0, seed=1)),
             (cached_prompt, SamplingParams(max_new_tokens=6, temperature=0.0)),
             (prompt(150, seed=42), SamplingParams(max_new_tokens=8, temperature=0.7, seed=2)),
             (prompt(90, seed=43), SamplingParams(max_new_tokens=5, temperature=0.0))]
    unchunked = make_engine(models, drafter, prefill_chunk_tokens=None)
    want = [unchunked.generate([p], s)[0].token_ids for p, s in specs]

    chosen = ModelDrafter(draft, V, V) if drafter == "model" else None
    engine = Engine(target, drafter=chosen, gamma=3, prefill_chunk_tokens="auto")
    engine.scheduler.prefill_budget = OneLayerAStep("auto")
    engine.generate([cached_prompt], SamplingParams(max_new_tokens=1))  # its blocks into the prefix cache
    runner = engine.add_request(prompt(5), SamplingParams(max_new_tokens=60, temperature=0))
    outputs, step, pending_seen = {runner: engine.step()[0].new_token_ids}, 0, 0
    ids = [engine.add_request(specs[0][0], specs[0][1], "long")]
    while engine.has_unfinished_requests() or engine.has_pending_outputs():
        if step == 1:  # mid-chunk: the cached prompt joins whole, ahead of the pending chunk's row
            assert engine.scheduler.batch.pending is not None
            ids += [engine.add_request(specs[1][0], specs[1][1], "cached"),
                    engine.add_request(specs[2][0], specs[2][1], "aborted")]
        if step == 4:
            assert engine.abort("aborted")
        if step == 6:
            ids.append(engine.add_request(specs[3][0], specs[3][1], "later"))
        pending_seen += engine.scheduler.batch.pending is not None
        decoding = {r.request_id for r in engine.scheduler.decoding}
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert out.new_token_ids or out.request_id not in decoding or out.finished
        step += 1
    assert pending_seen >= 7  # seven chunks of the long prompt, at least
    assert outputs["long"] == want[0] and outputs["cached"] == want[1] and outputs["later"] == want[3]
    assert outputs["aborted"] == [] and len(outputs[runner]) == 60
    assert engine.cache_rows_in_use == engine.num_running == 0


@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_an_abort_mid_prefill_frees_its_row_and_leaves_the_others_exact(models, which):
    engine = make_engine(models, prefill_chunk_tokens=64, cuda_graphs=True, max_batch_size=4)
    specs = [(prompt(200, seed=i), SamplingParams(max_new_tokens=15, temperature=1.0, seed=i)) for i in range(3)]
    want = [engine.generate([p], s)[0].token_ids for p, s in specs]
    runner = engine.add_request(prompt(9), SamplingParams(max_new_tokens=40, temperature=0))
    engine.step()
    ids = [engine.add_request(p, s) for p, s in specs]
    engine.step()  # staged, one chunk of the first
    engine.step()
    assert engine.num_prefilling == 3 and engine.cache_rows_in_use == 4
    gone = ids[{"first": 0, "middle": 1, "last": 2}[which]]
    assert engine.abort(gone)
    assert engine.num_prefilling == 2 and engine.cache_rows_in_use == 3 and engine.drafter.cache.rows_held == 3
    outputs = {}
    while engine.has_unfinished_requests() or engine.has_pending_outputs():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    (aborted,) = outputs[gone]
    assert aborted.finish_reason == "abort" and aborted.new_token_ids == []
    for request_id, tokens in zip(ids, want):
        if request_id != gone:
            assert [t for o in outputs[request_id] for t in o.new_token_ids] == tokens
    assert engine.cache_rows_in_use == 0 and engine.drafter.cache.rows_held == 0
    assert outputs[runner][-1].finished


def test_t5_encoder_is_prefilled_by_blocks_with_the_same_tokens(tmp_path):
    from specengine.devtools.tiny import make_t5_config, save_random_t5_checkpoint
    from specengine.models import load_model

    models = []
    for name, layers, seed in (("target", 4, 0), ("draft", 2, 1)):
        save_random_t5_checkpoint(tmp_path / name, make_t5_config(vocab_size=64, num_layers=layers), seed=seed,
                                  init_scale=2.0)
        models.append(load_model(tmp_path / name))
    target, draft = models
    specs = [(prompt(n, seed=n, vocab=64), SamplingParams(max_new_tokens=8, temperature=t, seed=n))
             for n, t in ((300, 1.0), (20, 0.0), (130, 1.0))]

    def run(budget):
        engine = Engine(target, drafter=ModelDrafter(draft, 64, 64), gamma=2, prefill_chunk_tokens=budget)
        ids = [engine.add_request(p, s) for p, s in specs]
        outputs, steps = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            steps += 1
        return [outputs[i] for i in ids], steps

    want, whole_steps = run(None)
    got, steps = run(64)  # 300 tokens over 4 blocks: 75 a block, one block a step
    assert got == want and steps > whole_steps
    # An encoder reads its input both ways: no prefix of it has entries of its own, nothing is cached.
    assert Engine(target).prefix_cache is None


def test_the_auto_budget_follows_the_measured_times():
    budget = PrefillBudget("auto")              # a chunk's forward cannot be cut by layers
    assert budget.next(decoding=False) == PrefillShare(None)  # nobody waits: whole prompts
    assert budget.next(decoding=True) == PrefillShare(32)     # nothing measured yet: the least chunk
    budget.observe_prefill(256, 1.0, 0.256)     # 1 ms a token
    budget.observe_round(0.150)
    assert budget.next(decoding=True) == PrefillShare(64)     # half a round's time (75 ms), in multiples of 32
    for _ in range(20):                         # smoothed: rounds of 10 ms for a while
        budget.observe_round(0.010)
    assert budget.next(decoding=True) == PrefillShare(32)     # at least 32
    assert PrefillBudget(192).next(decoding=False) == PrefillShare(192)
    assert PrefillBudget(None).next(decoding=True) == PrefillShare(None)


def test_the_auto_budget_spreads_a_chunk_longer_than_a_round_over_layers():
    budget = PrefillBudget("auto", layers=30)
    assert budget.next(decoding=False) == PrefillShare(None)      # nobody waits: whole prompts, all layers
    assert budget.next(decoding=True) == PrefillShare(32, 8)      # nothing measured: a quarter of the layers
    budget.observe_prefill(32, 8 / 30, 0.016)   # 8 of 30 layers of 32 tokens in 16 ms: 60 ms a chunk
    budget.observe_round(0.036)
    assert budget.next(decoding=True) == PrefillShare(32, 9)      # half a round, 18 ms: 9 of the 30 layers
    budget.observe_prefill(32, 8 / 30, 0.040)   # slower (further into the prompt, 150 ms a chunk): counts at once
    assert budget.next(decoding=True) == PrefillShare(32, 4)      # 18 of 150 ms: 3.6 layers
    for _ in range(20):
        budget.observe_round(0.500)              # rounds far longer than a chunk: whole chunks again
    assert budget.next(decoding=True).layers is None


@pytest.mark.parametrize("value", [16, 100, -64, 1.5, "whole", True])
def test_bad_chunk_budgets_are_named(value):
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        EngineConfig(prefill_chunk_tokens=value)
    assert EngineConfig(prefill_chunk_tokens=0).prefill_chunk_tokens is None
