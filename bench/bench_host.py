"""The host's part of a round: torch ops dispatched and reads from the device per round, outside
graph replays (specengine.devtools.host_ops), on the fixed-shape path that CUDA graphs replay.

    python bench/bench_host.py [--device cpu|cuda] [--new-tokens 48] [--out bench/results/host-<date>.json]

Rows: target-only and speculative (gamma 3) rounds, at batch 1 and 8, read back every round
(rounds_per_read 1) and in blocks of 4 rounds from device state (rounds_per_read 4; each round one
graphed call, and the rounds inside blocks also counted apart), on the shipped pair at
temperature 1. On a CPU the graphs' bodies run eagerly and are left out of the count as
replays are on a GPU, so the counts are the same on both. tests/test_host_ops.py bounds them.
"""
from __future__ import annotations

import argparse
import datetime

import torch

from specengine import Engine, SamplingParams
from specengine.devtools.benchmark import machine_name
from specengine.devtools.host_ops import per_round
from specengine.shipped import shipped_pair

from common import write_json


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--out")
    args = parser.parse_args()
    target, draft = shipped_pair()
    rows = []
    for gamma in (0, 3):
        for rounds_per_read in (1, 4):
            engine = Engine.from_pretrained(target, draft if gamma else None, gamma=gamma or 5, device=args.device,
                                            cuda_graphs=True, max_batch_size=8, rounds_per_read=rounds_per_read)
            for batch in (1, 8):
                params = [SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=i, ignore_eos=True)
                          for i in range(batch)]
                counts = per_round(engine, [[40 + i, 41, 42, 43] for i in range(batch)], params)
                row = dict(kind="speculative" if gamma else "target-only", gamma=gamma,
                           rounds_per_read=rounds_per_read, batch=batch, **counts)
                rows.append(row)
                inside = (f"; inside blocks {counts['block_ops_per_round']:.1f} ops per round, "
                          f"{counts['reads_per_block']:.0f} read per block ({counts['block_rounds']} rounds)"
                          if "block_rounds" in counts else "")
                print(f"{row['kind']:11s} gamma {gamma} rounds_per_read {rounds_per_read} batch {batch}: "
                      f"{counts['ops_per_round']:6.1f} ops, {counts['reads_per_round']:.2f} reads per round "
                      f"({counts['rounds']} rounds){inside}", flush=True)
    write_json(dict(machine=machine_name(args.device), date=datetime.date.today().isoformat(), torch=torch.__version__,
                    rows=rows), args.out, f"host-{args.device}-{datetime.date.today().isoformat()}.json")


if __name__ == "__main__":
    main()
