"""Step costs and where a round's time goes: the measurements behind Theorem 3.8, on CPU or CUDA.

    python bench/bench_costs.py [--device cuda] [--big-layers 22] [--out costs.json]

1. The shipped pair on the device: the target's call on k = 1..9 tokens and one draft step, at
   batch 1 and 8 (medians; synchronised on CUDA); c = draft step / target step.
2. The pair's alpha at gamma 4 (temperature 0 and 1) and the engine's time per round by phase
   (draft, verify = the target's forward, accept = the fused verify kernel, host = the rest of
   the loop) at batch 1 and 8: the host's share is the overhead a CUDA graph can remove.
3. A memory-bound target: the shipped target embedded in a Llama of about 1B parameters (d 2048,
   ffn 5632, 22 layers, models.widen: same logits, so the same alpha; bfloat16 on CUDA,
   bfloat16-stored matrices with float32 compute on CPU): its costs for k = 1..9 tokens, and the
   speedup Theorem 3.8 predicts for the pycode draft proposing to it at the pair's alpha (and the
   cost model's prediction with the measured verification costs). bench_graphs.py --target
   widened measures that speedup end to end. --big-layers sets its depth (0 skips it).
Results are rewritten after every measurement, so a run cut short keeps what it measured. Each
model's triton_fallback_reason is recorded (None: the Triton step kernels ran where the model
takes them, on CUDA); on CUDA a fallback ends the run with exit status 1.
"""
from __future__ import annotations

import argparse
import datetime
import sys

import torch

from specengine import Engine, SamplingParams
from specengine.devtools.benchmark import machine_name
from specengine.engine.costs import measure_costs
from specengine.engine.gamma import CostModel, predicted_speedup
from specengine.models.widen import widen
from specengine.shipped import heldout_prompts, shipped_pair

from common import write_json


def phases_per_round(engine: Engine, prompt_batches, temperature: float) -> dict:
    totals, rounds, accepted, tested = {}, 0, 0, 0
    for i, batch in enumerate(prompt_batches):
        params = [SamplingParams(max_new_tokens=64, temperature=temperature, seed=100 * i + j, ignore_eos=True)
                  for j in range(len(batch))]
        engine.generate(batch, params)
        s = engine.last_run_stats
        rounds += engine.last_run_rounds
        accepted += s.accepted
        tested += s.accepted + s.rejections
        for name, seconds in engine.last_run_phases.items():
            totals[name] = totals.get(name, 0.0) + seconds
    loop = totals["total"] - totals["prefill"]
    per_round = {k: 1e3 * totals[k] / rounds for k in ("draft", "verify", "accept", "host")}
    return dict(alpha=accepted / tested, rounds=rounds, round_ms=1e3 * loop / rounds, ms_per_round=per_round,
                host_share=totals["host"] / loop)


def widened_target(target, layers: int):
    """The shipped target embedded in a Llama of about 1B parameters (d 2048, ffn 5632, 32 heads, 8 kv
    heads; `layers` deep): a memory-bound step with the shipped target's logits (models.widen)."""
    return widen(target, hidden_size=2048, intermediate_size=5632, num_heads=32, num_kv_heads=8, num_layers=layers)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--big-layers", type=int, default=22)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--out", default=None, help="JSON path (default: bench/results/costs-<device>-<date>.json)")
    args = parser.parse_args()
    device = torch.device(args.device)
    target_dir, draft_dir = shipped_pair()
    engine = Engine.from_pretrained(target_dir, draft_dir, gamma=4, device=str(device), time_phases=True)
    target, draft = engine.target, engine.drafter.model
    result = dict(date=datetime.date.today().isoformat(), machine=machine_name(device), torch=torch.__version__,
                  device=device.type)
    models = dict(target=target, draft=draft)

    def save():
        """Write the results; on CUDA, stop at the first fallback of the Triton kernels."""
        for name, model in models.items():
            result[f"{name}_triton_fallback"] = model.triton_fallback_reason
        write_json(result, args.out, f"costs-{device.type}-{result['date']}.json")
        fell = [f"{n}: {m.triton_fallback_reason}" for n, m in models.items() if m.triton_fallback_reason]
        if fell and device.type == "cuda":
            print("the Triton step kernels fell back to the torch path: " + "; ".join(fell))
            sys.exit(1)

    costs = {}
    for B in (1, 8):
        cm = measure_costs(target, draft, 8, batch_size=B)
        costs[B] = cm
        result[f"pair_costs_batch{B}"] = dict(target_ms=[1e3 * t for t in cm.verify_s], draft_ms=1e3 * cm.draft_step_s,
                                              c=cm.draft_step_s / cm.verify_s[0])
        print(f"batch {B}: target ms for k=1..9 tokens {[round(1e3 * t, 2) for t in cm.verify_s]}, "
              f"draft {1e3 * cm.draft_step_s:.2f} ms, c = {cm.draft_step_s / cm.verify_s[0]:.3f}")
        save()

    prompts = heldout_prompts(engine.tokenizer, args.prompts, length=64, start_fraction=1 / 3)
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=8, temperature=0))  # warm-up
    alpha = {}
    for T in (0.0, 1.0):
        for B, batches in ((1, [[p] for p in prompts[:4]]), (8, [prompts[:8]])):
            r = phases_per_round(engine, batches, T)
            result[f"phases_T{T:g}_batch{B}"] = r
            alpha.setdefault(T, r["alpha"])
            ms = r["ms_per_round"]
            print(f"T={T:g} batch {B}: alpha {r['alpha']:.3f}, round {r['round_ms']:.2f} ms = draft {ms['draft']:.2f} + "
                  f"verify {ms['verify']:.2f} + accept {ms['accept']:.2f} + host {ms['host']:.2f} "
                  f"(host {100 * r['host_share']:.1f}%)")
            save()

    if args.big_layers > 0:
        big = models["big_target"] = widened_target(target, args.big_layers)
        n_params = sum(p.numel() for p in big.parameters())
        big_costs = measure_costs(big, None, 8, batch_size=1)
        model = CostModel(costs[1].draft_step_s, big_costs.verify_s)
        c = model.draft_step_s / model.verify_s[0]
        predictions = {}
        for T, a in alpha.items():
            rows = [dict(gamma=g, theorem_3_8=predicted_speedup(a, g, c),
                         with_verify_costs=model.tokens_per_second(a, g) * model.verify_s[0]) for g in range(1, 9)]
            best = max(rows, key=lambda r: r["with_verify_costs"])
            predictions[f"T={T:g}"] = dict(alpha=a, rows=rows, best=best)
            print(f"~{n_params / 1e9:.2f}B target, T={T:g} (alpha {a:.3f}): best gamma {best['gamma']}, "
                  f"Theorem 3.8 {best['theorem_3_8']:.2f}x, with measured verify costs {best['with_verify_costs']:.2f}x")
        result["big_target"] = dict(parameters=n_params, layers=args.big_layers,
                                    target_ms=[1e3 * t for t in big_costs.verify_s], c=c, predictions=predictions)
        print(f"~{n_params / 1e9:.2f}B target ms for k=1..9 tokens {[round(1e3 * t, 2) for t in big_costs.verify_s]}, "
              f"c = {c:.4f}")

    save()


if __name__ == "__main__":
    main()
