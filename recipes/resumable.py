"""What the training recipes share: a wall-clock budget, resumed from a checkpoint, with a
learning rate that warms up and then follows a cosine over the budget (so a run of any length
ends annealed), and batches of sequences of similar length drawn from shards."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch


def resume(ckpt: Path, model, opt, device) -> dict:
    """Load the model and optimiser from this recipe's own checkpoint (weights_only) if there is
    one; the training state (step, elapsed seconds, tokens, ...) it saved, or a fresh one."""
    if not ckpt.is_file():
        return dict(step=0, elapsed=0.0, tokens=0)
    saved = torch.load(ckpt, map_location=device, weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    return saved["state"]


def save(ckpt: Path, model, opt, state: dict):
    torch.save(dict(model=model.state_dict(), opt=opt.state_dict(), state=state), ckpt)


def set_lr(opt, lr: float, state: dict, budget_s: float, warmup_steps: int, floor: float):
    """lr after a linear warm-up, then a cosine from lr down to floor * lr over the budget."""
    warm = min(1.0, (state["step"] + 1) / warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * state["elapsed"] / budget_s))
    for group in opt.param_groups:
        group["lr"] = lr * warm * (floor + (1 - floor) * cosine)


def batches_of(seqs, max_tokens: int, seq_cap: int, rng: np.random.Generator):
    """Batches of about max_tokens (length-sorted buckets, shuffled), forever."""
    while True:
        order = rng.permutation(len(seqs))
        buckets = [sorted(order[i: i + 512], key=lambda j: len(seqs[j][0])) for i in range(0, len(order), 512)]
        groups = []
        for bucket in buckets:
            group, longest = [], 0
            for j in bucket:
                L = min(len(seqs[j][0]), seq_cap)
                if group and max(longest, L) * (len(group) + 1) > max_tokens:
                    groups.append(group)
                    group, longest = [], 0
                group.append(j)
                longest = max(longest, L)
            if group:
                groups.append(group)
        for g in rng.permutation(len(groups)):
            yield [seqs[j] for j in groups[g]]
