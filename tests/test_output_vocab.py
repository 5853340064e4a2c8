"""A head over only some token ids (config output_vocab_size, checkpoint lm_head.token_ids): the
draft's cheap head. Its logits are the full head's at those ids and -inf elsewhere; as a draft
it keeps speculative sampling exact (q = 0 outside its ids) and greedy output the target's."""
import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specengine import Engine, SamplingParams
from specengine.drafters.model import ModelDrafter
from specengine.models import CheckpointError, ConfigError, LlamaForCausalLM, load_model

from bounds import Float64Llama
from engine_util import tiny_model
from stats_util import V, chi_square_pvalue, exact_distribution, sample_counts

IDS = [4, 0, 2]  # any order: the head's rows score these ids


def restricted(model: LlamaForCausalLM, ids) -> LlamaForCausalLM:
    cfg = dataclasses.replace(model.config, output_vocab_size=len(ids), tie_word_embeddings=False)
    out = LlamaForCausalLM(cfg)
    state = dict(model.state_dict())
    state["lm_head.weight"] = model.lm_head.weight[torch.tensor(ids)]
    state["output_token_ids"] = torch.tensor(ids)
    out.load_state_dict(state)
    return out.eval().requires_grad_(False)


def head_folder(source, tmp_path, ids, tied: bool):
    """A copy of a checkpoint folder whose head covers only `ids`."""
    folder = tmp_path / "restricted"
    shutil.copytree(source, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(output_vocab_size=len(ids), tie_word_embeddings=tied)
    (folder / "config.json").write_text(json.dumps(cfg))
    weights = load_file(folder / "model.safetensors")
    full_head = weights.pop("lm_head.weight", weights["model.embed_tokens.weight"])
    if not tied:
        weights["lm_head.weight"] = full_head[torch.tensor(ids).clamp(max=len(full_head) - 1)].contiguous()
    weights["lm_head.token_ids"] = torch.tensor(ids, dtype=torch.int64)
    save_file(weights, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("case, tied", [("llama-tied-bias", True), ("llama3-rope-gqa", False)])
def test_logits_are_the_full_heads_at_its_ids_and_minus_inf_elsewhere(checkpoint, tmp_path, case, tied):
    full = load_model(checkpoint(case))
    ids = [96, 3, 50, 7, 0]
    part = load_model(head_folder(checkpoint(case), tmp_path, ids, tied))
    assert part.lm_head.weight.shape == (len(ids), full.config.hidden_size)
    tokens = torch.tensor([[5, 9, 14, 2, 77]])
    with torch.inference_mode():
        a = full.logits(full(tokens, torch.zeros(1, dtype=torch.long), full.new_cache(1, 8)))
        b = part.logits(part(tokens, torch.zeros(1, dtype=torch.long), part.new_cache(1, 8)))
    assert b.shape == a.shape
    # Both float32 forwards of the same weights: within the float32 bound of the exact logits.
    exact = Float64Llama.from_specengine(full).logits(tokens[0].tolist())[:, ids]
    exact.check(a[0, :, ids], "full head")
    exact.check(b[0, :, ids], "head of the ids")
    others = torch.ones(a.shape[-1], dtype=torch.bool)
    others[ids] = False
    assert torch.isneginf(b[..., others]).all()


@pytest.mark.parametrize("ids, match", [([3, 3, 5], "distinct ids"), ([1, 2, 97], r"distinct ids in \[0, 97\)")])
def test_bad_token_ids_are_refused(checkpoint, tmp_path, ids, match):
    with pytest.raises(CheckpointError, match=f"lm_head.token_ids must be 3 {match}"):
        load_model(head_folder(checkpoint("llama3-rope-gqa"), tmp_path, ids, tied=False))


def test_output_vocab_size_is_validated(checkpoint, tmp_path):
    folder = head_folder(checkpoint("llama3-rope-gqa"), tmp_path, [1, 2], tied=False)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "output_vocab_size": 98}))
    with pytest.raises(ConfigError, match=r"output_vocab_size must be in \[1, vocab_size=97\], got 98"):
        load_model(folder)


@pytest.fixture(scope="module")
def target():
    return tiny_model(V, seed=0, hidden_size=16, logit_scale=4.0)


@pytest.fixture(scope="module")
def draft():
    return restricted(tiny_model(V, seed=3, num_layers=1, hidden_size=16, logit_scale=4.0), IDS)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["reference", "cpp"])
def test_a_draft_with_a_partial_head_keeps_the_exact_distribution(target, draft, impl):
    params = SamplingParams(temperature=1.0)
    engine = Engine(target, drafter=ModelDrafter(draft, V, V), gamma=3, verify_impl=impl)
    counts = sample_counts(engine, params, 12_000)
    expected = exact_distribution(target, params)
    assert chi_square_pvalue(counts, expected) > 1e-3
    # Tokens the draft can never propose still come out, as often as the target says.
    outside = torch.tensor([any(t not in IDS for t in (i // V ** 2, i // V % V, i % V)) for i in range(V ** 3)])
    assert counts[outside].sum() > 0.2 * counts.sum() and 0.05 < engine.last_run_stats.acceptance_rate < 0.95


def test_greedy_with_a_partial_head_draft_equals_target_only(target, draft):
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    (base,) = Engine(target).generate([[1, 2, 1]], params)
    for gamma in (1, 4, 8):
        (spec,) = Engine(target, drafter=ModelDrafter(draft, V, V), gamma=gamma).generate([[1, 2, 1]], params)
        assert spec.token_ids == base.token_ids
