"""Measure the shipped pair and write its model cards (README.md in each folder).

    python recipes/evaluate_pair.py [--pair specengine/pretrained] [--prompts 16]

Measures, on this machine: held-out loss (from training), the acceptance rate alpha of the
pair at gamma=4, temperature 0 and 1, on prompts cut from held-out files; c = draft step time /
target step time (one-token decode steps, median); and a few sample completions. Also writes
bench/results/pair-<date>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from specengine import Engine, SamplingParams
from specengine.shipped import heldout_prompts

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef ", "class Stack:\n    def __init__(self):"]


def step_time(model, reps: int = 30) -> float:
    """Median seconds of a one-token decode step at position 64 (batch 1)."""
    cache = model.new_cache(1, 128)
    cache.lengths.fill_(64)
    token = torch.tensor([[5]])
    times = []
    with torch.inference_mode():
        for _ in range(reps + 3):
            t0 = time.perf_counter()
            model.logits(model(token, cache.lengths.clone(), cache)[:, -1])
            times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default=str(ROOT / "specengine" / "pretrained"))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    pair = Path(args.pair)
    target_dir, draft_dir = pair / "pycode-target", pair / "pycode-draft"
    engine = Engine.from_pretrained(target_dir, draft_dir, gamma=4)
    prompts = heldout_prompts(engine.tokenizer, args.prompts, length=48, start_fraction=0.5)

    alpha = {}
    for temperature in (0.0, 1.0):
        params = [SamplingParams(max_new_tokens=args.new_tokens, temperature=temperature, seed=i, ignore_eos=True)
                  for i in range(len(prompts))]
        engine.generate(prompts, params)
        s = engine.last_run_stats
        alpha[f"T={temperature:g}"] = dict(alpha=s.acceptance_rate, tokens_per_target_call=s.tokens_per_round,
                                          accepted_histogram=s.accepted_histogram)
        print(f"T={temperature:g}: alpha {s.acceptance_rate:.3f}, {s.tokens_per_round:.2f} tokens per target call")

    target_step, draft_step = step_time(engine.target), step_time(engine.drafter.model)
    c = draft_step / target_step
    print(f"step times: target {target_step * 1e3:.2f} ms, draft {draft_step * 1e3:.2f} ms, c = {c:.3f}")
    samples = {}
    greedy = SamplingParams(max_new_tokens=48, temperature=0, stop=("\n\n\n",))
    for prompt in SAMPLE_PROMPTS:
        samples[prompt] = engine.generate([prompt], greedy)[0].text

    machine = f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    date = datetime.date.today().isoformat()
    result = dict(date=date, machine=machine, torch=torch.__version__, gamma=4, prompts=len(prompts),
                  new_tokens=args.new_tokens, alpha=alpha, target_step_ms=target_step * 1e3,
                  draft_step_ms=draft_step * 1e3, c=c, samples=samples)
    for folder in (target_dir, draft_dir):
        result[folder.name] = json.loads((folder / "training.json").read_text())
    out = ROOT / "bench" / "results" / f"pair-{date}.json"
    out.write_text(json.dumps(result, indent=2))
    for folder in (target_dir, draft_dir):
        (folder / "README.md").write_text(model_card(folder.name, result))
    print(f"wrote {out} and the model cards")


def model_card(name: str, r: dict) -> str:
    me = r[name]
    other = r["pycode-draft" if name == "pycode-target" else "pycode-target"]
    role = ("the target of specengine's shipped pair" if name == "pycode-target"
            else "the draft of specengine's shipped pair (trained half by distillation from pycode-target)")
    samples = "\n\n".join(f"```python\n{p}{t}\n```" for p, t in r["samples"].items())
    distillation = ""
    comparison = sorted((ROOT / "bench" / "results").glob("draft-loss-*.json"))
    if name == "pycode-draft" and comparison:  # written by recipes/compare_draft_losses.py
        c = json.loads(comparison[-1].read_text())
        rows = "".join(f"| {k} | {v['train_tokens']:,} | {v['heldout_loss']:.3f} | {v['T=0']['alpha']:.3f} | "
                       f"{v['T=1']['alpha']:.3f} |\n" for k, v in c["drafts"].items())
        distillation = f"""
## Why distillation ({c['date']}, {c['machine']}, `recipes/compare_draft_losses.py`)

Same architecture, data stream and training time; alpha at gamma {c['gamma']} against pycode-target:

| draft loss | training tokens | held-out loss | alpha T=0 | alpha T=1 |
| --- | --- | --- | --- | --- |
{rows}"""
    return f"""# {name}

> This pair is no longer specengine's default (that is SmolLM2-135M-Instruct with smollm2-draft, see
> the README); it stays in the package for the tests, which need a fast pair with a known held-out split.

A small Llama-architecture Python-code completion model: {role}. Both share one byte-level BPE
tokenizer (8192 tokens, `<|endoftext|>` between files). Trained from scratch by
`recipes/train_pair.py`; measured by `recipes/evaluate_pair.py`.

| | {name} | {other['kind']} |
| --- | --- | --- |
| parameters | {me['parameters']:,} | {other['parameters']:,} |
| training tokens | {me['train_tokens']:,} | {other['train_tokens']:,} |
| training time | {me['train_seconds'] / 60:.0f} min on {me['machine']} | {other['train_seconds'] / 60:.0f} min |
| held-out loss (nats/token) | {me['heldout_loss']:.3f} | {other['heldout_loss']:.3f} |
| held-out perplexity | {me['heldout_perplexity']:.1f} | {other['heldout_perplexity']:.1f} |

Data: the Python standard library of the interpreter that trained it (CPython {platform.python_version()}),
split by file (about 6% of files held out). Trained on {me['date']} with torch {me['torch']}.

**Small and under-trained**: the training budget on a 2-core CPU was minutes, not days; expect
plausible-looking but often wrong Python. It exists so that speculative decoding can be measured
on a real pair with real (if modest) agreement.

## Speculative decoding with this pair (measured {r['date']}, {r['machine']})

gamma = {r['gamma']}, {r['prompts']} prompts of 48 tokens cut from held-out files, {r['new_tokens']} new tokens each:

| temperature | acceptance rate alpha | tokens per target call |
| --- | --- | --- |
""" + "".join(f"| {k[2:]} | {v['alpha']:.3f} | {v['tokens_per_target_call']:.2f} |\n" for k, v in r["alpha"].items()) + f"""
One-token decode step (batch 1, float32 compute on the bfloat16 weights): target {r['target_step_ms']:.2f} ms, draft {r['draft_step_ms']:.2f} ms,
so c = {r['c']:.3f}.
{distillation}
## Samples (greedy, specengine with gamma 4)

{samples}
"""


if __name__ == "__main__":
    main()
