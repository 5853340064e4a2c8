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
import statistics
import time

from specengine import Engine, SamplingParams, default_pair
from specengine.devtools.benchmark import machine_name

from common import CHAT_REQUESTS, write_json



def timed_pass(engine: Engine, prompts, params) -> tuple[float, list[list[int]], float | None]:
    """(tokens per second, outputs, acceptance rate) of the prompts one at a time."""
    start, tokens, outputs, accepted, tested = time.perf_counter(), 0, [], 0, 0
    for prompt in prompts:
        (result,) = engine.generate([prompt], params)
        tokens += len(result.token_ids)
        outputs.append(result.token_ids)
        accepted += result.stats.accepted
        tested += result.stats.accepted + result.stats.rejections
    return tokens / (time.perf_counter() - start), outputs, (accepted / tested if tested else None)


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
    rates: dict[str, list[float]] = {}
    alphas: dict[str, list[float]] = {}
    same = True
    for repeat in range(args.repeats):
        suffix = Engine.from_pretrained(target, drafter="suffix", gamma=gamma)
        suffix.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8, temperature=0.0))  # warm-up (and costs)
        for name in ("fresh", "recurring"):
            want = None
            for label, engine in (("target-only", plain), ("suffix", suffix))[::1 if repeat % 2 == 0 else -1]:
                rate, outputs, alpha = timed_pass(engine, prompts, params)
                rates.setdefault(f"{label} {name}", []).append(rate)
                if alpha is not None:
                    alphas.setdefault(f"{label} {name}", []).append(alpha)
                want = want or outputs
                same &= outputs == want
                print(f"repeat {repeat} {name:9s} {label:11s} {rate:6.1f} tok/s"
                      + (f" alpha {alpha:.2f}" if alpha is not None else ""), flush=True)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    result = dict(date=datetime.date.today().isoformat(), machine=machine_name(), gamma=args.gamma,
                  new_tokens=args.new_tokens, requests=len(CHAT_REQUESTS), repeats=args.repeats, batch=1,
                  tok_s=medians, runs=rates, alpha={k: statistics.median(v) for k, v in alphas.items()},
                  speedup_fresh=medians["suffix fresh"] / medians["target-only fresh"],
                  speedup_recurring=medians["suffix recurring"] / medians["target-only recurring"],
                  greedy_identical=same)
    print(f"suffix / target-only: fresh {result['speedup_fresh']:.2f}x, recurring {result['speedup_recurring']:.2f}x; "
          f"greedy identical: {same}")
    write_json(result, args.out, f"suffix-e2e-{result['date']}.json")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
