"""CUDA graphs against eager execution, on the shipped pair (run by bench/gpu_check.sh).

    python bench/bench_graphs.py [--device cuda] [--prompts 8] [--new-tokens 96] [--out graphs.json]

1. One draft step (the draft model's forward and logits on one token per row) at batch 1 and 8:
   eager against replayed from a captured graph (engine.graphs.StepGraphs).
2. End to end, batch 1 and 8, temperature 0 and 1, held-out prompts, gamma 1..4 (the best
   reported): the eager PyTorch target-only loop, specengine eager and specengine with
   cuda_graphs; tokens/s, ratios to the eager loop, alpha; greedy outputs checked equal.
3. The host's share of a round with graphs (phase timing on, in a separate run: it
   synchronises at every phase boundary).
On a CPU the "graphs" rows run the same fixed-shape steps eagerly (a smoke test of the script).
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch

from specengine import Engine, SamplingParams
from specengine.drafters.model import ModelDrafter
from specengine.engine.gamma import median_seconds
from specengine.engine.graphs import StepGraphs
from specengine.shipped import heldout_prompts, shipped_pair

from bench_costs import machine_name, write_json
from bench_e2e import eager_decode


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def draft_step_ms(draft, batch: int, device, use_graphs: bool, reps: int = 50) -> float:
    steps = StepGraphs(draft, batch, 256, use_graphs=use_graphs)
    cache = steps.new_batch(batch)
    cache.lengths.fill_(64)
    tokens = torch.zeros(batch, 1, dtype=torch.int64, device=device)
    if use_graphs:
        call = lambda: steps(tokens, cache.lengths)  # noqa: E731
    else:
        call = lambda: draft.logits(draft(tokens, cache.lengths.clone(), cache, kv_len=65))  # noqa: E731
    return 1e3 * median_seconds(call, reps, warmup=3)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    target_dir, draft_dir = shipped_pair()
    base = Engine.from_pretrained(target_dir, device=str(device))
    target, tokenizer = base.target, base.tokenizer
    draft = Engine.from_pretrained(draft_dir, device=str(device)).target
    V = target.config.vocab_size
    result = dict(date=datetime.date.today().isoformat(), machine=machine_name(device), torch=torch.__version__)

    on_gpu = device.type == "cuda"
    for B in (1, 8):
        eager, graphs = draft_step_ms(draft, B, device, False), draft_step_ms(draft, B, device, on_gpu)
        result[f"draft_step_batch{B}"] = dict(eager_ms=eager, graph_ms=graphs, ratio=eager / graphs)
        print(f"draft step, batch {B}: eager {eager:.3f} ms, {'graph' if on_gpu else 'static (eager)'} "
              f"{graphs:.3f} ms, {eager / graphs:.2f}x")

    prompts = heldout_prompts(tokenizer, args.prompts, length=64, start_fraction=1 / 3)
    engines = {}
    for g in args.gammas:
        engines[("eager", g)] = Engine(target, tokenizer, ModelDrafter(draft, V, len(tokenizer)), gamma=g)
        engines[("graphs", g)] = Engine(target, tokenizer, ModelDrafter(draft, V, len(tokenizer)), gamma=g,
                                        cuda_graphs=True, max_batch_size=8)

    def run(kind, g, B, T, rep):
        batches = [prompts[i: i + B] for i in range(0, len(prompts), B)]
        outputs, accepted, tested = [], 0, 0
        sync(device)
        t0 = time.perf_counter()
        for i, batch in enumerate(batches):
            if kind == "loop":
                outputs += eager_decode(target, batch, args.new_tokens, T, seed=rep * 100 + i)
                continue
            params = [SamplingParams(max_new_tokens=args.new_tokens, temperature=T, ignore_eos=True,
                                     seed=rep * 100 + 10 * i + j) for j in range(len(batch))]
            e = engines[(kind, g)]
            outputs += [r.token_ids for r in e.generate(batch, params)]
            accepted += e.last_run_stats.accepted
            tested += e.last_run_stats.accepted + e.last_run_stats.rejections
        sync(device)
        return time.perf_counter() - t0, outputs, accepted / tested if tested else None

    rows = []
    for B in (1, 8):
        for T in (0.0, 1.0):
            configs = [("loop", 0)] + [(k, g) for g in args.gammas for k in ("eager", "graphs")]
            for kind, g in configs:  # warm-up: captures every graph this configuration needs
                run(kind, g, B, T, rep=0)
            times = {c: [] for c in configs}
            outputs, alphas = {}, {}
            for rep in range(args.repeats):  # interleaved
                for c in configs:
                    seconds, out, alpha = run(*c, B, T, rep)
                    times[c].append(seconds)
                    outputs[c], alphas[c] = out, alpha
            tokens = len(prompts) * args.new_tokens
            rate = {c: tokens / statistics.median(t) for c, t in times.items()}
            loop_rate = rate[("loop", 0)]
            for c in configs:
                same = outputs[c] == outputs[("loop", 0)] if T == 0 else None
                rows.append(dict(batch=B, temperature=T, kind=c[0], gamma=c[1], tokens_per_s=round(rate[c], 1),
                                 vs_eager_loop=round(rate[c] / loop_rate, 3), alpha=alphas[c],
                                 greedy_equals_loop=same))
            best = {k: max((g for g in args.gammas), key=lambda g: rate[(k, g)]) for k in ("eager", "graphs")}
            print(f"batch {B} T={T:g}: eager loop {loop_rate:.1f} tok/s; specengine eager {rate[('eager', best['eager'])]:.1f} "
                  f"(gamma {best['eager']}, {rate[('eager', best['eager'])] / loop_rate:.2f}x); with graphs "
                  f"{rate[('graphs', best['graphs'])]:.1f} (gamma {best['graphs']}, "
                  f"{rate[('graphs', best['graphs'])] / loop_rate:.2f}x)")
    result["e2e"] = rows
    if any(r["greedy_equals_loop"] is False for r in rows):
        print("WARNING: some greedy outputs differ from the eager loop's")

    timed = Engine(target, tokenizer, ModelDrafter(draft, V, len(tokenizer)), gamma=2, cuda_graphs=True,
                   max_batch_size=8, time_phases=True)
    timed.generate(prompts[:1], SamplingParams(max_new_tokens=8, temperature=0))
    timed.generate(prompts[:1], SamplingParams(max_new_tokens=args.new_tokens, temperature=0, ignore_eos=True))
    ph = timed.last_run_phases
    loop = ph["total"] - ph["prefill"]
    result["graphs_batch1_phases_ms"] = {k: 1e3 * v / timed.last_run_rounds for k, v in ph.items()}
    result["graphs_batch1_host_share"] = ph["host"] / loop
    print(f"graphs, batch 1, gamma 2: host {100 * ph['host'] / loop:.1f}% of the round time")
    for name, steps in (("target", timed.target_steps), ("draft", timed.drafter.steps)):
        result[f"{name}_graph_fallback"] = steps.fallback_reason
        if steps.fallback_reason:
            print(f"{name} graphs fell back to eager: {steps.fallback_reason}")

    write_json(result, args.out, f"graphs-{device.type}-{result['date']}.json")


if __name__ == "__main__":
    main()
