"""The EAGLE-3 recipe's features stage: the runtime's target (what recipes/train_eagle3.py runs now)
against transformers' float32 load of the same file (what it ran before), on taught sequences.

    OMP_NUM_THREADS=1 nice -n 19 python bench/bench_eagle3_features.py --work /work/eagle3-trial/work --threads 1

Both run on every teach shard of --work in turn (which goes first alternates from shard to
shard, so a change in the machine's load falls on both), each as its stage runs it: the
runtime a sequence a forward (no padding), transformers in batches of up to --batch-tokens
padded tokens, sequences by length; with --grouped the runtime takes the same batches. Each
shard's wall time per path is printed, and the paths' outputs compared: the captured states and
final hidden (relative to each row's largest magnitude), the argmax, and the bfloat16 values
the stage stores.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "recipes"))
import train_eagle3  # noqa: E402


def transformers_target(target: Path):
    """transformers' own load of the file, dequantized to float32 (the stage's former path)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target.parent, gguf_file=target.name, dtype=torch.float32).eval()


@torch.inference_mode()
def transformers_features(model, seqs: list[np.ndarray], aux_layers: list[int]):
    """The former stage's features: output_hidden_states[i] for i in aux_layers, the last (normed) state, argmax."""
    B, T = len(seqs), max(len(s) for s in seqs)
    ids, mask = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.from_numpy(s.astype(np.int64))
        mask[b, : len(s)] = 1
    states = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    aux, final = torch.cat([states[i] for i in aux_layers], -1), states[-1]
    argmax = torch.cat([model.lm_head(final[:, i: i + 128]).argmax(-1) for i in range(0, T, 128)], 1)
    return [(aux[b, : len(s)], final[b, : len(s)], argmax[b, : len(s)]) for b, s in enumerate(seqs)]


def groups(seqs: list[np.ndarray], batch_tokens: int) -> list[list[int]]:
    """The stage's batches: sequences by length, as many as fit batch_tokens padded tokens."""
    out, group = [], []
    for i in sorted(range(len(seqs)), key=lambda i: len(seqs[i])):
        if group and len(seqs[i]) * (len(group) + 1) > batch_tokens:
            out.append(group)
            group = []
        group.append(i)
    return out + [group] if group else out


def run(fn, seqs, batch_tokens):
    results = [None] * len(seqs)
    t0 = time.perf_counter()
    for group in groups(seqs, batch_tokens) if batch_tokens else [[i] for i in range(len(seqs))]:
        for j, r in zip(group, fn([seqs[j] for j in group])):
            results[j] = r
    return time.perf_counter() - t0, results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="a recipe run's folder (its teach/ shards)")
    parser.add_argument("--target", type=Path, help="default: specengine.shipped.default_target()")
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--grouped", action="store_true", help="the runtime in the same padded batches")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="a JSON file for the figures")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from specengine.models.eagle3 import default_feature_layers
    from specengine.shipped import default_target

    target = args.target or default_target()
    aux_layers = list(default_feature_layers(train_eagle3.target_config(target).num_layers))
    t0 = time.perf_counter()
    ours = train_eagle3.load_target(target, aux_layers)
    load_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs = transformers_target(target)
    load_theirs = time.perf_counter() - t0
    embed_equal = bool(torch.equal(train_eagle3.dense_rows(ours.model.embed_tokens, ours.config.vocab_size),
                                   theirs.model.embed_tokens.weight))
    print(f"loads: runtime {load_ours:.1f} s, transformers {load_theirs:.1f} s; embeddings equal: {embed_equal}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    paths = {"runtime": lambda seqs: train_eagle3.features_of(ours, seqs),
             "transformers": lambda seqs: transformers_features(theirs, seqs, aux_layers)}
    seconds, tokens = {k: 0.0 for k in paths}, 0
    worst = dict(aux=0.0, final=0.0)
    argmax_equal = stored_equal = stored_total = 0
    for n, shard in enumerate(sorted((args.work / "teach").glob("*.npz"))):
        seqs = [s["tokens"] for s in train_eagle3.load_teach([shard])]
        order = list(paths) if n % 2 == 0 else list(reversed(paths))
        got = {}
        for name in order:
            grouped = name == "transformers" or args.grouped
            dt, got[name] = run(paths[name], seqs, args.batch_tokens if grouped else 0)
            seconds[name] += dt
        tokens += sum(len(s) for s in seqs)
        for (a, f, m), (a2, f2, m2) in zip(got["runtime"], got["transformers"]):
            for key, x, y in (("aux", a, a2), ("final", f, f2)):
                scale = y.abs().amax(-1, keepdim=True).clamp_min(1e-30)
                worst[key] = max(worst[key], float(((x - y).abs() / scale).max()))
            argmax_equal += int((m == m2).sum())
            stored_equal += int((a.to(torch.bfloat16) == a2.to(torch.bfloat16)).sum())
            stored_total += a.numel()
        print(f"{shard.stem}: {len(seqs)} sequences; runtime {seconds['runtime']:.1f} s, transformers "
              f"{seconds['transformers']:.1f} s so far ({tokens} tokens); load average {os.getloadavg()[0]:.2f}",
              flush=True)
    figures = dict(tokens=tokens, threads=args.threads, runtime_grouped=args.grouped, seconds={k: round(v, 1) for k, v in seconds.items()},
                   tokens_per_s={k: round(tokens / v, 1) for k, v in seconds.items()},
                   speedup=round(seconds["transformers"] / seconds["runtime"], 2),
                   load_seconds=dict(runtime=round(load_ours, 1), transformers=round(load_theirs, 1)),
                   max_relative_difference=worst, argmax_equal=argmax_equal, positions=tokens,
                   stored_bf16_equal_share=round(stored_equal / stored_total, 5), embeddings_equal=embed_equal)
    print(json.dumps(figures, indent=1))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
