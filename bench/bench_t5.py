"""T5 encoder-decoder decoding: specengine against Hugging Face `generate` and assisted generation.

No pretrained T5 is installable offline, so both models have random weights at T5's shapes
(original T5: ReLU, tied head), stored in bfloat16, with a byte-level BPE tokenizer over the
standard library:
  - T5-base-like target (d_model 768, 12 + 12 blocks, 12 heads, d_ff 3072);
  - T5-small-like draft (d_model 512, 6 + 6 blocks, 8 heads, d_ff 2048);
both with T5's 32128-token vocabulary. Random models agree on few greedy tokens, so alpha here
says nothing of trained T5s: the paper's own c (T5-small for T5-XXL, Table 4) is printed beside.

Two parts, each configuration interleaved with the others and the median of the repeats kept:
1. `specengine bench` on the pair (specengine.devtools.benchmark): HF generate alone and assisted, the
   eager loop, specengine target-only, with the draft at each gamma and "auto", and n-gram lookup
   in the encoder input.
2. The loop's own cost, on the same T5-base-like target, batch 1, greedy:
   - target-only;
   - the same model as its own draft at gamma 4: every draft accepted, but a draft step costs a
     target step (c = 1), so Theorem 3.8 predicts (g + 1) / (g + 1) = 1x at best;
   - an oracle drafter at gamma 4: the target's own greedy continuation, recorded beforehand,
     drafted at no cost (q one-hot): every draft accepted with c = 0, so the speedup is what the
     loop makes of verifying 5 tokens per target call, its overhead included.

Writes e2e-t5-<date>.csv and -runs.json (part 1) and t5-loop-<date>.json (part 2) into --out-dir.

    python bench/bench_t5.py --out-dir bench/results [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from specengine import Engine, SamplingParams
from specengine.devtools.benchmark import BenchOptions, hf_decode, machine_name, run_benchmark
from specengine.devtools.tiny import make_t5_config, save_random_t5_checkpoint, train_tokenizer
from specengine.drafters.base import Drafter, Proposal
from specengine.drafters.model import ModelDrafter
from specengine.shipped import heldout_prompts

SHAPES = {
    "t5-small-like": dict(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8),
    "t5-base-like": dict(d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12),
}


def make_pair(work: Path) -> dict[str, Path]:
    """The two random checkpoints (made once under `work`)."""
    folders = {name: work / name for name in SHAPES}
    if all((f / "model.safetensors").is_file() for f in folders.values()):
        return folders
    tokenizer = train_tokenizer(vocab_size=8000)
    for seed, (name, shape) in enumerate(SHAPES.items()):
        config = make_t5_config(vocab_size=32128, feed_forward_proj="relu", tie_word_embeddings=True,
                                eos_token_id=tokenizer.eos_token_id, **shape)
        save_random_t5_checkpoint(folders[name], config, tokenizer, seed=seed, dtype=torch.bfloat16)
    return folders


class OracleDrafter(Drafter):
    """Drafts each row's recorded continuation (the target's greedy output for its encoder input):
    q is one-hot and no model runs, so every draft is accepted at no draft cost."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]):
        self.continuations = continuations
        self.rows: list[list[int]] = []

    def join_rows(self, prompts, capacity, sources=None):
        self.rows += [self.continuations[tuple(s)] for s in sources]

    def propose(self, sequences, budgets, sampling) -> Proposal:
        drafts = [cont[len(seq) - 1:len(seq) - 1 + budget] for seq, cont, budget in zip(sequences, self.rows, budgets)]
        G = max(len(d) for d in drafts)
        tokens = torch.tensor([d + [0] * (G - len(d)) for d in drafts], dtype=torch.int64)
        return Proposal(tokens, torch.tensor([len(d) for d in drafts]), None, draft_calls=0)

    def keep_rows(self, rows):
        self.rows = [self.rows[i] for i in rows]


def loop_cost(folder: Path, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """Part 2: target-only, the model as its own draft, and the oracle drafter, interleaved."""
    from transformers import AutoModelForSeq2SeqLM

    target = Engine.from_pretrained(folder)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    reference = {tuple(p): r.token_ids for p, r in zip(prompts, target.generate(prompts, params))}
    hf = AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=torch.float32).eval()
    engines = {
        "target-only": target,
        "own draft gamma=4": Engine(target.target, target.tokenizer,
                                    ModelDrafter(target.target, target.target.config.vocab_size, len(target.tokenizer)),
                                    gamma=4),
        "oracle gamma=4": Engine(target.target, target.tokenizer, OracleDrafter(reference), gamma=4),
    }
    seconds = {name: [] for name in [*engines, "hf generate"]}
    same = {name: True for name in seconds}
    for rep in range(repeats + 1):  # the first is a warm-up
        for name in seconds:
            start, outputs = time.perf_counter(), []
            for prompt in prompts:
                if name == "hf generate":
                    outputs += hf_decode(hf, [prompt], new_tokens, 0.0)
                else:
                    outputs += [r.token_ids for r in engines[name].generate([prompt], params)]
            if rep:
                seconds[name].append(time.perf_counter() - start)
            same[name] &= outputs == [reference[tuple(p)] for p in prompts]
    tokens = len(prompts) * new_tokens
    rates = {name: tokens / statistics.median(s) for name, s in seconds.items()}
    stats = {name: engines[name].last_run_stats for name in engines}
    return {name: dict(tokens_per_s=round(rates[name], 2), vs_target_only=round(rates[name] / rates["target-only"], 3),
                       vs_hf=round(rates[name] / rates["hf generate"], 3), greedy_equals_target_only=same[name],
                       alpha=stats[name].acceptance_rate if name in stats else None,
                       tokens_per_target_call=stats[name].tokens_per_round if name in stats else None,
                       runs_s=[round(s, 3) for s in seconds[name]])
            for name in seconds}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", default=".")
    parser.add_argument("--work-dir", default="/tmp/specengine-t5", help="where the random checkpoints are made")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="4 prompts, 32 tokens, one repeat")
    parser.add_argument("--skip-e2e", action="store_true", help="only part 2")
    args = parser.parse_args()
    out = Path(args.out_dir)
    folders = make_pair(Path(args.work_dir))
    count, new_tokens, repeats = (4, 32, 1) if args.quick else (args.prompts, args.new_tokens, args.repeats)
    if not args.skip_e2e:
        run_benchmark(BenchOptions(folders["t5-base-like"], folders["t5-small-like"], out, prompts=count,
                                   new_tokens=new_tokens, repeats=repeats, gammas=(2, 4, 6), batches=(1,),
                                   temperatures=(0.0, 1.0), plot=False, label="e2e-t5"))
    engine = Engine.from_pretrained(folders["t5-base-like"])
    prompts = heldout_prompts(engine.tokenizer, count, length=64, start_fraction=1 / 3)
    result = dict(machine=machine_name(), date=datetime.date.today().isoformat(), torch=torch.__version__,
                  target="t5-base-like (random, bfloat16 checkpoint)", prompts=count, new_tokens=new_tokens,
                  repeats=repeats, configs=loop_cost(folders["t5-base-like"], prompts, new_tokens, repeats))
    for name, row in result["configs"].items():
        print(f"{name:20s} {row['tokens_per_s']:8.1f} tok/s  vs target-only {row['vs_target_only']:5.2f}x  "
              f"vs HF {row['vs_hf']:5.2f}x  alpha {row['alpha']}  tokens/call {row['tokens_per_target_call']}  "
              f"greedy == target-only {row['greedy_equals_target_only']}")
    path = out / f"t5-loop-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
