"""Two source trees of specengine decoding the same requests, side by side in one run: one worker
process per tree (its tree first on PYTHONPATH, models loaded once), taking turns, so that both
see the same machine state. Medians of each configuration's tokens per second and their ratio.

    git worktree add /tmp/before HEAD   # plus its _C extension and kernels link, see --help
    python bench/compare_revisions.py --tree before=/tmp/before --tree after=. --out bench/results/X.json

Only the public API is used (Engine.from_pretrained, chat_prompt, generate, last_run_stats), so
any two revisions that have it compare.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import CHAT_REQUESTS

# (name, gamma or None for target-only, temperature)
CONFIGS = [("target-only T=0", None, 0.0), ("gamma=auto T=0", "auto", 0.0), ("gamma=3 T=1", 3, 1.0)]

WORKER = r"""
import json, sys, time
import torch
from specengine import Engine, SamplingParams, default_pair
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
target, draft = default_pair()
engines = {}
for name, gamma, temperature in spec["configs"]:
    engines[name] = (Engine.from_pretrained(target, None) if gamma is None
                     else Engine.from_pretrained(target, draft, gamma=gamma))
any_engine = next(iter(engines.values()))
prompts = [any_engine.chat_prompt([{"role": "user", "content": r}]) for r in spec["requests"]]
def run(name, temperature):
    params = [SamplingParams(max_new_tokens=spec["new_tokens"], temperature=temperature, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    engine = engines[name]
    start = time.perf_counter()
    tokens = 0
    outputs = []
    batch = spec["batch"]
    for i in range(0, len(prompts), batch):  # batch requests at a time
        for result in engine.generate(prompts[i:i + batch], params[i:i + batch]):
            tokens += len(result.token_ids)
            outputs.append(result.token_ids)
    return tokens / (time.perf_counter() - start), outputs
for name, _, temperature in spec["configs"]:  # warm-up
    engines[name].generate([prompts[0]], SamplingParams(max_new_tokens=8, temperature=temperature, seed=1))
print("ready", flush=True)
for line in sys.stdin:
    name = line.strip()
    temperature = next(t for n, _, t in spec["configs"] if n == name)
    rate, outputs = run(name, temperature)
    print(json.dumps({"rate": rate, "outputs": outputs}), flush=True)
"""


def machine() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor()
    return f"{model}, {os.cpu_count()} CPUs"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, metavar="LABEL=PATH",
                        help="a source tree (with its built specengine/_C and a specengine/kernels link); twice")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="requests generated together")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    trees = dict(t.split("=", 1) for t in args.tree)
    if len(trees) != 2:
        parser.error("give exactly two --tree LABEL=PATH")
    spec = dict(configs=CONFIGS, requests=CHAT_REQUESTS, new_tokens=args.new_tokens, threads=args.threads,
                batch=args.batch)
    workers = {}
    for label, path in trees.items():
        env = dict(os.environ, PYTHONPATH=str(Path(path).resolve()), OMP_NUM_THREADS=str(args.threads))
        env.pop("TRITON_INTERPRET", None)
        workers[label] = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(spec)], env=env, cwd="/",
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = workers[label].stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"worker {label} failed to start")
    rates = {(label, name): [] for label in trees for name, _, _ in CONFIGS}
    outputs = {}
    started = time.time()
    for repeat in range(args.repeats):
        for name, _, _ in CONFIGS:
            order = list(trees) if repeat % 2 == 0 else list(trees)[::-1]  # alternate who goes first
            for label in order:
                workers[label].stdin.write(name + "\n")
                workers[label].stdin.flush()
                result = json.loads(workers[label].stdout.readline())
                rates[label, name].append(result["rate"])
                outputs.setdefault(name, {}).setdefault(label, result["outputs"])
                print(f"repeat {repeat} {name:18s} {label:8s} {result['rate']:6.1f} tok/s", flush=True)
    for w in workers.values():
        w.stdin.close()
        w.wait(timeout=60)
    first, second = list(trees)
    rows = []
    for name, _, temperature in CONFIGS:
        a, b = statistics.median(rates[first, name]), statistics.median(rates[second, name])
        same = outputs[name][first] == outputs[name][second]
        rows.append(dict(config=name, **{f"{first}_tok_s": round(a, 2), f"{second}_tok_s": round(b, 2)},
                         ratio=round(b / a, 3), same_tokens=same, runs={first: rates[first, name],
                                                                        second: rates[second, name]}))
        print(f"{name:18s} {first} {a:6.1f}  {second} {b:6.1f}  ratio {b / a:.3f}  same tokens: {same}")
    report = dict(date=time.strftime("%Y-%m-%d", time.gmtime(started)), machine=machine(), threads=args.threads,
                  trees=trees, repeats=args.repeats, new_tokens=args.new_tokens, requests=len(CHAT_REQUESTS),
                  batch=args.batch, rows=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    # Greedy and seeded outputs must not depend on the revision (gamma="auto" picks gammas from
    # timings, but greedy tokens are the target's whatever it picks).
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
