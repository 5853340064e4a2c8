"""An EAGLE-3 head trained by recipes/train_eagle3.py, through the engine: greedy output equal to
target-only on chat requests, and acceptance by draft position as the engine counts it (per
round) beside the recipe's teacher-forced rule on the same answers (every answer position a
chain start), so that a difference between training and inference shows.

    OMP_NUM_THREADS=1 python bench/check_eagle3_head.py --head /work/eagle3-trial/head \
        --requests /work/eagle3-trial/work/requests.json

Not a speed benchmark: the times it prints are for orientation only.
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
from eagle3_head import Eagle3Head  # noqa: E402


def recipe_head(folder: Path, model) -> Eagle3Head:
    """The exported head read back into the recipe's module (float32 of its stored weights)."""
    from safetensors.torch import load_file

    from specengine.models.eagle3 import Eagle3Config

    cfg = Eagle3Config.from_dict(json.loads((folder / "config.json").read_text()), model.config.num_layers)
    head = Eagle3Head(cfg, train_eagle3.dense_rows(model.model.embed_tokens, cfg.vocab_size))
    head.load_state_dict({k: v.float() if v.is_floating_point() else v
                          for k, v in load_file(folder / "model.safetensors").items()})
    return head.eval()


@torch.no_grad()
def teacher_forced(head: Eagle3Head, model, prompts: list[list[int]], answers: list[list[int]], steps: int):
    """The recipe's T=0 rule on these answers: per position j, the share of chains (one from every
    answer position whose steps fit) whose drafts 1..j all equal the target's argmax."""
    hits, chains = np.zeros(steps), 0
    for prompt, answer in zip(prompts, answers):
        seq = np.array(prompt + answer, dtype=np.int32)
        aux, _, argmax = train_eagle3.features_of(model, [seq])[0]
        T = len(seq)
        tokens = torch.from_numpy(seq.astype(np.int64))[None]
        drafts = [head.draft_ids[head.logits(h[0]).argmax(-1)]
                  for h in head.ttt(aux[None], tokens, torch.ones(1, T, dtype=torch.bool), steps)]
        for t in range(len(prompt) - 2, T - steps - 1):  # chain t first predicts token t + 2
            alive = True
            for j in range(steps):
                alive = alive and int(drafts[j][t]) == int(argmax[t + j + 1])
                hits[j] += alive
            chains += 1
    return chains, [round(float(h) / max(chains, 1), 4) for h in hits]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", type=Path, required=True)
    parser.add_argument("--requests", type=Path, required=True, help="a recipe run's requests.json (its held-out ones are used)")
    parser.add_argument("--target", type=Path, help="default: specengine.shipped.default_target()")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=96)
    args = parser.parse_args(argv)
    from specengine import Engine, SamplingParams
    from specengine.shipped import default_target

    target = args.target or default_target()
    requests = [r["turns"][0] for r in json.loads(args.requests.read_text())["heldout"]]
    plain = Engine.from_pretrained(target)
    eagle = Engine.from_pretrained(target, args.head, drafter="eagle3", gamma=args.gamma)
    chats = [eagle.chat_prompt([{"role": "user", "content": r}]) for r in requests]
    greedy = SamplingParams(max_new_tokens=args.max_new, temperature=0)
    t0 = time.time()
    base = [r.token_ids for r in plain.generate(chats, greedy)]
    t1 = time.time()
    outs = eagle.generate(chats, greedy)
    t2 = time.time()
    stats = eagle.last_run_stats
    figures = dict(requests=len(chats), max_new=args.max_new, gamma=args.gamma,
                   greedy_equal=sum(o.token_ids == b for o, b in zip(outs, base)),
                   seconds=dict(target_only=round(t1 - t0, 1), eagle3=round(t2 - t1, 1)),
                   engine_t0=dict(rounds=stats.drafted_by_position[0],
                                  acceptance_by_position=[round(a, 4) for a in stats.acceptance_by_position],
                                  tokens_per_round=round(stats.tokens_per_round, 3)))
    model = train_eagle3.load_target(target, list(eagle.drafter.feature_layers))
    chains, by_position = teacher_forced(recipe_head(args.head, model), model, chats, [o.token_ids for o in outs],
                                         args.gamma)
    figures["teacher_forced_t0"] = dict(chains=chains, accept_by_position=by_position)
    eagle.generate(chats, [SamplingParams(max_new_tokens=args.max_new, temperature=1.0, seed=i)
                           for i in range(len(chats))])
    stats = eagle.last_run_stats
    figures["engine_t1"] = dict(rounds=stats.drafted_by_position[0],
                                acceptance_by_position=[round(a, 4) for a in stats.acceptance_by_position])
    figures["load_average"] = round(os.getloadavg()[0], 2)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
