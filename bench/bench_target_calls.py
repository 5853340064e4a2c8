"""The cost of one target call on 1..9 tokens (a decode step, then verifications of gamma + 1 =
2..9 tokens), and its ratio to one token: what speculation pays per round on a CPU.

    python bench/bench_target_calls.py [--file PATH] [--threads 2] [--reps 15] [--context 64]
        [--isa avx512|avx2|portable] [--out FILE.json]

The target is the default pair's GGUF file (SmolLM2-135M-Instruct Q4_1, run as stored) unless
--file names another. Timed by engine.costs.measure_costs (warm-up, then calls on 1..9 tokens
interleaved, medians), at batch 1 with --context cached tokens, logits included: what a round's
target call costs the engine. The machine, threads, ISA and date are recorded with the figures.
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cpu_name, write_json  # noqa: E402

from specengine import _C  # noqa: E402
from specengine.engine.costs import measure_costs  # noqa: E402
from specengine.models import load_model  # noqa: E402
from specengine.shipped import smollm2_gguf  # noqa: E402

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", type=Path, help="a GGUF file or checkpoint folder (default: the default target)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=9)
    parser.add_argument("--isa", choices=["avx512", "avx2", "portable"], help="limit the C++ ops to this instruction set")
    parser.add_argument("--out", help="JSON path (default bench/results/target-calls-<date>.json)")
    args = parser.parse_args(argv)
    if args.max_tokens < 1 or args.reps < 1:
        parser.error("--max-tokens and --reps must be >= 1")
    torch.set_num_threads(args.threads)
    if args.isa:
        _C.set_cpu_isa_limit(args.isa)
    path = args.file or smollm2_gguf()
    target = load_model(path)
    costs = measure_costs(target, None, args.max_tokens - 1, context=args.context, reps=args.reps)
    one = costs.verify_s[0]
    print(f"{path.name}: {cpu_name()}, {args.threads} threads, isa {args.isa or 'widest'}")
    print("tokens  ms      ratio to 1 token")
    for k, seconds in enumerate(costs.verify_s, start=1):
        print(f"{k:6d}  {1e3 * seconds:6.2f}  {seconds / one:5.2f}")
    date = datetime.date.today().isoformat()
    write_json(dict(file=str(path), cpu=cpu_name(), threads=args.threads, isa=args.isa or "widest",
                    torch=torch.__version__, date=date, context=args.context, reps=args.reps,
                    ms=[1e3 * s for s in costs.verify_s], ratio=[s / one for s in costs.verify_s]),
               args.out, f"target-calls-{date}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
