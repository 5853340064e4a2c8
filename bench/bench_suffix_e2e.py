"""The suffix drafter end to end on the default target: fresh requests, then the same requests again
(an agent re-running a step), against target-only decoding, greedy, one request at a time.

    python bench/bench_suffix_e2e.py [--new-tokens 64] [--repeats 3] [--gamma auto]

The suffix engine learns each finished output, so its second pass drafts from the first. The
target-only engine runs both passes too (its speed must not depend on the pass). Passes alternate
between the engines; each figure is the median over repeats, a repeat starting from an empty
global tree (a new suffix engine).
"""
from __future__ import annotations

import argparse
import datetime

from specengine import Engine, SamplingParams, default_pair
from specengine.devtools.benchmark import machine_name

from common import CHAT_REQUESTS, Turns, write_json


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gamma", default="auto")
    parser.add_argument("--out")
    args = parser.parse_args()
    gamma = args.gamma if args.gamma == "auto" else int(args.gamma)
    target, _ = default_pair()
    plain = Engine.from_pretrained(target)
    prompts = [plain.chat_prompt([{"role": "user", "content": r}]) for r in CHAT_REQUESTS]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)
    plain.generate([prompts[0]], SamplingParams(max_new_tokens=8, temperature=0.0))  # warm-up
    turns = Turns(key_width=21)
    for repeat in range(args.repeats):
        suffix = Engine.from_pretrained(target, drafter="suffix", gamma=gamma)
        suffix.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8, temperature=0.0))  # warm-up (and costs)
        engines = {"target-only": plain, "suffix": suffix}
        for name in ("fresh", "recurring"):
            for label in turns.order(engines, repeat):
                turns.timed_pass(repeat, f"{label} {name}", engines[label], prompts, params)
    same = turns.same
    timings = turns.summary()
    medians = timings["tok_s"]
    result = dict(date=datetime.date.today().isoformat(), machine=machine_name(), gamma=args.gamma,
                  new_tokens=args.new_tokens, requests=len(CHAT_REQUESTS), repeats=args.repeats, batch=1,
                  **timings, speedup_fresh=medians["suffix fresh"] / medians["target-only fresh"],
                  speedup_recurring=medians["suffix recurring"] / medians["target-only recurring"],
                  greedy_identical=same)
    print(f"suffix / target-only: fresh {result['speedup_fresh']:.2f}x, recurring {result['speedup_recurring']:.2f}x; "
          f"greedy identical: {same}")
    write_json(result, args.out, f"suffix-e2e-{result['date']}.json")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
