"""`make demo`: one real generation, target-only and speculative, with speed and acceptance statistics.

It runs the shipped pycode pair. Where that pair is not installed, it builds a tiny RANDOMLY
INITIALISED pair instead (specengine.tiny.build_demo_pair) and says so: its text is gibberish,
but the run is real decoding, and greedy speculative output must equal target-only output.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import Engine, SamplingParams
from .shipped import shipped_pair
from .tiny import build_demo_pair


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=".demo-models", help="where the demo pair is built")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    args = parser.parse_args(argv)

    pair = shipped_pair()
    if pair is None:
        print("NOTE: the trained model pair is not installed; this demo runs a tiny RANDOMLY INITIALISED "
              "Llama pair (the draft is the target's first layer), so the text is gibberish.")
        pair = build_demo_pair(Path(args.models))
    target_dir, draft_dir = pair
    print(f"target: {target_dir}\ndraft:  {draft_dir}")
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0, ignore_eos=True)

    baseline = Engine.from_pretrained(target_dir)
    speculative = Engine.from_pretrained(target_dir, draft_dir, gamma=args.gamma)
    baseline.generate([args.prompt], params)  # warm-up
    speculative.generate([args.prompt], params)
    (base,) = baseline.generate([args.prompt], params)
    (spec,) = speculative.generate([args.prompt], params)

    print(f"\nprompt: {args.prompt!r}\ngenerated (greedy, gamma={args.gamma}): {spec.text!r}\n")
    print(f"target only : {baseline.last_run_stats.summary()}")
    print(f"speculative : {speculative.last_run_stats.summary()}")
    same = base.token_ids == spec.token_ids
    speedup = spec.stats.tokens_per_s / base.stats.tokens_per_s
    print(f"\nspeedup {speedup:.2f}x; greedy speculative output identical to target-only: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
