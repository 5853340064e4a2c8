"""CUDA graphs against eager execution, end to end and per step (run by bench/gpu_check.sh).

    python bench/bench_graphs.py [--device cuda] [--target shipped|widened] [--batches 1 8]
        [--temperatures 0 1] [--gammas 1 2 3 4] [--prompts 8] [--new-tokens 96] [--out graphs.json]
        [--sections steps e2e phases] [--no-loop]

--target shipped: the shipped pair as it is (a small target: its GPU step is launch-bound).
--target widened: the shipped target embedded in a ~1B-parameter Llama (models.widen; same logits,
so the same alpha against the shipped draft) whose step reads 2 GB of weights: memory-bound.

1. Per step, eager against replayed from a captured graph (steps.graphs.FixedShapeSteps): the draft
   model's forward at each batch size; and at batch 1 the engine's cost model on both paths
   (engine.costs.measure_costs: the target on k = 1..9 tokens, a draft step with its sampling),
   so c and the verification costs are measured on the path each engine takes.
2. End to end, each batch size and temperature, held-out prompts: the eager PyTorch target-only
   loop (specengine.devtools.benchmark.eager_decode; --no-loop leaves it out), specengine target-only with
   graphs, specengine eager and with cuda_graphs for each gamma, and gamma="auto" with graphs;
   target-only and each gamma also reading back every --rounds-per-read rounds ("blocks"). Tokens/s,
   ratios to the eager loop and to target-only read back at the same cadence (every round, or
   every block: a speculative row is only compared with target-only paying the same reads),
   alpha; greedy outputs checked equal to the loop's (to target-only with graphs without it).
   Interleaved repeats, medians; the rows are rewritten after every repeat.
3. Theorem 3.8 with graphs, at batch 1: the measured speedup of each gamma over target-only at the
   same cadence, next to the prediction from the run's alpha and c measured on that engine's own
   fixed-shape steps (its capacity and buckets: what its rounds replay); with section 1, also the
   prediction from c measured on capacity-256 graphs.
4. The host's share of a round with graphs at batch 1, greedy, the best gamma (phase timing on,
   in a separate run: it synchronises at every phase boundary).
--sections picks among 1 ("steps"), 2 and 3 ("e2e") and 4 ("phases").
Results are written after every measurement, so a run cut short keeps what it measured. Whether
the Triton step kernels fell back to the torch path is recorded per model; on CUDA a fallback
ends the run with exit status 1 (the rows would measure the torch path, not ours).
On a CPU the "graphs" rows run the same fixed-shape steps eagerly (a smoke test of the script).
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import torch

from specengine import Engine, SamplingParams
from specengine.devtools.benchmark import eager_decode, machine_name
from specengine.drafters.model import ModelDrafter
from specengine.engine.costs import measure_costs
from specengine.engine.gamma import predicted_speedup
from specengine.steps.graphs import FixedShapeSteps
from specengine.shipped import heldout_prompts, shipped_pair

from bench_costs import widened_target
from common import sync, write_json


def forward_ms(model, batch: int, static: bool) -> float:
    """Median ms of one token per row through the model and its logits at 64 cached tokens: a plain
    forward, or the fixed-shape step (replayed from a graph on a GPU, eager on a CPU).
    engine.costs.measure_costs times it, as the target's call on one token with no draft."""
    steps = FixedShapeSteps(model, batch, 256) if static else None
    return 1e3 * measure_costs(model, None, 0, batch_size=batch, reps=30, target_steps=steps).verify_s[0]


def record_fallbacks(result: dict, models: dict) -> list[str]:
    """Each model's triton_fallback_reason into the results; the fallbacks that happened on CUDA."""
    fell = []
    for name, model in models.items():
        result[f"{name}_triton_fallback"] = model.triton_fallback_reason
        if model.triton_fallback_reason and model.device.type == "cuda":
            fell.append(f"{name}: {model.triton_fallback_reason}")
    return fell


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--target", choices=("shipped", "widened"), default="shipped")
    parser.add_argument("--widened-layers", type=int, default=22)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--eager-gammas", type=int, nargs="*", default=None,
                        help="gammas for specengine eager (default: --gammas; eager rounds are the slow rows)")
    parser.add_argument("--no-auto", action="store_true", help="skip the gamma='auto' rows")
    parser.add_argument("--rounds-per-read", type=int, default=8,
                        help="also run graphs with rounds_per_read=N (rounds from device state; 0 skips)")
    parser.add_argument("--sections", nargs="+", choices=("steps", "e2e", "phases"), default=["steps", "e2e", "phases"])
    parser.add_argument("--no-loop", action="store_true",
                        help="leave out the eager PyTorch loop (greedy outputs then checked against target-only)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    target_dir, draft_dir = shipped_pair()
    base = Engine.from_pretrained(target_dir, device=str(device))
    target, tokenizer = base.target, base.tokenizer
    if args.target == "widened":
        target = widened_target(target, args.widened_layers)
    draft = Engine.from_pretrained(draft_dir, device=str(device)).target
    V = target.config.vocab_size
    date = datetime.date.today().isoformat()
    result = dict(date=date, machine=machine_name(device), torch=torch.__version__, target=args.target,
                  target_parameters=sum(p.numel() for p in target.parameters()), dtype=str(target.dtype),
                  prompts=args.prompts, new_tokens=args.new_tokens, repeats=args.repeats)
    models = dict(target=target, draft=draft)

    def save():
        """Write the results; on CUDA, stop at the first fallback of the Triton kernels."""
        fell = record_fallbacks(result, models)
        write_json(result, args.out, f"graphs-{args.target}-{device.type}-{date}.json")
        if fell:
            print("the Triton step kernels fell back to the torch path, so these rows do not measure them: "
                  + "; ".join(fell))
            sys.exit(1)
    graph_label = "graph" if on_gpu else "static (eager)"

    # 1. per step
    graph_costs = None
    if "steps" in args.sections:
        for B in args.batches:
            eager, graphs = forward_ms(draft, B, static=False), forward_ms(draft, B, static=True)
            result[f"draft_step_batch{B}"] = dict(eager_ms=eager, graph_ms=graphs, ratio=eager / graphs)
            print(f"draft step, batch {B}: eager {eager:.3f} ms, {graph_label} {graphs:.3f} ms, {eager / graphs:.2f}x")
            save()
        # The engine's cost model on each path: the target on k tokens, a draft step with its sampling.
        eager_costs = measure_costs(target, draft, 8, reps=20)
        graph_costs = measure_costs(target, draft, 8, reps=20, target_steps=FixedShapeSteps(target, 1, 256),
                                    draft_steps=FixedShapeSteps(draft, 1, 256))
        c_eager = eager_costs.draft_step_s / eager_costs.verify_s[0]
        c_graph = graph_costs.draft_step_s / graph_costs.verify_s[0]
        result["costs_batch1"] = {name: dict(target_ms=[1e3 * t for t in cm.verify_s],
                                             draft_step_ms=1e3 * cm.draft_step_s, c=cm.draft_step_s / cm.verify_s[0])
                                  for name, cm in (("eager", eager_costs), ("graphs", graph_costs))}
        print(f"target, batch 1, k = 1..9 tokens: eager {[round(1e3 * t, 3) for t in eager_costs.verify_s]} ms; "
              f"{graph_label} {[round(1e3 * t, 3) for t in graph_costs.verify_s]} ms")
        print(f"draft step with sampling: eager {1e3 * eager_costs.draft_step_s:.3f} ms, {graph_label} "
              f"{1e3 * graph_costs.draft_step_s:.3f} ms; c eager {c_eager:.3f}, c {graph_label} {c_graph:.3f}")
        save()
    if "e2e" in args.sections:
        best_graphs_gamma = end_to_end(args, target, draft, tokenizer, prompts_for(args, tokenizer), device, result,
                                       save, graph_costs)
    else:
        best_graphs_gamma = {}
    if "phases" in args.sections:
        phases(args, target, draft, tokenizer, prompts_for(args, tokenizer), best_graphs_gamma, result, save)


def prompts_for(args, tokenizer):
    return heldout_prompts(tokenizer, args.prompts, length=64, start_fraction=1 / 3)


def end_to_end(args, target, draft, tokenizer, prompts, device, result, save, graph_costs) -> dict:
    """Sections 2 and 3; returns the best gamma with graphs by (batch, temperature)."""
    V = target.config.vocab_size
    max_batch = max(args.batches)
    engines = {("graphs", 0): Engine(target, tokenizer, cuda_graphs=True, max_batch_size=max_batch)}
    if args.rounds_per_read > 1:  # target-only reading back as rarely as the speculative blocks do
        engines[("blocks", 0)] = Engine(target, tokenizer, cuda_graphs=True, max_batch_size=max_batch,
                                        rounds_per_read=args.rounds_per_read)
    eager_gammas = args.gammas if args.eager_gammas is None else args.eager_gammas
    for g in eager_gammas:
        engines[("eager", g)] = Engine(target, tokenizer, ModelDrafter(draft, V, len(tokenizer)), gamma=g)
    for g in args.gammas:
        engines[("graphs", g)] = Engine(target, tokenizer, ModelDrafter(draft, V, len(tokenizer)), gamma=g,
                                        cuda_graphs=True, max_batch_size=max_batch)
        if args.rounds_per_read > 1:
            engines[("blocks", g)] = Engine(target, tokenizer, ModelDrafter(draft, V, len(tokenizer)), gamma=g,
                                            cuda_graphs=True, max_batch_size=max_batch,
                                            rounds_per_read=args.rounds_per_read)
    if not args.no_auto:
        engines[("graphs", "auto")] = Engine(target, tokenizer, ModelDrafter(draft, V, len(tokenizer)), gamma="auto",
                                             max_gamma=max(args.gammas), cuda_graphs=True, max_batch_size=max_batch)

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

    rows, theorem, theorem_engine = [], [], []
    result["e2e"], result["theorem_3_8_graphs"], result["theorem_3_8_engine"] = rows, theorem, theorem_engine
    # c on each speculative engine's own fixed-shape steps (its capacity, its buckets): what its
    # rounds replay, unlike capacity-256 graphs made for the measurement.
    engine_c = {}
    for (kind, g), e in engines.items():
        if kind in ("graphs", "blocks") and isinstance(g, int) and g > 0:
            cm = measure_costs(target, draft, g, reps=20, target_steps=e.target_steps, draft_steps=e.drafter.steps)
            engine_c[(kind, g)] = cm.draft_step_s / cm.verify_s[0]
            for steps in (e.target_steps, e.drafter.steps):  # emptied, as the engine keeps them between runs
                steps.new_batch(0)
    result["c_engine_graphs"] = [dict(kind=k, gamma=g, c=c) for (k, g), c in engine_c.items()]
    save()
    best_graphs_gamma = {}
    reference = ("graphs", 0) if args.no_loop else ("loop", 0)  # the greedy outputs every row must equal
    for B in args.batches:
        for T in args.temperatures:
            configs = ([] if args.no_loop else [("loop", 0)]) + list(engines)
            for kind, g in configs:  # warm-up: captures every graph this configuration needs
                run(kind, g, B, T, rep=0)
            times = {c: [] for c in configs}
            outputs, alphas = {}, {}
            block_rows, block_theorem = [], []
            for rep in range(args.repeats):  # interleaved; the rows are rewritten after every repeat
                for c in configs:
                    seconds, out, alpha = run(*c, B, T, rep)
                    times[c].append(seconds)
                    outputs[c], alphas[c] = out, alpha
                tokens = len(prompts) * args.new_tokens
                rate = {c: tokens / statistics.median(t) for c, t in times.items()}
                loop_rate = rate.get(("loop", 0))
                graphs_only = rate[("graphs", 0)]
                for r in block_rows:
                    rows.remove(r)
                for t in block_theorem:
                    theorem_engine.remove(t)
                block_rows, block_theorem = [], []
                for c in configs:
                    cadence = rate.get(("blocks" if c[0] == "blocks" else "graphs", 0))
                    same = outputs[c] == outputs[reference] if T == 0 else None
                    block_rows.append(dict(
                        batch=B, temperature=T, kind=c[0], gamma=c[1], tokens_per_s=round(rate[c], 1),
                        repeats=rep + 1, vs_eager_loop=round(rate[c] / loop_rate, 3) if loop_rate else None,
                        vs_graphs_target_only=round(rate[c] / graphs_only, 3),
                        vs_same_cadence_target_only=round(rate[c] / cadence, 3) if c[0] in ("graphs", "blocks")
                        else None,
                        alpha=alphas[c], **{f"greedy_equals_{reference[0]}": same}))
                    if B == 1 and c in engine_c:
                        a = alphas[c]
                        block_theorem.append(dict(temperature=T, kind=c[0], gamma=c[1], alpha=a, c=engine_c[c],
                                                  measured=rate[c] / cadence,
                                                  predicted=predicted_speedup(a, c[1], engine_c[c])))
                rows.extend(block_rows)
                theorem_engine.extend(block_theorem)
                save()
            best = {k: max(gs, key=lambda g: rate[(k, g)]) for k, gs in
                    (("eager", eager_gammas), ("graphs", args.gammas),
                     ("blocks", args.gammas if args.rounds_per_read > 1 else [])) if gs}
            best_graphs_gamma[(B, T)] = best["graphs"]
            base = loop_rate or graphs_only
            base_name = "eager loop" if loop_rate else "target-only with graphs"
            auto = "" if args.no_auto else (f"; auto with graphs {rate[('graphs', 'auto')]:.1f} "
                                             f"({rate[('graphs', 'auto')] / base:.2f}x)")
            if "blocks" in best:
                g = best["blocks"]
                auto += (f"; reading every {args.rounds_per_read} rounds: target-only {rate[('blocks', 0)]:.1f}, "
                         f"gamma {g} {rate[('blocks', g)]:.1f} ({rate[('blocks', g)] / rate[('blocks', 0)]:.2f}x "
                         f"target-only at that cadence)")
            eager = (f"specengine eager {rate[('eager', best['eager'])]:.1f} (gamma {best['eager']}, "
                     f"{rate[('eager', best['eager'])] / base:.2f}x); " if "eager" in best else "")
            loop = f"eager loop {loop_rate:.1f} tok/s; " if loop_rate else ""
            print(f"batch {B} T={T:g}: {loop}target-only with graphs {graphs_only:.1f}; "
                  f"{eager}with graphs {rate[('graphs', best['graphs'])]:.1f} "
                  f"(gamma {best['graphs']}, {rate[('graphs', best['graphs'])] / base:.2f}x the {base_name}){auto}")
            if B == 1 and graph_costs is not None:
                c_graph = graph_costs.draft_step_s / graph_costs.verify_s[0]
                for g in args.gammas:
                    a = alphas[("graphs", g)]
                    with_costs = graph_costs.tokens_per_second(a, g) * graph_costs.verify_s[0]
                    theorem.append(dict(temperature=T, gamma=g, alpha=a, measured=rate[("graphs", g)] / graphs_only,
                                        theorem_3_8=predicted_speedup(a, g, c_graph), with_verify_costs=with_costs))
            for t in (t for t in theorem_engine if t["temperature"] == T and B == 1):
                print(f"  Theorem 3.8, {t['kind']} gamma {t['gamma']} (alpha {t['alpha']:.3f}, c {t['c']:.3f} on the "
                      f"engine's graphs): predicted {t['predicted']:.2f}x, measured {t['measured']:.2f}x over "
                      f"target-only at the same cadence")
            save()
    if any(r.get(f"greedy_equals_{reference[0]}") is False for r in rows):
        print(f"WARNING: some greedy outputs differ from the {reference[0]} outputs")
    return best_graphs_gamma


def phases(args, target, draft, tokenizer, prompts, best_graphs_gamma, result, save):
    """Section 4: the host's share of a round with graphs at batch 1."""
    V = target.config.vocab_size
    g = best_graphs_gamma.get((args.batches[0], args.temperatures[0]), args.gammas[0])
    timed = Engine(target, tokenizer, ModelDrafter(draft, V, len(tokenizer)), gamma=g, cuda_graphs=True,
                   max_batch_size=max(args.batches), time_phases=True)
    timed.generate(prompts[:1], SamplingParams(max_new_tokens=8, temperature=0))
    timed.generate(prompts[:1], SamplingParams(max_new_tokens=args.new_tokens, temperature=0, ignore_eos=True))
    ph = timed.last_run_phases
    loop = ph["total"] - ph["prefill"]
    result["graphs_batch1_gamma"] = g
    result["graphs_batch1_phases_ms"] = {k: 1e3 * v / timed.last_run_rounds for k, v in ph.items()}
    result["graphs_batch1_host_share"] = ph["host"] / loop
    ms = result["graphs_batch1_phases_ms"]
    print(f"graphs, batch 1, gamma {g}: round {1e3 * loop / timed.last_run_rounds:.3f} ms = draft {ms['draft']:.3f} + "
          f"verify {ms['verify']:.3f} + accept {ms['accept']:.3f} + host {ms['host']:.3f} "
          f"(host {100 * ph['host'] / loop:.1f}%)")
    for name, steps in (("target", timed.target_steps), ("draft", timed.drafter.steps)):
        result[f"{name}_graph_fallback"] = steps.fallback_reason
        if steps.fallback_reason:
            print(f"{name} graphs fell back to eager: {steps.fallback_reason}")
    save()

if __name__ == "__main__":
    main()
