"""`make demo`: one real generation, target-only and speculative, with speed and acceptance statistics.

No trained model pair ships yet, so the demo builds a tiny RANDOMLY INITIALISED pair
(see specengine.tiny.build_demo_pair) and says so: its text is gibberish, but the run
is real decoding, and greedy speculative output must equal target-only output.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import Engine, SamplingParams
from .tiny import build_demo_pair


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=".demo-models", help="where the demo pair is built")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    args = parser.parse_args(argv)

    print("NOTE: no trained model pair ships with specengine yet; this demo runs a tiny RANDOMLY "
          "INITIALISED Llama pair (target: 4 layers, draft: its first layer), so the text is gibberish.")
    target_dir, draft_dir = build_demo_pair(Path(args.models))
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
