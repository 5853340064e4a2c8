"""The EAGLE-3 feature drafter (models.eagle3, drafters.eagle3): the head loaded from a hand-made
checkpoint in the published layout and checked against the format's float64 forward within
float32's bound (bounds.Float64Eagle3); heads that do not fit the target refused by name; the target's captured
features against transformers' output_hidden_states on every backend and through forwards cut
by layers; in the engine, greedy output equal to target-only on every path, the exact sampling
distribution, seeded sampling the same at batch 1 and 3, and the prefix cache changing nothing."""
import json

import pytest
import torch
from safetensors.torch import save_file

from specengine import Engine, SamplingParams
from specengine.drafters.eagle3 import Eagle3Drafter
from specengine.engine.gamma import CostModel
from specengine.models.config import CheckpointError, ConfigError
from specengine.layers.rotary import rope_inv_freq
from specengine.models.eagle3 import Eagle3Head, is_eagle3_folder, load_eagle3

from bounds import Float64Eagle3
from engine_util import assert_blocks_ran_on_their_path, device_head_dims, tiny_model
from stats_util import chi_square_pvalue

HEADS, KV_HEADS = 4, 2


# ---- hand-made heads in the published layout ------------------------------------------------

def head_tensors(target, seed=0, layer_ids=(0, 1, 2), draft_ids=None, prefix="midlayer.", embed=False,
                 scale=0.3, head_scale=2.0):
    """Random weights of an EAGLE-3 head for `target`, named as EAGLE's checkpoints name them
    (prefix "midlayer."; vLLM's own is "layers.0."). draft_ids: the target ids of its draft
    vocabulary, in order (None: the whole vocabulary)."""
    tc = target.config
    H, V, hd = tc.hidden_size, tc.vocab_size, tc.hidden_size // HEADS
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape, s=scale: torch.randn(*shape, generator=g) * s  # noqa: E731
    ids = torch.arange(V) if draft_ids is None else torch.tensor(draft_ids)
    t = {"fc.weight": r(H, len(layer_ids) * H), "norm.weight": 1 + r(H), "lm_head.weight": r(len(ids), H, s=head_scale),
         "d2t": ids - torch.arange(len(ids)), "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)}
    layer = {"hidden_norm.weight": 1 + r(H), "input_layernorm.weight": 1 + r(H),
             "post_attention_layernorm.weight": 1 + r(H),
             "self_attn.q_proj.weight": r(HEADS * hd, 2 * H), "self_attn.k_proj.weight": r(KV_HEADS * hd, 2 * H),
             "self_attn.v_proj.weight": r(KV_HEADS * hd, 2 * H), "self_attn.o_proj.weight": r(H, HEADS * hd),
             "mlp.gate_proj.weight": r(2 * H, H), "mlp.up_proj.weight": r(2 * H, H),
             "mlp.down_proj.weight": r(H, 2 * H)}
    t.update({prefix + k: v for k, v in layer.items()})
    if embed:
        t["embed_tokens.weight"] = r(V, H, s=1.0)
    return t


def head_config(target, layer_ids=(0, 1, 2), draft_vocab=None, **overrides):
    tc = target.config
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": tc.hidden_size,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": tc.hidden_size // HEADS,
              "intermediate_size": 2 * tc.hidden_size, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "hidden_act": "silu", "num_hidden_layers": 1, "max_position_embeddings": 2048,
              "vocab_size": tc.vocab_size, "draft_vocab_size": draft_vocab or tc.vocab_size,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}
    config.update(overrides)
    return config


def write_head(folder, config, tensors):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


# ---- the published computation in float64 (bounds.Float64Eagle3, written from the format) -----

def float64_head(t, embedding, head, prefix="midlayer.", norm_before_residual=False) -> Float64Eagle3:
    """The head of tensors t (its published names; embedding [V, H] the one it uses) in float64,
    with float32's bounds (tests/bounds.py)."""
    c = head.config
    return Float64Eagle3(t, embedding, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps,
                         rope_inv_freq(c.rope, c.head_dim), prefix, norm_before_residual)


@pytest.fixture(scope="module")
def target():
    return tiny_model(32, seed=0, logit_scale=3.0)


@pytest.mark.parametrize("backend, stored", [("cpp-ops", torch.float32), ("cpp-ops", torch.bfloat16),
                                            ("torch", torch.float32), ("triton", torch.float32)])
def test_the_head_computes_the_published_forward(target, tmp_path, backend, stored):
    """A checkpoint in EAGLE's layout (midlayer.*, a trimmed vocabulary with d2t) loads, and its
    pairs fed in two pieces then two chain steps give the float64 forward's outputs and logits, on
    each backend (Triton in its interpreter here); a bfloat16 checkpoint keeps its matrices so."""
    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("the Triton path runs here in the interpreter, on CPU tensors")
    draft_ids = [3, 0, 7, 9, 12, 13, 20, 21, 25, 31, 30, 1]
    t = {k: v.to(stored) if v.is_floating_point() else v for k, v in head_tensors(target, draft_ids=draft_ids).items()}
    folder = write_head(tmp_path / "head", head_config(target, draft_vocab=len(draft_ids)), t)
    assert is_eagle3_folder(folder) and not is_eagle3_folder(tmp_path)
    head = load_eagle3(folder, target)
    assert head.config.feature_layers == (0, 1, 2) and head.embed_tokens is None
    assert head.lm_head.weight.dtype == stored and head.norm.weight.dtype == torch.float32
    if backend != "cpp-ops":
        head.use_backend(backend)
    assert head.backend.name == backend
    g = torch.Generator().manual_seed(1)
    features = torch.randn(7, 3 * 32, generator=g)
    tokens = torch.randint(0, 32, (7,), generator=g).tolist()
    chain = [5, 17]
    exact_out, exact_logits = float64_head(t, target.model.embed_tokens.weight, head).outputs(features, tokens, chain)
    cache = head.new_cache(1, 16)
    outs = []
    for a, b in ((0, 4), (4, 7)):  # the pairs in two calls
        hidden = head.fuse(features[None, a:b])
        outs.append(head(torch.tensor([tokens[a:b]]), torch.tensor([a]), cache, hidden=hidden)[0])
    hidden = outs[-1][-1:][None]
    for i, token in enumerate(chain):  # each chain step feeds back the output before it
        hidden = head(torch.tensor([[token]]), torch.tensor([7 + i]), cache, hidden=hidden)
        outs.append(hidden[0])
    out = torch.cat(outs)
    assert head.triton_fallback_reason is None and head.backend.name == backend  # its own kernels ran
    exact_out.check(out, "outputs")
    logits, ids = head.logits(out), torch.tensor(draft_ids)
    outside = torch.ones(logits.shape[-1], dtype=torch.bool).index_fill_(0, ids, False)
    assert torch.isinf(logits[:, outside]).all() and torch.isfinite(logits[:, ids]).all()
    exact_logits.check(logits[:, ids], "logits at the draft ids (d2t)")


def test_vllm_names_an_own_embedding_and_norm_before_residual(target, tmp_path):
    """layers.0.* names (vLLM's), a head's own embed_tokens, and norm_before_residual (the residual is
    then the normed hidden)."""
    t = head_tensors(target, seed=2, prefix="layers.0.", embed=True)
    head = load_eagle3(write_head(tmp_path / "head", head_config(target), t), target)
    assert head.embed_tokens is not None
    features = torch.randn(3, 96, generator=torch.Generator().manual_seed(3))
    tokens = [4, 8, 15]
    exact_out, _ = float64_head(t, t["embed_tokens.weight"], head, prefix="layers.0.").outputs(features, tokens, [])
    out = head(torch.tensor([tokens]), torch.tensor([0]), head.new_cache(1, 8), hidden=head.fuse(features[None]))[0]
    exact_out.check(out)
    other = load_eagle3(write_head(tmp_path / "nbr", head_config(target, norm_before_residual=True), t), target)
    moved = other(torch.tensor([tokens]), torch.tensor([0]), other.new_cache(1, 8), hidden=other.fuse(features[None]))
    exact_moved, _ = float64_head(t, t["embed_tokens.weight"], other, prefix="layers.0.",
                                  norm_before_residual=True).outputs(features, tokens, [])
    exact_moved.check(moved[0])
    assert not torch.allclose(exact_moved.exact, exact_out.exact, atol=1e-2)  # the option matters


def test_the_drafters_q_is_the_published_chain(target, tmp_path):
    """The drafter's q over two rounds against the float64 forward: pairs (features at t, token at
    t + 1), the chain fed back from the head's outputs, its entries dropped for the verified tokens'
    pairs in the next round; ids past the tokenizer's (30, 31) never proposed."""
    from specengine.sampling.batch import SamplingBatch

    draft_ids = [31, 0, 7, 9, 12, 13, 20, 21, 25, 3, 30, 1]
    t = head_tensors(target, seed=5, draft_ids=draft_ids)
    head = load_eagle3(write_head(tmp_path / "head", head_config(target, draft_vocab=len(draft_ids)), t), target)
    drafter = Eagle3Drafter(head, 32, 30)
    g = torch.Generator().manual_seed(2)
    seq = prompt(12, 9)
    features = torch.randn(13, 96, generator=g)  # positions 0 .. 12
    greedy = SamplingBatch.from_params([SamplingParams(temperature=0)], [0], torch.device("cpu"))
    embedding = target.model.embed_tokens.weight
    ids = torch.tensor(draft_ids)
    outside = torch.ones(32, dtype=torch.bool).index_fill_(0, ids[ids < 30], False)
    drafter.join_rows([seq], 64)
    drafter.take_features([0], [0], features[None, :11], [11])  # the prompt's prefill: positions 0 .. 10
    for rnd, (sequence, budget) in enumerate(((seq, 3), (None, 2))):
        if rnd == 1:  # verification kept draft 1 and emitted another token; features of positions 11, 12
            sequence = seq + [drafts[0], 5]
            drafter.take_features([0], [11], features[None, 11:13], [2])
        proposal = drafter.propose([sequence], [budget], greedy)
        drafts = proposal.tokens[0].tolist()
        n = len(sequence)
        exact = float64_head(t, embedding, head).chain_logits(features[:n - 1], sequence[1:], drafts[:-1])  # [G, Vd]
        proposable = ids < 30  # the draft ids whose target ids the tokenizer has
        scores = exact.exact.masked_fill(~proposable, float("-inf"))
        assert proposal.num_drafts.tolist() == [budget] and drafts == ids[scores.argmax(-1)].tolist()
        q = proposal.logits[0]  # [G, V]: -inf but at the proposable draft ids
        assert torch.isinf(q[:, outside]).all() and torch.isfinite(q[:, ids[proposable]]).all()
        exact[:, proposable].check(q[:, ids[proposable]])


@pytest.mark.parametrize("change, match", [
    (dict(config=dict(vocab_size=40)), "vocab_size 40 is not the target's 32"),
    (dict(config=dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 5]})),
     r"eagle_aux_hidden_state_layer_ids \[0, 1, 5\] must be distinct ids of the target's 2 layers"),
    (dict(config=dict(eagle_config={})), r"eagle_aux_hidden_state_layer_ids \[2, 1, -1\]"),  # the default ids
    (dict(config=dict(target_hidden_size=64)), "reads states of width 64"),
    (dict(config=dict(num_hidden_layers=2)), "one decoder layer"),
    (dict(config=dict(architectures=["LlamaForCausalLM"])), "not an EAGLE-3 head"),
    (dict(tensors={"d2t": torch.full((32,), 3)}), "d2t maps draft ids to target ids outside"),
    (dict(tensors={"fc.weight": torch.zeros(32, 64)}), r"fc.weight has shape \(32, 64\)"),
    (dict(tensors={"midlayer.self_attn.q_proj.weight": torch.zeros(32, 32)}), "q_proj.weight has shape"),
    (dict(tensors={"midlayer.extra.weight": torch.zeros(2)}), "tensors an EAGLE-3 head does not have: extra"),
    (dict(drop="norm.weight"), "EAGLE-3 head tensors missing: norm.weight"),
    (dict(config=dict(hidden_size=64, head_dim=16, intermediate_size=128)), "reads states of width 64"),
])
def test_a_head_that_does_not_fit_is_refused_by_name(target, tmp_path, change, match):
    config = head_config(target)
    config.update(change.get("config", {}))
    tensors = head_tensors(target)
    tensors.update(change.get("tensors", {}))
    tensors.pop(change.get("drop", ""), None)
    with pytest.raises((ConfigError, CheckpointError), match=match):
        load_eagle3(write_head(tmp_path / "head", config, tensors), target)


def test_the_writer_writes_what_the_loader_reads_and_refuses_by_name(target, tmp_path):
    """save_eagle3 writes config.json from the config (a scaled rope too) and the tensors
    published_shapes names; load_eagle3 reads back the same config; a tensor missing, unknown or
    misshapen is refused by name before anything is written."""
    import dataclasses

    from specengine.layers.rotary import RopeConfig
    from specengine.models.eagle3 import (Eagle3Config, draft_vocab_maps, published_shapes, save_eagle3)

    cfg = dataclasses.replace(Eagle3Config.for_target(target.config, (0, 2, 1), 12),
                              rope=RopeConfig(theta=5e5, rope_type="llama3", factor=8.0,
                                              original_max_position_embeddings=64))
    assert Eagle3Config.from_dict(cfg.to_dict(), target_layers=40) == cfg
    g = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=g) for name, shape in published_shapes(cfg).items()}
    tensors["d2t"], tensors["t2d"] = draft_vocab_maps(torch.tensor([5, 1, 7, 9, 12, 13, 20, 21, 25, 3, 30, 0]), 32)
    head = load_eagle3(save_eagle3(tmp_path / "head", cfg, tensors), target)
    assert head.config == cfg and head.target_ids.tolist() == [5, 1, 7, 9, 12, 13, 20, 21, 25, 3, 30, 0]
    assert head.lm_head.weight.dtype == torch.bfloat16  # written in bfloat16 by default
    for change, match in ((dict(drop="midlayer.mlp.up_proj.weight"), "missing midlayer.mlp.up_proj.weight"),
                          (dict(add={"layers.0.extra": torch.zeros(1)}), "unknown layers.0.extra"),
                          (dict(add={"fc.weight": torch.zeros(32, 64)}), r"fc.weight has shape \(32, 64\)")):
        bad = {k: v for k, v in tensors.items() if k != change.get("drop")} | change.get("add", {})
        with pytest.raises(CheckpointError, match=match):
            save_eagle3(tmp_path / "bad", cfg, bad)
        assert not (tmp_path / "bad").exists()
    with pytest.raises(ValueError, match="distinct ids in"):
        draft_vocab_maps(torch.tensor([1, 1]), 32)


# ---- the target's features -------------------------------------------------------------------

LAYER_OPS = {"whole-layer": "cpp-layers", "cpp-ops": "cpp-ops", "torch-ops": "torch", "triton": "triton"}


@pytest.mark.parametrize("layer_ops", list(LAYER_OPS))
def test_features_are_transformers_hidden_states(layer_ops, checkpoint):
    """The states entering layers 1 and 0 and leaving the last (transformers' output_hidden_states[i]) on each backend,
    whole and through a forward cut between layers (PartialForward, chunked prefill's)."""
    from transformers import AutoModelForCausalLM

    from specengine.models import load_model

    if layer_ops == "triton" and torch.cuda.is_available():
        pytest.skip("the Triton path runs here in the interpreter, on CPU tensors")
    folder = checkpoint("llama3-rope-gqa", torch.bfloat16 if layer_ops == "whole-layer" else torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_model(folder)
    if layer_ops != "whole-layer":
        ours.use_backend(LAYER_OPS[layer_ops])
    assert ours.backend.name == LAYER_OPS[layer_ops]
    L = ours.config.num_layers
    ids = (1, L, 0)  # L: the last layer's output before the final norm (transformers' last state is after it)
    ours.capture_features(ids)
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = hf(tokens, output_hidden_states=True).hidden_states
    norm = hf.model.norm
    expected = torch.cat([states[1], states[L], states[0]], -1)
    with torch.inference_mode():
        cache = ours.new_cache(2, 16)
        ours(tokens, torch.zeros(2, dtype=torch.int64), cache)
        whole = ours.features
        run, cut = ours.start_forward(tokens, torch.zeros(2, dtype=torch.int64)), ours.new_cache(2, 16)
        assert ours.forward_layers(run, cut, layers=1) is None
        ours.forward_layers(run, cut)
    assert whole.shape == (2, 9, 3 * ours.config.hidden_size) and whole.dtype == torch.float32
    H = ours.config.hidden_size
    with torch.no_grad():
        whole_normed = torch.cat([whole[..., :H], norm(whole[..., H:2 * H]), whole[..., 2 * H:]], -1)
    torch.testing.assert_close(whole_normed, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(run.features, whole, rtol=0, atol=0)


def test_capture_refuses_layers_the_target_lacks(target):
    with pytest.raises(ValueError, match=r"feature layers must be distinct layer ids in \[0, 2\]"):
        target.capture_features((0, 3))
    with pytest.raises(ValueError, match="distinct"):
        target.capture_features((1, 1))


# ---- in the engine ---------------------------------------------------------------------------

GREEDY = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)


def bigram_target(vocab_size=32, seed=0, head_dim=None):
    """A target whose layers add nothing (o_proj and down_proj zero): its next token is a function
    of the current one, b(x) = argmax of its logits on x's embedding. Its layers still run, write
    their caches and hand over features."""
    target = tiny_model(vocab_size, seed=seed, logit_scale=3.0, head_dim=head_dim)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return target


def planted_tensors(target, scale=20.0):
    """A head that drafts a bigram target's next token well: its layer adds nothing (o_proj and
    down_proj zero), so its output at the pair (features of x_t, x_{t+1}) is fc of the features,
    here the embedding of x_t, and its lm_head scores b(b(x_t)) = x_{t+2} (the target's greedy
    token) by the normed embeddings mapped there. Its later chain drafts repeat the first: accepted
    only sometimes, so acceptance is ragged."""
    t = head_tensors(target, seed=4)
    H, V = target.config.hidden_size, target.config.vocab_size
    t["fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, 2 * H)], 1)  # slot 0: layer 0's input, the embedding
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        t["midlayer." + name].zero_()
    with torch.no_grad():
        normed = target.model.norm(target.model.embed_tokens.weight)  # [V, H]: what the target's head reads
        b = target.logits(normed).argmax(-1)
    t["norm.weight"] = target.model.norm.weight.detach().clone()
    lm_head = torch.zeros(V, H)
    lm_head.index_add_(0, b[b], normed / normed.pow(2).sum(-1, keepdim=True))
    t["lm_head.weight"] = lm_head * scale * H
    return t


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """(bigram target, folder of its planted head)."""
    target = bigram_target()
    folder = write_head(tmp_path_factory.mktemp("planted"), head_config(target), planted_tensors(target))
    return target, folder


def eagle_engine(target, folder, **options) -> Engine:
    head = load_eagle3(folder, target)
    return Engine(target, drafter=Eagle3Drafter(head, target.config.vocab_size, target.config.vocab_size), **options)


PROMPTS = [[1, 2, 3, 4, 5], [7], list(range(3, 31)) * 2 + [9, 1]]


@pytest.fixture(scope="module")
def baseline(planted):
    return [r.token_ids for r in Engine(planted[0]).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("gamma", [1, 2, 3, 4, "auto"])
def test_greedy_equals_target_only_with_ragged_acceptance(planted, baseline, gamma):
    # "auto" from given step costs where drafting pays: measured ones on a loaded machine may
    # choose target-only, and the test is of the drafting, not of the machine.
    costs = {b: CostModel(0.1, tuple(1.0 + 0.05 * k for k in range(9))) for b in (1, 8)} if gamma == "auto" else None
    engine = eagle_engine(*planted, gamma=gamma, costs=costs)
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == baseline
    stats = engine.last_run_stats
    assert stats.accepted > 0 and stats.rejections > 0  # drafts both kept and rejected
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    assert alone == baseline


def test_the_planted_head_drafts_the_targets_next_token(planted):
    """Its first draft is the target's greedy token: nearly every round keeps one draft or more."""
    engine = eagle_engine(*planted, gamma=1)
    engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True))
    assert engine.last_run_stats.acceptance_rate > 0.8


def test_a_random_head_keeps_greedy_output(planted, baseline, tmp_path):
    target = planted[0]
    folder = write_head(tmp_path / "head", head_config(target, draft_vocab=20),
                        head_tensors(target, seed=7, draft_ids=list(range(31, 11, -1))))
    assert [r.token_ids for r in eagle_engine(target, folder, gamma=3).generate(PROMPTS, GREEDY)] == baseline


def test_requests_join_and_leave_a_running_batch(planted, baseline):
    """Two requests decode; a third joins mid-run; the second is aborted: the others' tokens are
    target-only greedy's."""
    engine = eagle_engine(*planted, gamma=3)
    first = engine.add_request(PROMPTS[0], GREEDY)
    second = engine.add_request(PROMPTS[1], GREEDY)
    tokens = {}

    def step():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    for _ in range(3):
        step()
    third = engine.add_request(PROMPTS[2], GREEDY)
    step()
    assert engine.abort(second)
    while engine.has_unfinished_requests() or engine.has_pending_outputs():
        step()
    assert tokens[first] == baseline[0] and tokens[third] == baseline[2]


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 32, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(planted):
    specs = [SamplingParams(max_new_tokens=16, temperature=1.0, seed=s) for s in (1, 2, 3)]
    prompts = [prompt(9, 1), prompt(40, 2), prompt(3, 3)]
    engine = eagle_engine(*planted, gamma=3, prefix_cache_bytes=0)
    together = [r.token_ids for r in engine.generate(prompts, specs)]
    assert engine.last_run_stats.accepted > 0
    assert together == [engine.generate([p], [s])[0].token_ids for p, s in zip(prompts, specs)]


def test_the_prefix_cache_keeps_the_drafts_q(planted):
    """Prompts sharing two blocks of the prefix cache: seeded outputs (which follow q) equal those
    without the cache, the blocks' features standing in for the prefill's."""
    shared = prompt(130, 5)
    prompts = [shared + prompt(6, 6), shared + prompt(3, 7), shared[:129]]
    specs = [SamplingParams(max_new_tokens=14, temperature=t, seed=s) for t, s in ((1.0, 1), (0.8, 2), (1.0, 3))]
    without = eagle_engine(*planted, gamma=3, prefix_cache_bytes=0)
    want = [without.generate([p], [s])[0].token_ids for p, s in zip(prompts, specs)]
    engine = eagle_engine(*planted, gamma=3, prefix_cache_bytes=1 << 24)
    got = [engine.generate([p], [s])[0].token_ids for p, s in zip(prompts, specs)]
    assert engine.prefix_cache.hit_tokens >= 2 * 128
    assert got == want


class OneLayerAStep:
    """A prefill budget as it is when a chunk takes longer than a round: 32 tokens, one layer a step."""

    def __init__(self, budget):
        self.budget = budget

    def next(self, decoding: bool):
        from specengine.engine.prefill_budget import PrefillShare
        return PrefillShare(32, 1) if decoding else PrefillShare(None)

    def __getattr__(self, name):
        return getattr(self.budget, name)


def test_chunks_cut_by_layers_joins_aborts_and_cached_prompts_keep_outputs(planted):
    """A chunk's forward spread over steps while rows decode, join and leave, a request is aborted
    and another's prompt is all in the prefix cache: outputs (seeded ones too) are those of whole
    prompts without the cache."""
    cached_prompt = prompt(64 + 1, seed=41)
    specs = [(prompt(200, seed=40), SamplingParams(max_new_tokens=12, temperature=1.0, seed=1)),
             (cached_prompt, SamplingParams(max_new_tokens=6, temperature=0.0)),
             (prompt(150, seed=42), SamplingParams(max_new_tokens=8, temperature=0.7, seed=2)),
             (prompt(90, seed=43), SamplingParams(max_new_tokens=5, temperature=1.0, seed=3))]
    unchunked = eagle_engine(*planted, gamma=3, prefill_chunk_tokens=None, prefix_cache_bytes=0)
    want = [unchunked.generate([p], s)[0].token_ids for p, s in specs]
    engine = eagle_engine(*planted, gamma=3, prefill_chunk_tokens="auto")
    engine.scheduler.prefill_budget = OneLayerAStep(engine.scheduler.prefill_budget)
    engine.generate([cached_prompt], SamplingParams(max_new_tokens=1))  # its blocks into the prefix cache
    runner = engine.add_request(prompt(5), SamplingParams(max_new_tokens=60, temperature=0))
    outputs, step, pending_seen = {runner: engine.step()[0].new_token_ids}, 0, 0
    engine.add_request(specs[0][0], specs[0][1], "long")
    while engine.has_unfinished_requests() or engine.has_pending_outputs():
        if step == 1:
            assert engine.scheduler.batch.pending is not None
            engine.add_request(specs[1][0], specs[1][1], "cached")
            engine.add_request(specs[2][0], specs[2][1], "aborted")
        if step == 4:
            assert engine.abort("aborted")
        if step == 6:
            engine.add_request(specs[3][0], specs[3][1], "later")
        pending_seen += engine.scheduler.batch.pending is not None
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    assert pending_seen >= 7
    assert outputs["long"] == want[0] and outputs["cached"] == want[1] and outputs["later"] == want[3]
    assert outputs["aborted"] == [] and len(outputs[runner]) == 60
    assert engine.prefix_cache.hit_tokens >= 64


@pytest.fixture
def reads(monkeypatch):
    """The rounds of every read the engine makes (more than one: a block run from device state)."""
    from specengine.engine.rounds import RoundRunner
    rounds, real = [], RoundRunner.run

    def spy(runner, batch, gamma, rounds_per_read):
        results, made = real(runner, batch, gamma, rounds_per_read)
        rounds.append(results[0].rounds)
        return results, made
    monkeypatch.setattr(RoundRunner, "run", spy)
    return rounds


def sampled(n: int, temperature: float = 1.0):
    return [SamplingParams(max_new_tokens=n, temperature=temperature, seed=s, ignore_eos=True) for s in range(3)]


@pytest.mark.parametrize("rounds_per_read", [1, 4])
def test_fixed_shape_steps_and_blocks_draft_as_eager_rounds(planted, baseline, rounds_per_read, reads,
                                                           rehearsed_captures):
    """cuda_graphs on a CPU (the fixed-shape steps and draft phases, eagerly, each first run after
    a capture's warm-ups and their undoing, as on a GPU) with host rounds, or blocks of rounds from
    device state whose catch-up is the round before's verification: greedy output is
    target-only's, and seeded sampling (which follows q through every acceptance test) gives the
    eager engine's tokens."""
    options = dict(gamma=3, cuda_graphs=True, max_batch_size=4, rounds_per_read=rounds_per_read)
    prompts = [prompt(9, 1), prompt(40, 2), [5, 3]]
    want = [r.token_ids for r in eagle_engine(*planted, gamma=3).generate(prompts, sampled(24))]
    # Sampled first: each call's rehearsal runs on its first use, where wrong drafts change tokens.
    engine = eagle_engine(*planted, **options)
    assert [r.token_ids for r in engine.generate(prompts, sampled(24))] == want
    stats = engine.last_run_stats
    assert stats.accepted > 0 and stats.rejections > 0
    assert (max(reads) > 1) == (rounds_per_read > 1)  # blocks ran, or none was asked for
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == baseline
    assert engine.last_run_stats.accepted > 0


@pytest.mark.parametrize("device, head_dim", device_head_dims())
def test_graphs_replay_the_heads_draft_phases_as_eager(device, head_dim, tmp_path, reads):
    """On CUDA: the head's draft phase captured (a graph per bucket and gamma for host rounds, and
    inside each block's round graph) over the compiled step kernels, greedy output target-only's
    and seeded sampling the eager engine's; on a CPU the same phases run eagerly."""
    target = bigram_target(head_dim=head_dim)
    folder = write_head(tmp_path / "head", head_config(target), planted_tensors(target))
    target = target.to(device)
    prompts = [prompt(9, 1), prompt(40, 2), [5, 3]]
    greedy = [r.token_ids for r in Engine(target).generate(prompts, GREEDY)]
    want = [r.token_ids for r in eagle_engine(target, folder, gamma=3).generate(prompts, sampled(24))]
    engine = eagle_engine(target, folder, gamma=3, cuda_graphs=True, max_batch_size=4, rounds_per_read=4)
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == greedy
    assert [r.token_ids for r in engine.generate(prompts, sampled(24))] == want
    assert engine.last_run_stats.accepted > 0 and max(reads) > 1
    assert_blocks_ran_on_their_path(engine, device)


def test_blocks_hand_the_head_the_verified_features_at_every_read(planted, monkeypatch, reads):
    """Blocks between host rounds (rounds at gamma 0 before them, a row joining mid-run, seeded
    sampling): after every read each row's head holds pairs up to some position and the target's
    features of the rest of its sequence, equal to a whole forward's. (The tokens depend on the
    gammas each row's rounds took, which differ from any engine's without blocks: the test
    above compares tokens.)"""
    target, folder = planted
    specs = [(prompt(7, 3), SamplingParams(max_new_tokens=30, temperature=1.0, seed=1, ignore_eos=True)),
             (prompt(33, 4), SamplingParams(max_new_tokens=26, temperature=0.8, seed=2, ignore_eos=True)),
             (prompt(4, 5), SamplingParams(max_new_tokens=20, temperature=1.0, seed=3, ignore_eos=True))]
    engine = eagle_engine(target, folder, gamma="auto", max_gamma=3, cuda_graphs=True, max_batch_size=4,
                          rounds_per_read=4, costs={b: CostModel(0.1, (1.0, 1.05, 1.1, 1.15)) for b in (1, 4)})
    gammas = iter([3, 0, 0, 3, 3, 0, 3] + [3] * 100)  # rounds at gamma 0 leave a row lacking more than a block feeds
    monkeypatch.setattr(engine.scheduler, "choose_gamma", lambda decoding: next(gammas))
    ids = [engine.add_request(*specs[0]), engine.add_request(*specs[1])]
    outputs, steps, checked, accepted = {}, 0, 0, 0
    drafter = engine.drafter
    while engine.has_unfinished_requests() or engine.has_pending_outputs():
        if steps == 3:
            ids.append(engine.add_request(*specs[2]))
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            accepted += out.stats.accepted if out.finished else 0
        steps += 1
        with torch.inference_mode():
            for b, request in enumerate(engine.scheduler.batch.requests):
                sequence = request.tokens
                held = drafter.fed[b] + drafter.pending[b].shape[0]
                assert held == len(sequence) - 1
                target(torch.tensor([sequence[:-1]]), torch.tensor([0]), target.new_cache(1, len(sequence)))
                torch.testing.assert_close(drafter.pending[b], target.features[0, drafter.fed[b]:], rtol=1e-5, atol=1e-5)
                checked += 1
    assert [len(outputs[i]) for i in ids] == [s.max_new_tokens for _, s in specs]
    assert checked > 10 and max(reads) > 1 and accepted > 0


def test_every_rounds_q_is_the_heads_over_the_verified_features(target, tmp_path, monkeypatch):
    """In the engine (three seeded rows, ragged acceptance, rounds without drafts), each round's q equals the head's
    run from scratch over the sequence's features from one target forward and the drafted chain:
    the drafter pairs the right features with the right tokens, keeps only verified tokens' and
    feeds its chain back as it should."""
    folder = write_head(tmp_path / "head", head_config(target, draft_vocab=24),
                        head_tensors(target, seed=8, draft_ids=list(range(24))))
    engine = eagle_engine(target, folder, gamma=3)
    drafter, records = engine.drafter, []
    propose = drafter.propose

    def recording(sequences, budgets, sampling):
        proposal = propose(sequences, budgets, sampling)
        records.append(([list(s) for s in sequences], proposal.tokens.clone(), proposal.logits.clone()))
        return proposal
    monkeypatch.setattr(drafter, "propose", recording)
    # gamma scripted through rounds without drafts, after which the head catches up on several tokens
    script = iter([3, 0, 0, 2, 0, 0, 0, 1] + [3, 2, 0] * 20)
    monkeypatch.setattr(engine.scheduler, "choose_gamma", lambda decoding: next(script))
    specs = [SamplingParams(max_new_tokens=16, temperature=1.0, seed=s) for s in range(3)]
    engine.generate([prompt(6, 1), prompt(35, 2), [4]], specs)
    assert engine.last_run_stats.accepted > 0 and engine.last_run_stats.rejections > 0
    head, checked = drafter.model, 0
    with torch.inference_mode():
        for sequences, tokens, logits in records:
            for b, seq in enumerate(sequences):
                n, G = len(seq), tokens.shape[1]
                if n < 2:
                    continue
                target(torch.tensor([seq[:-1]]), torch.tensor([0]), target.new_cache(1, n))
                features = target.features  # [1, n - 1, F]
                cache = head.new_cache(1, n + G)
                out = head(torch.tensor([seq[1:]]), torch.tensor([0]), cache, hidden=head.fuse(features))[:, -1:]
                q = [head.logits(out)[0, 0]]
                for i, token in enumerate(tokens[b, :G - 1].tolist()):
                    out = head(torch.tensor([[token]]), torch.tensor([n - 1 + i]), cache, hidden=out)
                    q.append(head.logits(out)[0, 0])
                torch.testing.assert_close(logits[b], torch.stack(q), rtol=1e-4, atol=1e-4)
                checked += 1
    assert checked > 10


@pytest.mark.slow
@pytest.mark.parametrize("case, impl", [("T=1", "cpp"), ("T=0.7,top_k=3", "reference"), ("top_p=0.8", "cpp"),
                                        ("min_p=0.2", "cpp")])
def test_sampling_matches_exact_target_distribution(case, impl, tmp_path):
    """test_engine_sampling's chi-square check with the feature drafter: a head over 3 of the
    target's 5 ids (d2t), so tokens 1 and 2 reach the output only through the residual."""
    from stats_util import CASES, V, exact_distribution, sample_counts

    target = tiny_model(V, seed=0, hidden_size=16, logit_scale=4.0)
    folder = write_head(tmp_path / "head", head_config(target, draft_vocab=3),
                        head_tensors(target, seed=1, draft_ids=[3, 0, 4], head_scale=3.0))
    engine = eagle_engine(target, folder, gamma=3, verify_impl=impl)
    counts = sample_counts(engine, CASES[case], 12_000)
    assert chi_square_pvalue(counts, exact_distribution(target, CASES[case])) > 1e-3
    stats = engine.last_run_stats  # both of Algorithm 1's paths taken many times
    assert stats.accepted > 300 and stats.rejections > 300


@pytest.mark.slow
def test_the_distribution_test_sees_a_wrong_d2t(tmp_path, monkeypatch):
    """The same check rejects a drafter whose q puts the head's scores at the wrong target ids
    (the drafts themselves sampled from the right ones)."""
    from stats_util import CASES, V, exact_distribution, sample_counts

    target = tiny_model(V, seed=0, hidden_size=16, logit_scale=4.0)
    folder = write_head(tmp_path / "head", head_config(target, draft_vocab=3),
                        head_tensors(target, seed=1, draft_ids=[3, 0, 4], head_scale=3.0))
    engine = eagle_engine(target, folder, gamma=3)
    propose = engine.drafter.propose

    def wrong_q(*args):
        proposal = propose(*args)
        proposal.logits = proposal.logits[..., [4, 1, 2, 0, 3]]  # ids 0, 3, 4 swap their scores
        return proposal
    monkeypatch.setattr(engine.drafter, "propose", wrong_q)
    counts = sample_counts(engine, CASES["T=1"], 6_000)
    assert chi_square_pvalue(counts, exact_distribution(target, CASES["T=1"])) < 1e-6


def test_from_pretrained_takes_a_head_by_drafter_name_or_by_its_config(text_pair, tmp_path):
    from specengine.models import load_model

    target_folder = text_pair[0]
    target = load_model(target_folder)
    folder = write_head(tmp_path / "head", head_config(target), head_tensors(target, seed=3))
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    want = Engine.from_pretrained(target_folder).generate(["def main():"], params)[0].token_ids
    for drafter in ("eagle3", "model"):  # "model" with a folder whose config says EAGLE-3
        engine = Engine.from_pretrained(target_folder, folder, drafter=drafter, gamma=3)
        assert isinstance(engine.drafter, Eagle3Drafter) and engine.target.feature_layers == (0, 1, 2)
        assert engine.generate(["def main():"], params)[0].token_ids == want
    with pytest.raises(ValueError, match="give its folder as `draft`"):
        Engine.from_pretrained(target_folder, drafter="eagle3")


def test_an_engine_without_a_feature_drafter_captures_nothing(planted):
    target, folder = planted
    eagle_engine(target, folder)
    assert target.feature_layers == (0, 1, 2)
    Engine(target)
    assert target.feature_layers == () and target.features is None


def test_greedy_equals_target_only_on_a_gguf_target(tmp_path):
    """A Q4_1 file llama.cpp's quantizer wrote, its matrices as stored (whole C++ layers for the
    rounds, GEMMs for the prefill): its features feed the head, and greedy output is target-only's."""
    from gguf_util import gguf_file

    from specengine.models import load_model

    target = load_model(gguf_file("tiny-llama.Q4_1.gguf"))
    assert target.backend.name == "cpp-layers"
    folder = write_head(tmp_path / "head", head_config(target, layer_ids=(1, 0, 2)), head_tensors(target, seed=6))
    prompts = [prompt(40, 11), prompt(5, 12), [7]]
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    want = [r.token_ids for r in Engine(target).generate(prompts, params)]
    engine = eagle_engine(target, folder, gamma=3)
    assert [r.token_ids for r in engine.generate(prompts, params)] == want
    assert engine.last_run_stats.drafted > 0


def test_a_server_drafts_with_the_head_and_counts_it(text_pair, tmp_path):
    """The server of an engine with an EAGLE-3 head: a greedy completion is the offline one, and
    /metrics counts the rounds' drafts and the accepted ones as the engine's statistics do."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from server_util import running_server
    from specengine.models import load_model

    target_folder = text_pair[0]
    folder = write_head(tmp_path / "head", head_config(load_model(target_folder)),
                        head_tensors(load_model(target_folder), seed=3))
    engine = Engine.from_pretrained(target_folder, folder, drafter="eagle3", gamma=3)
    offline = engine.generate(["def add(a, b):"], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
    drafted, accepted = engine.last_run_stats.drafted, engine.last_run_stats.accepted

    def counters(url):
        text = httpx.get(url + "/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}

    with running_server(engine, "eagle") as (url, _):
        before = counters(url)
        response = httpx.post(url + "/v1/completions", json=dict(model="eagle", prompt="def add(a, b):", max_tokens=10,
                                                                 temperature=0.0, ignore_eos=True), timeout=60)
        assert response.status_code == 200
        assert response.json()["choices"][0]["text"] == offline[0].text
        after = counters(url)
    assert drafted > 0
    assert after["specengine:spec_decode_num_draft_tokens_total"] - before.get(
        "specengine:spec_decode_num_draft_tokens_total", 0) == drafted
    assert after["specengine:spec_decode_num_accepted_tokens_total"] - before.get(
        "specengine:spec_decode_num_accepted_tokens_total", 0) == accepted


@pytest.mark.parametrize("options", [{}, dict(cuda_graphs=True, max_batch_size=2, rounds_per_read=4)],
                         ids=["host-rounds", "blocks"])
def test_greedy_equals_target_only_on_the_triton_kernels(tmp_path, options, reads):
    """Target and head on the Triton step kernels (in the interpreter here), in host rounds or in
    blocks from device state: the features come from the Triton forward (its norms update the
    residual in place), and greedy output is target-only's."""
    if torch.cuda.is_available():
        pytest.skip("the Triton path runs here in the interpreter, on CPU tensors")
    target = bigram_target()
    folder = write_head(tmp_path / "head", head_config(target), planted_tensors(target))
    # Blocks need rows with room for two full rounds after the host round that feeds the prompt.
    params = SamplingParams(max_new_tokens=16 if options else 8, temperature=0, ignore_eos=True)
    prompts = [prompt(7, 1), prompt(3, 2)]
    want = [r.token_ids for r in Engine(target).generate(prompts, params)]
    target.use_backend("triton")
    engine = eagle_engine(target, folder, gamma=3, **options)
    engine.drafter.model.use_backend("triton")
    assert [r.token_ids for r in engine.generate(prompts, params)] == want
    assert engine.last_run_stats.accepted > 0 and (max(reads) > 1) == bool(options)
    assert target.triton_fallback_reason is None and engine.drafter.model.triton_fallback_reason is None


def test_cli_generates_with_a_head(text_pair, tmp_path, capsys):
    from specengine.cli import main
    from specengine.models import load_model

    target_folder = text_pair[0]
    target = load_model(target_folder)
    folder = write_head(tmp_path / "head", head_config(target), head_tensors(target, seed=3))
    args = ["generate", "--target", str(target_folder), "--prompt", "def f(x):", "--temperature", "0",
            "--max-new-tokens", "8", "--gamma", "3", "--json"]
    assert main(args) == 0
    want = json.loads(capsys.readouterr().out)["token_ids"]
    for chosen in (["--drafter", "eagle3"], []):  # by name, or by the folder's config
        assert main([*args, "--draft", str(folder), *chosen]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["token_ids"] == want and out["stats"]["draft_calls"] > 0


def test_a_target_shared_with_another_engine_still_feeds_the_head(planted, baseline):
    """An engine made later on the same target (a target-only baseline) captures no features; the
    feature drafter's engine still gets them at its next step, and drafts as if alone."""
    alone = eagle_engine(*planted, gamma=3)
    alone.generate(PROMPTS, GREEDY)
    shared = eagle_engine(*planted, gamma=3)
    assert [r.token_ids for r in Engine(planted[0]).generate(PROMPTS, GREEDY)] == baseline
    assert [r.token_ids for r in shared.generate(PROMPTS, GREEDY)] == baseline
    assert shared.last_run_stats.accepted_by_position == alone.last_run_stats.accepted_by_position
    assert shared.last_run_stats.accepted > 0
