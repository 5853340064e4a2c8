"""gamma="auto" against the best fixed gammas on the shipped pair, batch 1: a short, targeted run.

    python bench/check_auto_gamma.py [--prompts 8] [--new-tokens 128] [--repeats 2] [--gammas 2 3]

The full comparison is bench/bench_e2e.py (every gamma, batch 1 and 8, against HF); this
reruns only the best fixed gammas and "auto" at temperature 0 and 1, interleaved, median of the repeats,
and writes bench/results/auto-gamma-<date>.csv with the measured step costs auto decided from.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import platform
import statistics
import time
from pathlib import Path

import torch

from specengine import Engine, SamplingParams
from specengine.drafters.model import ModelDrafter
from specengine.engine.gamma import measure_costs
from specengine.shipped import heldout_prompts, shipped_pair


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gammas", type=int, nargs="+", default=[2, 3])
    args = parser.parse_args()
    target_dir, draft_dir = shipped_pair()
    base = Engine.from_pretrained(target_dir)
    target, tokenizer = base.target, base.tokenizer
    draft = Engine.from_pretrained(draft_dir).target
    prompts = heldout_prompts(tokenizer, args.prompts, length=64, start_fraction=1 / 3)  # as bench_e2e
    costs = measure_costs(target, draft, 8)
    print(f"draft step (forward + sampling) {1e3 * costs.draft_step_s:.2f} ms; target on 1..9 tokens "
          f"{[round(1e3 * t, 2) for t in costs.verify_s]} ms")
    engines = {g: Engine(target, tokenizer, ModelDrafter(draft, target.config.vocab_size, len(tokenizer)), gamma=g,
                         costs={1: costs} if g == "auto" else None)
               for g in [*args.gammas, "auto"]}
    rates: dict[tuple[float, int | str], list[float]] = {}
    for rep in range(args.repeats):
        for T in (0.0, 1.0):
            for g, engine in engines.items():
                t0, tokens = time.perf_counter(), 0
                for i, prompt in enumerate(prompts):
                    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=T, ignore_eos=True,
                                            seed=100 * rep + i)
                    tokens += len(engine.generate([prompt], params)[0].token_ids)
                rates.setdefault((T, g), []).append(tokens / (time.perf_counter() - t0))
    date = datetime.date.today().isoformat()
    machine = f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    out = Path(__file__).resolve().parent / "results" / f"auto-gamma-{date}.csv"
    with out.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["machine", "date", "torch", "temperature", "gamma", "tokens_per_s", "draft_step_ms",
                         "target_ms_k1_to_9"])
        for (T, g), values in rates.items():
            rate = statistics.median(values)
            print(f"T={T:g} gamma={g}: {rate:.1f} tok/s")
            writer.writerow([machine, date, torch.__version__, T, g, round(rate, 2),
                             round(1e3 * costs.draft_step_s, 3), " ".join(f"{1e3 * t:.2f}" for t in costs.verify_s)])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
