"""recipes/train_smollm2_draft.py in miniature: one command that teaches, trains, exports, and
resumes where it stopped; the draft it writes loads as a draft of the default target and keeps
greedy decoding token-identical to target-only."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from specengine import Engine, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
# Seconds of teaching and training (a few teacher batches, a few steps), short answers and prompts,
# a few held-out prompts.
TINY = ["--teach-minutes", "0.05", "--train-minutes", "0.05", "--teach-batch", "4", "--max-new", "8",
        "--max-prompt", "64", "--heldout-prompts", "4", "--batch-tokens", "512", "--output-vocab", "512", "--device", "cpu"]


def run_recipe(work: Path, out: Path, target: Path) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "recipes" / "train_smollm2_draft.py"), "--work", str(work),
                           "--out", str(out), "--target", str(target), *TINY],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def target(session_cache):
    from specengine.shipped import default_target

    return default_target()


def test_the_recipe_trains_resumes_and_exports_a_lossless_draft(target, tmp_path):
    work, out = tmp_path / "work", tmp_path / "draft"
    first = run_recipe(work, out, target)
    assert "teach:" in first and f"wrote {out}" in first
    taught = json.loads((work / "teach_state.json").read_text())
    shards = sorted(p.name for p in work.glob("teach-*.npz"))
    assert taught["tokens"] > 0 and shards
    meta = json.loads((out / "training.json").read_text())
    assert meta["teacher_tokens"] == taught["tokens"] and meta["output_vocab"] == 512
    assert json.loads((out / "config.json").read_text())["output_vocab_size"] == 512

    # Run again: the budgets are spent, so nothing is taught or trained twice.
    second = run_recipe(work, tmp_path / "again", target)
    assert "teach:" not in second
    assert json.loads((work / "teach_state.json").read_text()) == taught
    assert sorted(p.name for p in work.glob("teach-*.npz")) == shards
    assert json.loads((tmp_path / "again" / "training.json").read_text())["train_steps"] == meta["train_steps"]

    speculative = Engine.from_pretrained(target, out, gamma=3)
    plain = Engine.from_pretrained(target)
    prompt = plain.chat_prompt([{"role": "user", "content": "Write a Python function that adds two numbers."}])
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    (want,) = plain.generate([prompt], params)
    (got,) = speculative.generate([prompt], params)
    assert got.token_ids == want.token_ids
    assert got.stats.drafted > 0  # the draft proposed (a few training steps need not agree often)
