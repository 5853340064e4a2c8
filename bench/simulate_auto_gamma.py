"""gamma="auto"'s choices scored without timing noise (specengine.devtools.replay): its rounds replayed on
the shipped pair's acceptance along held-out prompts, with measured step costs as the clock.

    python bench/simulate_auto_gamma.py [--prompts 16] [--new-tokens 128] [--seeds 200] [--temperatures 0 1]
        [--overheads-ms 0.9 2.0]

The target decodes each prompt (target-only, as bench_e2e's prompts); both models then score each
sequence in one forward, which gives every position's acceptance probability; every fixed gamma
and gamma="auto" decode the traces again (specengine.devtools.replay.replay), mean over seeds.
"""
from __future__ import annotations

import argparse
import statistics

from specengine import Engine, SamplingParams
from specengine.devtools.replay import acceptance_along, replay_mean
from specengine.engine.costs import measure_costs
from specengine.shipped import heldout_prompts, shipped_pair


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--overheads-ms", type=float, nargs=2, default=[0.9, 2.0],
                        help="round overheads beyond the modelled steps: target-only rounds, drafting rounds "
                             "(what auto learned at batch 1 on the 2-core VM: about 0.9 and 2.0 ms)")
    args = parser.parse_args()
    target_dir, draft_dir = shipped_pair()
    engine = Engine.from_pretrained(target_dir)
    target, tokenizer = engine.target, engine.tokenizer
    draft = Engine.from_pretrained(draft_dir).target
    prompts = heldout_prompts(tokenizer, args.prompts, length=64, start_fraction=1 / 3)  # as bench_e2e
    costs = measure_costs(target, draft, 8, batch_size=1)
    overheads_s = tuple(1e-3 * ms for ms in args.overheads_ms)
    print(f"draft step {1e3 * costs.draft_step_s:.2f} ms; target on 1..9 tokens "
          f"{[round(1e3 * t, 2) for t in costs.verify_s]} ms; round overheads {args.overheads_ms} ms")
    for T in args.temperatures:
        params = [SamplingParams(max_new_tokens=args.new_tokens, temperature=T, ignore_eos=True, seed=i)
                  for i in range(len(prompts))]
        outputs = [r.token_ids for r in engine.generate(prompts, params)]
        traces = [acceptance_along(target, draft, p, o, T) for p, o in zip(prompts, outputs)]
        per_request = [statistics.mean(t) for t in traces]
        print(f"T={T:g}: acceptance probability {statistics.mean(per_request):.3f} "
              f"(requests {min(per_request):.2f}..{max(per_request):.2f})")
        results = {g: replay_mean(traces, costs, g, args.seeds, overheads_s) for g in [*range(costs.max_gamma + 1), "auto"]}
        best = max((g for g in results if g != "auto"), key=lambda g: results[g].tokens_per_s)
        for g, r in results.items():
            print(f"  gamma={g}: {r.tokens_per_s:.1f} simulated tok/s, {r.drafts_per_token:.3f} drafts per token"
                  f"{'  (best fixed)' if g == best else ''}")
        print(f"  auto against the best fixed gamma ({best}): "
              f"{100 * (results['auto'].tokens_per_s / results[best].tokens_per_s - 1):+.1f}%")


if __name__ == "__main__":
    main()
