"""Greedy speculative decoding is token-identical to target-only greedy decoding."""
import pytest
import torch

from specengine import Engine, SamplingParams
from specengine.drafters.model import ModelDrafter
from specengine.drafters.ngram import NgramDrafter

from bounds import Float64Llama, assert_greedy_tokens_agree
from engine_util import assert_kernels_ran, device_head_dims, greedy_fixtures, tiny_model

V = 48
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [4], [9, 9, 9, 9, 9]]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0)
target, baseline = greedy_fixtures(V, PROMPTS, GREEDY)


def drafter_for(kind, target):
    if kind == "self":  # the target drafting for itself: every draft is accepted
        return ModelDrafter(target, V, V)
    if kind == "unrelated":  # a different random model: almost nothing is accepted
        return ModelDrafter(tiny_model(V, seed=7, num_layers=1, hidden_size=16), V, V)
    return NgramDrafter(1, 3)


def test_target_only_greedy_equals_transformers_generate(tmp_path):
    from transformers import AutoModelForCausalLM

    from specengine.models import load_model
    from specengine.devtools.tiny import make_config, save_random_checkpoint

    save_random_checkpoint(tmp_path, make_config(vocab_size=V, eos_token_id=None), init_std=0.3)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ours = Engine(load_model(tmp_path))
    exact = Float64Llama.from_transformers(hf)
    for prompt in PROMPTS:
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                          pad_token_id=0)
        (result,) = ours.generate([prompt], SamplingParams(max_new_tokens=16, temperature=0))
        # two float32 computations: the same tokens up to a near tie of the exact logits (tests/bounds.py)
        assert_greedy_tokens_agree(result.token_ids, out[0, len(prompt):].tolist(), exact, prompt, 4)


@pytest.mark.parametrize("kind", ["self", "unrelated", "ngram"])
@pytest.mark.parametrize("gamma", range(1, 9))
@pytest.mark.parametrize("impl", ["reference", "cpp"])
def test_speculative_greedy_equals_target_only(kind, gamma, impl, target, baseline):
    engine = Engine(target, drafter=drafter_for(kind, target), gamma=gamma, verify_impl=impl)
    results = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == baseline
    stats = engine.last_run_stats
    assert stats.generated_tokens == sum(len(t) for t in baseline)
    assert sum(stats.accepted_histogram) == stats.rounds
    assert stats.accepted == sum(i * n for i, n in enumerate(stats.accepted_histogram))
    if kind == "self":
        assert stats.acceptance_rate == 1.0
        assert stats.rounds == sum(-(-24 // (gamma + 1)) for _ in PROMPTS)
    if kind == "unrelated":
        assert stats.acceptance_rate < 0.5


def test_each_prompt_alone_equals_it_in_a_ragged_batch(target, baseline):
    engine = Engine(target, drafter=drafter_for("unrelated", target), gamma=3)
    for prompt, expected in zip(PROMPTS, baseline):
        assert engine.generate([prompt], GREEDY)[0].token_ids == expected


def test_mixed_lengths_and_limits_in_one_batch(target):
    """Rows with different max_new_tokens finish at different rounds; the rest go on unchanged."""
    params = [SamplingParams(max_new_tokens=n, temperature=0) for n in (3, 24, 1, 11)]
    alone = [Engine(target).generate([p], q)[0].token_ids for p, q in zip(PROMPTS, params)]
    engine = Engine(target, drafter=drafter_for("self", target), gamma=5)
    results = engine.generate(PROMPTS, params)
    assert [r.token_ids for r in results] == alone
    assert [len(r.token_ids) for r in results] == [3, 24, 1, 11]
    assert all(r.finish_reason == "length" for r in results)


@pytest.mark.parametrize("device, head_dim", device_head_dims())
def test_greedy_on_the_device_equals_cpu_target_only(device, head_dim):
    """The whole loop on CUDA (compiled step kernels, Triton verify) gives the CPU's target-only
    greedy tokens, with every drafter; on a CPU the same loop on the CPU path."""
    target = tiny_model(V, seed=0, logit_scale=3.0, head_dim=head_dim)
    baseline = [r.token_ids for r in Engine(target).generate(PROMPTS, GREEDY)]
    exact = Float64Llama.from_specengine(target)
    target = target.to(device)
    for drafter in (None, ModelDrafter(target, V, V), NgramDrafter(1, 3)):
        engine = Engine(target, drafter=drafter, gamma=4)
        results = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
        if device == "cpu":  # the same arithmetic: bit for bit
            assert results == baseline
        for prompt, got, want in zip(PROMPTS, results, baseline):  # on CUDA, up to a near tie (tests/bounds.py)
            assert_greedy_tokens_agree(got, want, exact, prompt, 4)
    assert_kernels_ran(target)
