"""T5 encoder-decoder targets and drafts: the model against transformers, the engine's lossless
loop on them (greedy against transformers' generate, the exact distribution), the n-gram
drafter's lookup in the encoder input, the cross-attention cache, and bad input."""
import itertools

import pytest
import torch
import transformers

from specengine import Engine, SamplingParams, _C
from specengine.drafters.model import ModelDrafter
from specengine.drafters.ngram import NgramDrafter
from specengine.layers.kv_cache import EncoderDecoderKVCache
from specengine.layers.parallel import TensorParallelError
from specengine.models import CheckpointError, load_model
from specengine.models.config import ConfigError
from specengine.models.loader import empty_model, load_config
from specengine.models.t5 import relative_position_bucket
from specengine.models.t5_config import T5Config
from specengine.devtools.tiny import make_t5_config, save_random_t5_checkpoint
from specengine.tokenizer import TokenizerMismatchError
from bounds import AMX_TERMS, Float64T5, assert_greedy_tokens_agree, assert_within, t5_block_bounds
from conftest import forbid_cpp_products
from stats_util import chi_square_pvalue, reference_warped_probs

# Original T5 (ReLU, tied head scaled by d_model**-0.5) and v1.1 / Flan-T5 (gated GELU, own head),
# with unequal stacks and few buckets, so that the logarithmic buckets are reached.
VARIANTS = {
    "t5-relu-tied": dict(feed_forward_proj="relu", tie_word_embeddings=True, num_decoder_layers=3,
                         relative_attention_num_buckets=8, relative_attention_max_distance=12),
    "t5v1.1-gated-gelu-untied": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False, num_layers=3,
                                     num_decoder_layers=2),
}


@pytest.fixture(scope="module")
def t5(tmp_path_factory, tokenizer):
    """t5(variant, **overrides) -> folder of a tiny random T5 checkpoint with the session's tokenizer."""
    made = {}

    def make(variant: str, tokenizer_files: bool = True, seed: int = 0, dtype: torch.dtype = torch.float32,
             **overrides):
        key = (variant, tokenizer_files, seed, dtype, tuple(sorted(overrides.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(variant)
            config = make_t5_config(**{"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
                                       **VARIANTS[variant], **overrides})
            save_random_t5_checkpoint(folder, config, tokenizer if tokenizer_files else None, seed=seed,
                                      init_scale=2.0, dtype=dtype)
            made[key] = folder
        return made[key]

    return make


def hf_model(folder):
    return transformers.T5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def exact_t5():
    """exact_t5(folder) -> the checkpoint's Float64T5 (float64 logits and float32 bounds), one a folder."""
    made = {}

    def make(folder):
        if folder not in made:
            made[folder] = Float64T5(hf_model(folder))
        return made[folder]

    return make


def padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    S = max(map(len, rows))
    ids = torch.tensor([r + [0] * (S - len(r)) for r in rows])
    return ids, (torch.arange(S)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()


SOURCES = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 2], [21, 22, 2], [30, 31, 32, 33, 34, 2]]


# How a CPU decodes: float32 matrices with the C++ norms and attentions; a bfloat16 checkpoint's
# matrices kept in bfloat16 (float32 compute), each decoder block one C++ call, or op by op.
PATHS = {"float32": (torch.float32, "cpp-ops"), "bfloat16-whole-block": (torch.bfloat16, "cpp-layers"),
         "bfloat16-per-op": (torch.bfloat16, "cpp-ops"), "torch-reference": (torch.float32, "torch")}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_encoder_and_ragged_decoding_with_rollback_equal_transformers(variant, path, t5, exact_t5, monkeypatch):
    dtype, backend = PATHS[path]
    folder = t5(variant, dtype=dtype)
    hf, ours = hf_model(folder), load_model(folder)
    assert ours.backend.name == ("cpp-layers" if dtype == torch.bfloat16 else "cpp-ops")  # the loader's choice
    ours.use_backend(backend)
    if backend == "torch":  # torch's products only
        forbid_cpp_products(monkeypatch)
    assert (ours.whole_layer_weights() is not None) == (dtype == torch.bfloat16)
    assert ours.head_is_tied == (variant == "t5-relu-tied") == (hf.lm_head.weight is hf.shared.weight)
    # The exact results of these weights and their float32 bounds (tests/bounds.py), which every
    # summation order (portable, AVX2, AVX-512, transformers' BLAS) keeps to; AMX tiles sum a
    # bfloat16 matrix's products with x in three bfloat16 terms.
    from specengine import _C
    terms = AMX_TERMS if dtype == torch.bfloat16 and backend != "torch" and _C.cpu_isa() == "amx" else 1
    reference = exact_t5(folder)
    ids, mask = padded(SOURCES)
    lengths = mask.sum(1)
    # Decoder sequences of 20 tokens; rows go ahead unequally, and row 1 rolls back 3 drafts.
    dec = torch.tensor([[0] + [(7 * b + 3 * t) % 290 + 3 for t in range(19)] for b in range(3)])
    exact = [reference.logits(source, dec[b].tolist(), terms) for b, source in enumerate(SOURCES)]
    with torch.no_grad():
        enc = ours.encoder_hidden(ids, lengths)
        for b, n in enumerate(lengths.tolist()):
            reference.encoded(SOURCES[b], terms).check(enc[b, :n], f"encoder row {b}")
        ref = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        for b in range(3):
            exact[b].check(ref[b], "transformers")
        cache = ours.new_cache(3, 24)
        ours.encode(cache, SOURCES)
        # Ragged prefill: rows hold 4, 2 and 7 tokens.
        chunks = [dec[0, :4], dec[1, :2], dec[2, :7]]
        T = max(len(c) for c in chunks)
        tokens = torch.stack([torch.cat([c, c.new_zeros(T - len(c))]) for c in chunks])
        logits = ours.logits(ours(tokens, cache.lengths.clone(), cache))
        for b, c in enumerate(chunks):
            exact[b][:len(c)].check(logits[b, :len(c)], f"prefill row {b}")
        cache.lengths.copy_(torch.tensor([4, 2, 7]))
        # A round: row 1 verifies [its next token, 3 wrong drafts] and keeps the first, so its
        # length goes back to 3 and the stale entries stay past it, to be overwritten.
        wrong = torch.tensor([1, 1, 1])
        step = torch.stack([dec[0, 4:8], torch.cat([dec[1, 2:3], wrong]), dec[2, 7:11]])
        logits = ours.logits(ours(step, cache.lengths.clone(), cache))
        exact[0][4:8].check(logits[0], "round row 0")
        exact[1][2].check(logits[1, 0], "round row 1")
        cache.lengths.copy_(torch.tensor([8, 3, 11]))
        # Then every row decodes to 20 tokens, 3 at a time.
        while int(cache.lengths.min()) < 20:
            starts = cache.lengths.clamp(max=17)
            step = torch.stack([dec[b, s:s + 3] for b, s in enumerate(starts.tolist())])
            logits = ours.logits(ours(step, starts, cache))
            for b, s in enumerate(starts.tolist()):
                exact[b][s:s + 3].check(logits[b], f"decoding row {b} at {s}")
            cache.lengths.copy_(starts + 3)


def test_relative_position_buckets_equal_transformers():
    from transformers.models.t5.modeling_t5 import T5Attention

    offsets = torch.arange(-300, 300)
    for bidirectional, buckets, distance in itertools.product((True, False), (4, 8, 32), (8, 128)):
        ref = T5Attention._relative_position_bucket(offsets, bidirectional, buckets, distance)
        assert torch.equal(relative_position_bucket(offsets, bidirectional, buckets, distance), ref)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("drafter", ["none", "draft", "same", "ngram"])
def test_greedy_decoding_equals_transformers_generate(variant, drafter, t5, tokenizer, exact_t5):
    target = t5(variant)
    draft = {"draft": t5(variant, tokenizer_files=False, seed=5, d_model=32, num_layers=1, num_decoder_layers=1),
             "same": target}.get(drafter)
    engine = Engine.from_pretrained(target, draft, drafter="ngram" if drafter == "ngram" else "model", gamma=3)
    hf = hf_model(target)
    prompts = ["def add(a, b):\n    return a + b", "import os", "class Point:\n    def __init__(self, x):"]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.0))
    for prompt, result in zip(prompts, results):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        # (transformers' cache is sized for the encoder's layers: with unequal stacks, no cache)
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                               use_cache=False)[0, 1:]
        expected = expected.tolist()
        if tokenizer.eos_token_id in expected:  # transformers pads after EOS
            expected = expected[:expected.index(tokenizer.eos_token_id) + 1]
        # float32 in another order than transformers': equal up to the first near tie of the exact logits
        assert_greedy_tokens_agree(result.token_ids, expected, exact_t5(target), ids[0].tolist(), 6)
        assert result.prompt_token_ids == ids[0].tolist()
        assert result.stats.prompt_tokens == ids.shape[1]
    stats = engine.last_run_stats
    if drafter == "same":  # one model twice: every draft accepted, rounds of several tokens
        assert stats.drafted > 0 and stats.acceptance_rate == 1.0 and stats.rounds < stats.generated_tokens / 2
    if drafter == "draft":  # a random draft: tested, rarely right
        assert stats.drafted > 0


V, NEW = 5, 3
SOURCE = [3, 1, 4, 2]


@pytest.fixture(scope="module")
def tiny_t5_pair(tmp_path_factory):
    models = []
    for seed, overrides in ((0, {}), (3, dict(d_model=32, num_layers=1, num_decoder_layers=1))):
        folder = tmp_path_factory.mktemp(f"t5-v{V}-{seed}")
        config = make_t5_config(vocab_size=V, eos_token_id=None, d_kv=8, d_ff=32, **overrides)
        save_random_t5_checkpoint(folder, config, seed=seed, init_scale=2.0)
        models.append(load_model(folder))
    return models


def exact_t5_distribution(model, params: SamplingParams, source: list[int] = SOURCE) -> torch.Tensor:
    """P(x_1..x_NEW | source) under the warped target for all V**NEW continuations (row-major)."""
    conts = torch.tensor(list(itertools.product(range(V), repeat=NEW)))
    start = model.config.decoder_start_token_id
    seqs = torch.cat([torch.full((len(conts), 1), start), conts], 1)
    cache = model.new_cache(len(seqs), seqs.shape[1])
    with torch.no_grad():
        model.encode(cache, [source] * len(seqs))
        logits = model.logits(model(seqs, torch.zeros(len(seqs), dtype=torch.int64), cache))[:, :-1].reshape(-1, V)
    probs = reference_warped_probs(logits, params).view(len(conts), NEW, V)  # float64, not the engine's warps
    return probs.gather(-1, conts[..., None]).squeeze(-1).prod(-1)


@pytest.mark.slow
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=3)],
                         ids=["T=1", "T=0.8,top_k=3"])
def test_speculative_sampling_through_the_engine_gives_the_exact_target_distribution(tiny_t5_pair, params):
    target, draft = tiny_t5_pair
    engine = Engine(target, drafter=ModelDrafter(draft, V, V), gamma=3)
    N = 8000
    requests = [SamplingParams(max_new_tokens=NEW, temperature=params.temperature, top_k=params.top_k, seed=s)
                for s in range(N)]
    results = engine.generate([SOURCE] * N, requests)
    index = torch.tensor([sum(t * V ** (NEW - 1 - i) for i, t in enumerate(r.token_ids)) for r in results])
    counts = torch.bincount(index, minlength=V ** NEW)
    expected = exact_t5_distribution(target, params)
    assert chi_square_pvalue(counts, expected) > 1e-3
    assert 0.05 < engine.last_run_stats.acceptance_rate < 0.95  # drafts were tested, some rejected
    # The test can fail: the same counts are far from the distribution given another source.
    assert chi_square_pvalue(counts, exact_t5_distribution(target, params, [0, 0, 0, 4])) < 1e-6


def test_seeded_t5_request_is_batch_invariant(tiny_t5_pair):
    target, draft = tiny_t5_pair
    engine = Engine(target, drafter=ModelDrafter(draft, V, V), gamma=2)
    mine = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)
    (alone,) = engine.generate([SOURCE], mine)
    others = [SamplingParams(max_new_tokens=5, temperature=0.5, seed=1), SamplingParams(max_new_tokens=9, seed=2)]
    batch = engine.generate([[1, 2], SOURCE, [4, 4, 4, 4, 4, 4, 4, 4]], [others[0], mine, others[1]])
    assert batch[1].token_ids == alone.token_ids


def test_requests_join_a_running_t5_batch_and_leave_it(t5):
    engine = Engine.from_pretrained(t5("t5-relu-tied"), drafter="ngram", gamma=2)
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    alone = {p: engine.generate([p], greedy)[0].token_ids for p in ("x = 1", "def f():", "y")}
    first = engine.add_request("x = 1", greedy)
    outputs = {first: []}
    for output in engine.step():
        outputs[output.request_id] += output.new_token_ids
    second, third = engine.add_request("def f():", greedy), engine.add_request("y", greedy)
    outputs.update({second: [], third: []})
    engine.abort(third)
    while engine.has_unfinished_requests() or engine.has_pending_outputs():
        for output in engine.step():
            outputs[output.request_id] += output.new_token_ids
    assert outputs[first] == alone["x = 1"] and outputs[second] == alone["def f():"]
    assert outputs[third] == []


def test_ngram_drafter_copies_from_the_encoder_input():
    drafter = NgramDrafter(1, 3)
    drafter.join_rows([[0], [0]], 16, sources=[[7, 8, 9, 10, 11, 1], [5, 5, 6]])
    sampling = type("S", (), {"seeds": torch.zeros(2, dtype=torch.int64)})()
    proposal = drafter.propose([[0, 8, 9], [0, 2]], [3, 3], sampling)
    assert proposal.tokens[0].tolist() == [10, 11, 1] and proposal.num_drafts.tolist() == [3, 0]
    drafter.keep_rows([1])
    assert drafter.propose([[0, 5]], [2], sampling).tokens[0].tolist() == [6, 0]  # after 5, 5 then 6


def test_encoder_decoder_cache_grows_and_keeps_rows_with_their_encoder_outputs():
    cache = EncoderDecoderKVCache(2, 1, 4, 2, 3, torch.float32, "cpu")
    cache.reset(0)
    cache.reserve(2, 4)
    cache.reserve_source(3)
    rows = cache.add_rows(2)
    rows.cross_k[:, 0, :3] = 1.0
    rows.cross_k[:, 1, :2] = 2.0
    rows.source_lengths.copy_(torch.tensor([3, 2]))
    cache.reserve(5, 8)  # more rows and positions: the encoder outputs move with them
    cache.reserve_source(10)
    assert cache.source_capacity >= 10 and cache.allocated_rows >= 5
    assert cache.source_lengths.tolist() == [3, 2]
    assert (cache.cross_k[:, 0, :3] == 1).all() and (cache.cross_k[:, 1, :2] == 2).all()
    cache.keep_rows([1])
    assert cache.source_lengths.tolist() == [2] and (cache.cross_k[:, 0, :2] == 2).all()
    fixed = EncoderDecoderKVCache(1, 1, 4, 1, 2, torch.float32, "cpu", growable=False, source_capacity=4)
    with pytest.raises(ValueError, match="at most 4 tokens"):
        fixed.reserve_source(5)


def test_t5_bad_input_gets_clear_errors(t5, checkpoint, tmp_path):
    folder = t5("t5-relu-tied", n_positions=16)
    engine = Engine.from_pretrained(folder)
    with pytest.raises(ValueError, match="encoder takes at most 16"):
        engine.generate([list(range(3, 20))])
    assert not engine.has_unfinished_requests()  # nothing half-done
    assert engine.generate([list(range(3, 19))], SamplingParams(max_new_tokens=2))[0].token_ids  # 16 fit
    other_vocab = t5("t5-relu-tied", tokenizer_files=False, vocab_size=200)
    with pytest.raises(TokenizerMismatchError, match="vocab_size 200"):
        Engine.from_pretrained(folder, other_vocab)
    t5_target = engine.target
    llama = load_model(checkpoint("llama-tied-bias"))
    with pytest.raises(ValueError, match="the target is an encoder-decoder model but the draft is a decoder-only"):
        Engine(t5_target, drafter=ModelDrafter(llama, V, V))
    with pytest.raises(ValueError, match="the target is a decoder-only model but the draft is an encoder-decoder"):
        Engine(llama, drafter=ModelDrafter(t5_target, V, V))
    with pytest.raises(ValueError, match="cuda_graphs runs decoder-only targets"):
        Engine(t5_target, cuda_graphs=True)
    with pytest.raises(TensorParallelError, match="T5 runs in one process"):
        empty_model(load_config(folder), tp=object())
    with pytest.raises(ConfigError, match="feed_forward_proj"):
        T5Config.from_dict(dict(vocab_size=10, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2,
                                feed_forward_proj="gated-gelu-extra"))
    with pytest.raises(ConfigError, match="activation 'tanh'"):
        T5Config.from_dict(dict(vocab_size=10, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2,
                                feed_forward_proj="tanh"))
    # A checkpoint missing a weight names it.
    from safetensors.torch import load_file, save_file
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    del tensors["decoder.block.1.layer.1.EncDecAttention.k.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing from the checkpoint: decoder.block.1.layer.1.EncDecAttention.k"):
        load_model(broken)


def test_cli_generates_with_a_t5_pair(t5, capsys):
    import json

    from specengine.cli import main as cli_main

    target = t5("t5v1.1-gated-gelu-untied")
    code = cli_main(["generate", "--target", str(target), "--draft", str(target), "--gamma", "2", "--prompt",
                     "def f(x):", "--max-new-tokens", "6", "--temperature", "0", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    engine = Engine.from_pretrained(target)
    assert out["token_ids"] == engine.generate(["def f(x):"], SamplingParams(max_new_tokens=6, temperature=0))[0].token_ids
    assert out["stats"]["acceptance_rate"] == 1.0


def test_auto_gamma_on_t5_measures_its_costs_and_stays_lossless(t5):
    target = t5("t5-relu-tied")
    draft = t5("t5-relu-tied", tokenizer_files=False, seed=5, d_model=32, num_layers=1, num_decoder_layers=1)
    auto = Engine.from_pretrained(target, draft, gamma="auto", max_gamma=3)
    costs = auto.gamma_controller.costs_by_batch[1]
    assert costs.draft_step_s > 0 and len(costs.verify_s) == 4 and min(costs.verify_s) > 0
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    prompts = ["def f(x):", "import sys"]
    plain = Engine.from_pretrained(target)
    assert [r.token_ids for r in auto.generate(prompts, greedy)] == [r.token_ids for r in plain.generate(prompts, greedy)]


def test_whole_block_op_checks_its_arguments_and_equals_the_model_block(t5):
    from specengine.ops.decoder_layer import T5BlockWeights, t5_decoder_block

    model = load_model(t5("t5v1.1-gated-gelu-untied", dtype=torch.bfloat16))
    c = model.config
    cache = model.new_cache(2, 16)
    # Row 1's queries (positions 4-6) see positions 0-3, which no forward wrote: a new cache's
    # memory is not zeroed, so they get values here (both paths then read the same entries).
    for entries in cache.layer(0):
        entries.copy_(torch.randn_like(entries))
    model.encode(cache, [[5, 6, 7, 2], [8, 2]])
    weights = model.whole_layer_weights()[0]
    x = torch.randn(2, 3, c.d_model)
    positions = torch.tensor([[0, 1, 2], [4, 5, 6]])
    table = model.decoder_distance_bias(cache.capacity + 3)
    source_last = (cache.source_lengths - 1)[:, None].expand(2, 3).contiguous()
    args = (c.num_heads, c.d_kv, c.activation, c.gated, c.layer_norm_epsilon, positions, *cache.layer(0), 7, table,
            source_last, *cache.cross_layer(0))
    before = [entries.clone() for entries in cache.layer(0)]  # as the block finds them
    got = t5_decoder_block(x.clone(), weights, *args)
    model.use_backend("cpp-ops")  # the same block op by op
    from specengine.models.t5 import DecoderStep
    step = DecoderStep(positions, 7, source_last, "cpp", table)
    with torch.no_grad():  # as the model runs it (with gradients enabled its products would be torch's)
        by_ops = model.decoder[0](x.clone(), step, cache)
    # Both float32 computations of the block: each within the float32 bound of the exact block
    # (tests/bounds.py); AMX tiles sum a bfloat16 matrix's products with x in three bfloat16 terms.
    terms = AMX_TERMS if _C.cpu_isa() == "amx" else 1
    (exact, _, _), (bound, _, _) = t5_block_bounds(x, weights, *args[:5], positions, *before, 7, table, source_last,
                                                   *cache.cross_layer(0), terms)
    assert_within(got, exact, bound, "whole block")
    assert_within(by_ops, exact, bound, "op by op")
    with pytest.raises(ValueError, match="qkv must be a contiguous torch.bfloat16"):
        t5_decoder_block(x.clone(), weights._replace(qkv=weights.qkv.float()), *args)
    with pytest.raises(ValueError, match="activation must be one of"):
        t5_decoder_block(x.clone(), weights, c.num_heads, c.d_kv, "tanh", *args[3:])
    with pytest.raises(ValueError, match="source_last must be in"):
        t5_decoder_block(x.clone(), weights, *args[:10], source_last + 100, *args[11:])
    assert isinstance(weights, T5BlockWeights)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_t5_greedy_on_cuda_equals_cpu(t5, exact_t5):
    """The torch path on a GPU (its logic runs on CPU as the "torch-reference" path above)."""
    target = t5("t5v1.1-gated-gelu-untied")
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    prompts = ["def f(x):", "import os"]
    cpu = Engine.from_pretrained(target, target, gamma=3).generate(prompts, greedy)
    cuda = Engine.from_pretrained(target, target, gamma=3, device="cuda", dtype="float32")
    for got, want in zip(cuda.generate(prompts, greedy), cpu):  # equal up to the first near tie
        assert_greedy_tokens_agree(got.token_ids, want.token_ids, exact_t5(target), want.prompt_token_ids, 4)


def test_the_server_answers_with_a_t5_pair(t5):
    """The OpenAI-compatible server on a T5 target and draft: a completion (the prompt goes to
    the encoder) streamed and not, equal to offline generation."""
    import openai

    from server_util import running_server

    target = t5("t5v1.1-gated-gelu-untied")
    offline = Engine.from_pretrained(target, target, gamma=2)
    prompts = ["def f(x):", "import os"]
    want = offline.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    assert all(r.text for r in want)  # something to compare
    with running_server(Engine.from_pretrained(target, target, gamma=2, max_batch_size=2), "t5") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        response = client.completions.create(model="t5", prompt=prompts, max_tokens=8, temperature=0.0)
        assert [c.text for c in response.choices] == [r.text for r in want]
        assert response.usage.prompt_tokens == sum(r.stats.prompt_tokens for r in want)
        stream = client.completions.create(model="t5", prompt=prompts[0], max_tokens=8, temperature=0.0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream) == want[0].text
