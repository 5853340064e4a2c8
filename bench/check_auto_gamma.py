"""gamma="auto" against the best fixed gammas on the shipped pair: a short, targeted run.

    python bench/check_auto_gamma.py [--batch 1] [--prompts 8] [--new-tokens 128] [--repeats 2] [--gammas 2 3]
        [--temperatures 0 1] [--useless-draft] [--out CSV]

The full comparison is bench/bench_e2e.py (every gamma, batch 1 and 8, against HF); this
reruns only the best fixed gammas and "auto" at temperature 0 and 1, interleaved, median of the repeats,
and writes bench/results/auto-gamma-<date>.csv with the measured step costs auto decided from.
--useless-draft redraws the draft's weights at random (alpha near 0, same costs): auto must then
decode about as fast as target-only decoding (gamma 0), never slower by more than its probes.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import statistics
import time
from pathlib import Path

import torch

from specengine import Engine, SamplingParams
from specengine.devtools.benchmark import machine_name, rotated
from specengine.drafters.model import ModelDrafter
from specengine.engine.costs import measure_costs
from specengine.shipped import heldout_prompts, shipped_pair

from common import RESULTS


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gammas", type=int, nargs="+", default=[2, 3], help="fixed gammas (0: target-only)")
    parser.add_argument("--batch", type=int, default=1, help="prompts per generate call")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--useless-draft", action="store_true", help="the draft's weights redrawn at random")
    parser.add_argument("--out", help="CSV to write (default bench/results/auto-gamma[-useless-draft]-batch<B>-<date>.csv)")
    args = parser.parse_args()
    target_dir, draft_dir = shipped_pair()
    base = Engine.from_pretrained(target_dir)
    target, tokenizer = base.target, base.tokenizer
    draft = Engine.from_pretrained(draft_dir).target
    if args.useless_draft:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in draft.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    prompts = heldout_prompts(tokenizer, args.prompts, length=64, start_fraction=1 / 3)  # as bench_e2e
    # as Engine(gamma="auto") measures them, once for every engine here
    all_costs = {b: measure_costs(target, draft, 8, batch_size=b) for b in (1, 8)}
    costs = all_costs[1 if args.batch < 8 else 8]
    print(f"batch {args.batch}: draft step (forward + sampling) {1e3 * costs.draft_step_s:.2f} ms; target on 1..9 "
          f"tokens {[round(1e3 * t, 2) for t in costs.verify_s]} ms")
    V = target.config.vocab_size
    engines = {g: Engine(target, tokenizer, ModelDrafter(draft, V, len(tokenizer)) if g != 0 else None,
                         gamma=g if g != 0 else 5, costs=all_costs if g == "auto" else None)
               for g in [*args.gammas, "auto"]}
    batches = [prompts[i: i + args.batch] for i in range(0, len(prompts), args.batch)]
    rates: dict[tuple[float, int | str], list[float]] = {}
    drafts_per_token: dict[tuple[float, int | str], list[float]] = {}  # per repeat
    for rep in range(args.repeats):
        for T in args.temperatures:
            # Interleaved batch by batch (not configuration by configuration), so that a slow
            # stretch of the machine falls on every configuration alike.
            seconds, tokens = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0)
            drafted = dict.fromkeys(engines, 0)
            for i, batch in enumerate(batches):
                params = [SamplingParams(max_new_tokens=args.new_tokens, temperature=T, ignore_eos=True,
                                         seed=100 * rep + 10 * i + j) for j in range(len(batch))]
                for g in rotated(list(engines), rep * len(batches) + i):  # as bench_e2e: no fixed order
                    engine = engines[g]
                    t0 = time.perf_counter()
                    results = engine.generate(batch, params)
                    seconds[g] += time.perf_counter() - t0
                    tokens[g] += sum(len(r.token_ids) for r in results)
                    drafted[g] += sum(r.stats.drafted for r in results)
            for g in engines:
                rates.setdefault((T, g), []).append(tokens[g] / seconds[g])
                drafts_per_token.setdefault((T, g), []).append(drafted[g] / tokens[g])
    date = datetime.date.today().isoformat()
    machine = machine_name()
    kind = "-useless-draft" if args.useless_draft else ""
    out = Path(args.out) if args.out else RESULTS / f"auto-gamma{kind}-batch{args.batch}-{date}.csv"
    with out.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["machine", "date", "torch", "batch", "temperature", "gamma", "tokens_per_s",
                         "drafts_per_token", "draft_step_ms", "target_ms_k1_to_9"])
        for (T, g), values in rates.items():
            rate = statistics.median(values)
            drafts = statistics.median(drafts_per_token[(T, g)])
            print(f"batch {args.batch} T={T:g} gamma={g}: {rate:.1f} tok/s, {drafts:.3f} drafts per token")
            writer.writerow([machine, date, torch.__version__, args.batch, T, g, round(rate, 2), round(drafts, 4),
                             round(1e3 * costs.draft_step_s, 3), " ".join(f"{1e3 * t:.2f}" for t in costs.verify_s)])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
