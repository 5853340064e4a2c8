"""The trained pycode pair that ships inside the package."""
import json

import pytest
import torch

from specengine import _C
from specengine.models import load_model
from specengine.shipped import DRAFT_DIR, TARGET_DIR, heldout_texts, shipped_pair
from specengine.tokenizer import check_same_vocabulary, load_tokenizer
from bounds import AMX_TERMS, Float64Llama


def test_the_pair_is_installed_with_the_package():
    assert shipped_pair() == (TARGET_DIR, DRAFT_DIR)
    for folder in (TARGET_DIR, DRAFT_DIR):
        for name in ("config.json", "generation_config.json", "tokenizer.json", "README.md", "training.json"):
            assert (folder / name).is_file(), f"{folder.name}/{name}"
        shards = list(folder.glob("*.safetensors"))
        assert shards and all(s.stat().st_size <= 16 * 2**20 for s in shards)


@pytest.mark.parametrize("folder", [TARGET_DIR, DRAFT_DIR], ids=["target", "draft"])
def test_ours_and_transformers_give_the_same_logits_on_heldout_text(folder):
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(folder)
    ids = torch.tensor([tokenizer(heldout_texts(1)[0])["input_ids"][:96]])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_model(folder, dtype="float32")
    # Both float32 forwards within the float32 bound of the exact logits of these weights
    # (tests/bounds.py), whatever order this CPU's sums take. Ours keeps the checkpoint's bfloat16
    # matrices, whose prompt-sized products AMX tiles sum with x in three bfloat16 terms.
    reference = Float64Llama.from_transformers(hf)
    tokens = ids[0].tolist()
    with torch.no_grad():
        reference.logits(tokens).check(hf(ids).logits[0], "transformers")
        got = ours.logits(ours(ids, torch.zeros(1, dtype=torch.int64), ours.new_cache(1, 128)))[0]
    reference.logits(tokens, AMX_TERMS if _C.cpu_isa() == "amx" else 1).check(got, "ours")


def test_tokenizer_round_trips_heldout_files_and_is_shared():
    tokenizer = load_tokenizer(TARGET_DIR)
    check_same_vocabulary(tokenizer, load_tokenizer(DRAFT_DIR), TARGET_DIR, DRAFT_DIR)
    assert len(tokenizer) == 8192 and tokenizer.eos_token == "<|endoftext|>"
    for text in heldout_texts():
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_models_beat_a_unigram_model_of_the_heldout_files():
    """Held-out loss below the entropy of the held-out files' own token frequencies: the best any
    unigram model could do there (an optimistic baseline computed here, not a fixed number)."""
    tokenizer = load_tokenizer(TARGET_DIR)
    ids = torch.tensor([t for text in heldout_texts() for t in tokenizer(text)["input_ids"]])
    freq = torch.bincount(ids, minlength=len(tokenizer)).double() / len(ids)
    unigram_loss = float(-(freq[freq > 0] * freq[freq > 0].log()).sum())
    target = json.loads((TARGET_DIR / "training.json").read_text())
    draft = json.loads((DRAFT_DIR / "training.json").read_text())
    assert target["parameters"] > 5 * draft["parameters"]
    assert target["heldout_loss"] < draft["heldout_loss"] < unigram_loss
