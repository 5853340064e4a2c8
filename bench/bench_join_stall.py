"""Do running streams keep their pace when a long prompt joins? The default pair decodes a few greedy
streams; after --join-after steps a --join-tokens-token prompt is added; every Engine.step() is
timed. Per run: the streams' median step before the join (the first --warmup steps left out: they
prefill the streams' own prompts), the longest step after it while the streams still run (the
join's staging, each prefill chunk, the joined row's first rounds, cache growth, rows leaving),
and their ratio. Target: a ratio of at most 3 in every run.

Each run is a fresh engine (models loaded again), so that every join meets the caches as a
server's first long prompt does: sized for the streams only, with no prefill timed yet and
nothing in the prefix cache.

  python bench/bench_join_stall.py            # 10 runs: bench/results/join-stall-after-<date>.json
  PYTHONPATH=/tmp/before python bench/bench_join_stall.py --label before   # another source tree

Per-run figures are written after each run, so a run stopped early keeps what it measured.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from common import CHAT_REQUESTS, RESULTS

REPO = Path(__file__).resolve().parent.parent
# The joining prompt's text: long enough for --join-tokens tokens of prose and code (repeated if not).
JOIN_TEXT_FILES = [REPO / "docs" / "design.md", REPO / "README.md"]


def join_prompt(tokenizer, tokens: int) -> list[int]:
    text = "\n\n".join(path.read_text() for path in JOIN_TEXT_FILES)
    ids = tokenizer.encode(text)
    while len(ids) < tokens:
        ids = ids + ids
    return ids[:tokens]


def one_run(args, target, draft) -> dict:
    from specengine import Engine, SamplingParams

    engine = Engine.from_pretrained(target, draft, gamma=args.gamma)
    prompts = [engine.chat_prompt([{"role": "user", "content": r}]) for r in CHAT_REQUESTS[:args.streams]]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    streams = {engine.add_request(p, params) for p in prompts}
    joiner_prompt = join_prompt(engine.tokenizer, args.join_tokens)
    steps: list[dict] = []  # per step: seconds, whether the join had happened, streams running, rows prefilling
    joiner = None
    running = set(streams)
    while running:
        if joiner is None and len(steps) == args.join_after:
            joiner = engine.add_request(joiner_prompt, SamplingParams(max_new_tokens=args.join_new_tokens,
                                                                     temperature=0.0, ignore_eos=True))
        start = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - start
        steps.append(dict(seconds=seconds, joined=joiner is not None, streams=len(running),
                          prefilling=engine.num_prefilling))
        running -= {o.request_id for o in outputs if o.finished}
    while engine.has_unfinished_requests() or engine.has_pending_outputs():  # the joiner, untimed
        engine.step()
    before = [s["seconds"] for s in steps[args.warmup:args.join_after]]
    after = [s["seconds"] for s in steps[args.join_after:]]
    prefill_steps = sum(1 for s in steps[args.join_after:] if s["prefilling"])
    median, worst = statistics.median(before), max(after)
    worst_at = after.index(worst)
    del engine
    gc.collect()
    return dict(median_before_ms=1e3 * median, max_after_ms=1e3 * worst, ratio=worst / median,
                worst_step_after_join=worst_at, prefill_steps=prefill_steps,
                join_step_ms=1e3 * after[0], steps_ms=[round(1e3 * s["seconds"], 2) for s in steps])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=256, help="each stream's tokens")
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--join-tokens", type=int, default=1500)
    parser.add_argument("--join-new-tokens", type=int, default=128)
    parser.add_argument("--join-after", type=int, default=30, help="steps of the streams before the join")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the median")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--label", default="after")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import specengine
    from specengine import default_pair

    target, draft = default_pair()
    runs = []
    out = args.out or str(RESULTS / f"join-stall-{args.label}-{datetime.date.today().isoformat()}.json")
    for i in range(args.runs):
        run = one_run(args, target, draft)
        runs.append(run)
        Path(out).write_text(json.dumps(dict(label=args.label, args=vars(args), runs=runs)))  # so far, if stopped
        print(f"run {i + 1}: median step before the join {run['median_before_ms']:.1f} ms, longest after "
              f"{run['max_after_ms']:.1f} ms ({run['ratio']:.2f}x, step {run['worst_step_after_join']} after the "
              f"join; the join's own step {run['join_step_ms']:.1f} ms; {run['prefill_steps']} prefill steps)",
              flush=True)
    ratios = [r["ratio"] for r in runs]
    summary = dict(runs_within_3x=sum(r <= 3 for r in ratios), runs=len(runs), worst_ratio=max(ratios),
                   median_ratio=statistics.median(ratios))
    print(f"{args.label}: {summary['runs_within_3x']}/{len(runs)} runs within 3x; ratios "
          + " ".join(f"{r:.2f}" for r in ratios))
    result = dict(label=args.label, source=str(Path(specengine.__file__).parent), args=vars(args),
                  threads=torch.get_num_threads(), torch=torch.__version__, summary=summary, runs=runs)
    Path(out).write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
