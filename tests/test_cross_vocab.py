"""A draft with a tokenizer of its own (drafters.vocab_map, drafters.cross_vocab): byte-level BPE and
SentencePiece spellings read as one text, added tokens matched by content, every target token's
draft form spelling its text; in the engine: with one vocabulary it drafts exactly as the model
drafter, greedy output equals target-only with a permuted, partly shared vocabulary (fixed and auto
gamma, joins, a draft context that outgrows the draft), the exact sampling distribution (chi-square);
from checkpoint folders: the pair is mapped, and a pair sharing too little is refused."""
import pytest
import torch

from specengine import Engine, SamplingParams
from specengine.drafters.cross_vocab import CrossVocabDrafter
from specengine.drafters.model import ModelDrafter
from specengine.drafters.vocab_map import (VocabMap, VocabularyShareError, spelling, token_keys, token_text)
from specengine.engine.gamma import CostModel
from specengine.models import LlamaForCausalLM

from engine_util import tiny_model
from stats_util import chi_square_pvalue

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


def metaspace_tokenizer(vocab_size: int, texts=None):
    """A SentencePiece-style BPE tokenizer ('▁' for a space), trained on `texts` (default: the
    standard library's slice that train_tokenizer uses), with an unknown and an end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from specengine.devtools.tiny import EOS_TOKEN, stdlib_text

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", EOS_TOKEN], show_progress=False)
    tok.train_from_iterator(texts if texts is not None else [stdlib_text()], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, unk_token="<unk>")


@pytest.fixture(scope="module")
def sentencepiece():
    return metaspace_tokenizer(400)


# ---- the vocabulary map

def test_spellings_read_as_bytes():
    assert token_text("ĠĠreturn", "byte-level") == b"  return" and token_text("Ċ", "byte-level") == b"\n"
    assert token_text("Ã©", "byte-level") == "é".encode()  # two bytes, one character
    assert token_text("▁return", "sentencepiece") == b" return" and token_text("<0x0A>", "sentencepiece") == b"\n"
    assert token_text("<0x0A>", "plain") == b"<0x0A>"


def test_byte_level_and_sentencepiece_tokens_of_one_text_are_shared(tokenizer, sentencepiece):
    assert spelling(tokenizer) == "byte-level" and spelling(sentencepiece) == "sentencepiece"
    vocab = VocabMap.from_tokenizers(tokenizer, sentencepiece)
    shared = dict(zip(vocab.target_ids.tolist(), vocab.draft_ids.tolist()))
    # Every word-initial byte-level token whose '▁' form the other has is shared with it.
    sp = sentencepiece.get_vocab()
    pairs = [(i, sp["▁" + t[1:]]) for t, i in tokenizer.get_vocab().items()
             if t.startswith("Ġ") and len(t) > 1 and t[1:].isalpha() and "▁" + t[1:] in sp]
    assert len(pairs) >= 5 and all(shared.get(i) == d for i, d in pairs)
    # Added tokens by content, at their own ids.
    assert shared[tokenizer.eos_token_id] == sentencepiece.eos_token_id
    assert sentencepiece.unk_token_id not in shared.values()
    assert vocab.num_shared == len(set(vocab.draft_ids.tolist())) and 0.5 < vocab.share <= 1.0


def text_of(key) -> bytes:
    return key if isinstance(key, bytes) else key[1].encode()  # an added token's: its content


def test_draft_forms_spell_each_target_tokens_text_once(tokenizer, sentencepiece):
    for target, draft in ((tokenizer, sentencepiece), (sentencepiece, tokenizer)):
        vocab = VocabMap.from_tokenizers(target, draft)
        calls = []
        spell = vocab.spell
        vocab.spell = lambda t: calls.append(t) or spell(t)
        target_keys, draft_keys = token_keys(target), token_keys(draft)
        # Bytes the draft has one-byte tokens for (the SentencePiece tokenizer has no byte fallback).
        alphabet = {k for k in draft_keys.values() if isinstance(k, bytes) and len(k) == 1}
        checked = 0
        for t, key in target_keys.items():
            text = text_of(key)
            if not all(bytes([b]) in alphabet for b in text):
                continue
            form = vocab.draft_form(t)
            assert b"".join(text_of(draft_keys[d]) for d in form) == text, (t, key, form)
            assert vocab.draft_form(t) is form  # kept
            checked += 1
        # Spelled once each, and only the tokens the draft lacks.
        assert checked > 50 and calls and len(calls) == len(set(calls))
        assert all(vocab.to_draft[t] < 0 for t in calls)


@pytest.mark.parametrize("args, match", [
    (dict(target_ids=[0, 1], draft_ids=[0]), "as many draft ids as target ids"),
    (dict(target_ids=[], draft_ids=[]), "at least one"),
    (dict(target_ids=[0, 0], draft_ids=[0, 1]), r"shared target ids must be 2 distinct ids in \[0, 5\)"),
    (dict(target_ids=[0, 5], draft_ids=[0, 1]), r"shared target ids must be 2 distinct ids in \[0, 5\)"),
    (dict(target_ids=[0, 1], draft_ids=[-1, 1]), r"shared draft ids must be 2 distinct ids in \[0, 4\)"),
])
def test_bad_maps_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        VocabMap(5, 4, **args)


# ---- in the engine, on in-memory models

VT, VD = 16, 12
SHARED_T = [5, 0, 9, 3, 12, 7, 1, 14, 10]     # target ids, and the draft ids of the same tokens:
SHARED_D = [2, 11, 0, 7, 4, 9, 1, 6, 3]       # another order, and draft ids 5, 8, 10 the target lacks
FORMS = {2: (5, 8), 4: (10,), 6: (8, 8, 5), 8: (), 11: (0, 5), 13: (10, 2), 15: (4,)}  # unshared target ids


def permuted_map() -> VocabMap:
    return VocabMap(VT, VD, SHARED_T, SHARED_D, lambda t: FORMS[t])


def translated_draft(target: LlamaForCausalLM, max_positions: int | None = None) -> LlamaForCausalLM:
    """The target's weights in the draft's vocabulary: a shared token's embedding and head rows at
    its draft id, random rows for the draft's own tokens. On contexts of shared tokens it predicts
    as the target (restricted to them); around unshared tokens it does not."""
    draft = tiny_model(VD, seed=5, hidden_size=target.config.hidden_size, num_layers=target.config.num_layers,
                       max_positions=max_positions or target.config.max_position_embeddings)
    state = dict(target.state_dict())
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = draft.state_dict()[name].clone()
        rows[torch.tensor(SHARED_D)] = state[name][torch.tensor(SHARED_T)]
        state[name] = rows
    draft.load_state_dict(state)
    return draft


@pytest.fixture(scope="module")
def target():
    return tiny_model(VT, seed=0, hidden_size=32, logit_scale=4.0)


@pytest.fixture(scope="module")
def baseline(target):
    return Engine(target)


PROMPTS = [[5, 0, 9], [2, 4, 6, 8, 11, 13, 15, 3], [1], [7, 8, 8, 12, 14, 10, 0, 5, 9, 3, 1]]


def test_with_one_vocabulary_it_drafts_as_the_model_drafter(target):
    """An identity map: the same drafts, tokens and statistics as ModelDrafter, greedy and sampled,
    in a ragged batch (its own catch-up and rollback against the cache lengths verification clips)."""
    draft = tiny_model(VT, seed=3, num_layers=1, hidden_size=32, logit_scale=4.0)
    identity = VocabMap(VT, VT, torch.arange(VT), torch.arange(VT))
    params = [GREEDY, SamplingParams(max_new_tokens=30, temperature=1.0, seed=1),
              SamplingParams(max_new_tokens=17, temperature=0.8, top_k=4, seed=2), GREEDY]
    runs = [Engine(target, drafter=d, gamma=3).generate(PROMPTS, params)
            for d in (ModelDrafter(draft, VT, VT), CrossVocabDrafter(draft, identity))]
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids
        for name in ("rounds", "draft_calls", "drafted", "accepted", "accepted_histogram", "accepted_by_position"):
            assert getattr(a.stats, name) == getattr(b.stats, name), name


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_equals_target_only_with_a_permuted_partly_shared_vocabulary(target, baseline, gamma):
    want = [r.token_ids for r in baseline.generate(PROMPTS, GREEDY)]
    engine = Engine(target, drafter=CrossVocabDrafter(translated_draft(target), permuted_map()), gamma=gamma)
    results = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == want
    stats = engine.last_run_stats
    assert 0 < stats.accepted < stats.drafted  # drafts were tested: some accepted, some rejected
    assert any(t not in SHARED_T for r in results for t in r.token_ids)  # unshared tokens came out too


def test_greedy_with_auto_gamma_joins_and_fixed_shape_steps(target, baseline):
    costs = {b: CostModel(0.1, tuple(1.0 + 0.05 * k for k in range(9))) for b in (1, 8)}
    want = [r.token_ids for r in baseline.generate(PROMPTS, GREEDY)]
    engine = Engine(target, drafter=CrossVocabDrafter(translated_draft(target), permuted_map()), gamma="auto",
                    costs=costs, cuda_graphs=True, max_batch_size=2)  # on a CPU the fixed-shape steps run eagerly
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    got: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests() or engine.has_pending_outputs():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
        if steps == 3:  # two more join mid-run (one waits for a free row)
            ids += [engine.add_request(p, GREEDY) for p in PROMPTS[2:]]
    assert [got[i] for i in ids] == want


def test_a_draft_context_past_the_drafts_positions_goes_on_target_only(target, baseline):
    short = translated_draft(target, max_positions=20)  # as if trained on 20 positions
    prompt = [2, 6, 3, 5]  # 2 + 3 + 1 + 1 draft ids: the draft context outgrows 20 within the request
    (want,) = baseline.generate([prompt], SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True))
    engine = Engine(target, drafter=CrossVocabDrafter(short, permuted_map()), gamma=4)
    (got,) = engine.generate([prompt], SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True))
    assert got.token_ids == want.token_ids
    assert 0 < got.stats.drafted and got.stats.drafted_by_position[0] < got.stats.rounds  # it stopped drafting
    assert engine.drafter.rows == [] and engine.drafter.cache.capacity <= 64


def test_encoder_decoder_targets_are_refused(target):
    with pytest.raises(ValueError, match="does not pair with an encoder-decoder target"):
        CrossVocabDrafter(translated_draft(target), permuted_map()).join_rows([[1]], 8, sources=[[1, 2]])


@pytest.mark.slow
@pytest.mark.parametrize("case, impl", [("T=1", "cpp"), ("T=0.7,top_k=3", "reference"), ("top_p=0.8", "cpp")])
def test_sampling_matches_exact_target_distribution(case, impl):
    """test_engine_sampling's chi-square check, with a draft of 6 tokens in another order sharing 3
    of the target's 5: the other two reach the output only through the residual."""
    from stats_util import CASES, PROMPT, V, exact_distribution, sample_counts

    target = tiny_model(V, seed=0, hidden_size=16, logit_scale=4.0)
    draft = tiny_model(6, seed=3, num_layers=1, hidden_size=16, logit_scale=4.0)
    vocab = VocabMap(V, 6, [3, 0, 4], [1, 5, 2], {1: (0, 3), 2: (4, 4)}.__getitem__)
    engine = Engine(target, drafter=CrossVocabDrafter(draft, vocab), gamma=3, verify_impl=impl)
    assert PROMPT == [1, 2, 1]  # unshared tokens only: the draft reads their forms
    counts = sample_counts(engine, CASES[case], 12_000)
    assert chi_square_pvalue(counts, exact_distribution(target, CASES[case])) > 1e-3
    assert 0.05 < engine.last_run_stats.acceptance_rate < 0.95
    unshared = torch.tensor([any(t in (1, 2) for t in (i // V ** 2, i // V % V, i % V)) for i in range(V ** 3)])
    assert counts[unshared].sum() > 0.1 * counts.sum()


@pytest.mark.slow
def test_the_distribution_test_sees_a_q_other_than_the_drafts(monkeypatch):
    """A drafter that reports q with its shared tokens' target ids in the wrong order (the drafts
    themselves sampled right) is not exact, and the same check sees it."""
    from stats_util import CASES, V, exact_distribution, sample_counts

    target = tiny_model(V, seed=0, hidden_size=16, logit_scale=4.0)
    draft = tiny_model(6, seed=3, num_layers=1, hidden_size=16, logit_scale=4.0)
    drafter = CrossVocabDrafter(draft, VocabMap(V, 6, [3, 0, 4], [1, 5, 2], {1: (0, 3), 2: (4, 4)}.__getitem__))
    propose = drafter.propose

    def wrong_q(*args):
        proposal = propose(*args)
        proposal.logits = proposal.logits[..., [4, 1, 2, 0, 3]]  # ids 0, 3, 4 swap their logits
        return proposal

    monkeypatch.setattr(drafter, "propose", wrong_q)
    counts = sample_counts(Engine(target, drafter=drafter, gamma=3), CASES["T=1"], 6_000)
    assert chi_square_pvalue(counts, exact_distribution(target, CASES["T=1"])) < 1e-6


# ---- from checkpoint folders

def draft_folder(tmp_path, tokenizer, name="draft"):
    from specengine.devtools.tiny import make_config, save_random_checkpoint

    config = make_config(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                         eos_token_id=tokenizer.eos_token_id)
    save_random_checkpoint(tmp_path / name, config, tokenizer, seed=1, init_std=0.3)
    return tmp_path / name


def test_from_pretrained_maps_a_draft_with_another_tokenizer(text_pair, sentencepiece, tmp_path):
    target, _ = text_pair
    engine = Engine.from_pretrained(target, draft_folder(tmp_path, sentencepiece), gamma=3)
    assert isinstance(engine.drafter, CrossVocabDrafter) and engine.drafter.vocab.share > 0.5
    prompts = ["def add(a, b):\n    return", "The quick brown fox"]
    want = [r.token_ids for r in Engine.from_pretrained(target).generate(prompts, GREEDY)]
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == want
    assert engine.last_run_stats.drafted > 0


def test_a_draft_sharing_too_few_tokens_is_refused(text_pair, tmp_path):
    target, _ = text_pair
    digits = draft_folder(tmp_path, metaspace_tokenizer(60, ["0123456789 " * 50, "31 41 59 26 53 58 97"]))
    with pytest.raises(VocabularyShareError, match=rf"the draft {digits} shares too few tokens with the target "
                                                   rf"{target}: \d+% of the target's tokens in a sample text"):
        Engine.from_pretrained(target, digits)
