"""The suffix drafter's own cost per round (its trees' updates and lookups, and the proposal's
tensors), against a draft model's step.

    python bench/bench_suffix.py [--prompt-tokens 500] [--new-tokens 256] [--gamma 4] [--no-draft-step]
                                 [--out bench/results/suffix-lookup-<date>.json]

Rows of real text (Python standard-library files, tokenized by the default target's tokenizer;
random tokens of its vocabulary size if it is not installed) at batch 1 and 8: each row's prompt
is `prompt-tokens` tokens of a file and its output the file's next `new-tokens` tokens. Each round
the drafter proposes up to gamma tokens and the row gains the drafts that match the text plus one
token, as greedy verification against that text would. Two passes over the same requests: fresh
(the global tree holds nothing of them) and recurring (it holds the first pass's outputs). Timed:
propose() per round (first rounds, which index the prompts, apart), learning the finished outputs
(keep_rows), and the global tree's memory per token. With the default pair installed, one draft-
model step (forward and sampling, engine.costs.measure_costs) at the same batch sizes.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import sysconfig
import time
import tracemalloc
from pathlib import Path

import torch

from specengine.devtools.benchmark import machine_name
from specengine.drafters.suffix import SuffixDrafter

from common import write_json

FILES = ["argparse.py", "textwrap.py", "difflib.py", "inspect.py", "typing.py", "dataclasses.py", "json/decoder.py",
         "logging/__init__.py", "functools.py", "pathlib.py", "pathlib/_local.py", "collections/__init__.py",
         "subprocess.py", "tarfile.py", "email/message.py", "http/client.py"]  # those this Python has


def texts(count: int, length: int) -> tuple[list[list[int]], str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    try:
        from specengine.shipped import default_target
        from specengine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(default_target())
        docs = [tokenizer((root / f).read_text())["input_ids"] for f in FILES if (root / f).is_file()]
        docs = [d for d in docs if len(d) >= length]
        source = "standard-library files, the default target's tokenizer"
    except Exception as exc:  # noqa: BLE001 (no default target here: random tokens)
        g = torch.Generator().manual_seed(0)
        docs = [torch.randint(0, 49152, (length,), generator=g).tolist() for _ in range(count)]
        source = f"random tokens of 49152 ({type(exc).__name__}: {exc})"
    return [docs[i % len(docs)][(i // len(docs)) * 97:][:length] for i in range(count)], source


class Sampling:  # what propose() reads of a SamplingBatch: the device
    def __init__(self, rows: int):
        self.seeds = torch.zeros(rows, dtype=torch.int64)


def run_pass(drafter: SuffixDrafter, requests: list[list[int]], prompt_tokens: int, new_tokens: int, gamma: int):
    """Decode every request (one batch) against its text; the seconds of each propose() call."""
    rows = len(requests)
    drafter.join_rows([r[:prompt_tokens] for r in requests], prompt_tokens + new_tokens + gamma + 1)
    sequences = [r[:prompt_tokens] for r in requests]
    sampling = Sampling(rows)
    first, rounds, drafted, accepted, calls = None, [], 0, 0, 0
    while len(sequences[0]) < prompt_tokens + new_tokens:
        budgets = [min(gamma, prompt_tokens + new_tokens - len(s) - 1) for s in sequences]
        if max(budgets) > 0:
            t0 = time.perf_counter()
            proposal = drafter.propose(sequences, budgets, sampling)
            seconds = time.perf_counter() - t0
            if first is None:
                first = seconds
            else:
                rounds.append(seconds)
            num = proposal.num_drafts.tolist()
            tokens = proposal.tokens.tolist()
        else:
            num, tokens = [0] * rows, [[] for _ in range(rows)]
        calls += 1
        for b, (seq, text) in enumerate(zip(sequences, requests)):
            k = 0
            while k < num[b] and tokens[b][k] == text[len(seq) + k]:
                k += 1
            drafted += num[b]
            accepted += k
            seq += text[len(seq):len(seq) + k + 1]
    t0 = time.perf_counter()
    drafter.keep_rows([])  # the requests finish: their outputs are learned
    learn = time.perf_counter() - t0
    return dict(first_round_us=round(first * 1e6, 1), round_us_median=round(statistics.median(rounds) * 1e6, 1),
                round_us_p90=round(sorted(rounds)[int(0.9 * len(rounds))] * 1e6, 1),
                round_us_per_row=round(statistics.median(rounds) * 1e6 / rows, 1), rounds=calls,
                tokens_per_round=round(new_tokens / calls, 2), alpha=round(accepted / drafted, 3) if drafted else None,
                learn_us_per_output=round(learn * 1e6 / rows, 1))


def global_memory(requests: list[list[int]], prompt_tokens: int) -> float:
    """Bytes per token of a global tree holding these outputs."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    drafter = SuffixDrafter()
    for r in requests:
        drafter.learn(list(r[prompt_tokens - drafter.context_tokens:]))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / drafter.global_tokens


def draft_steps(batches) -> dict:
    from specengine.engine.costs import measure_costs
    from specengine.models import load_model
    from specengine.shipped import default_pair

    target_dir, draft_dir = default_pair()
    target, draft = load_model(target_dir), load_model(draft_dir)
    out = {}
    for b in batches:
        costs = measure_costs(target, draft, 1, batch_size=b)
        out[b] = dict(draft_step_us=round(costs.draft_step_s * 1e6, 1),
                      target_step_us=round(costs.verify_s[0] * 1e6, 1))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--no-draft-step", action="store_true", help="skip timing the default draft's step")
    parser.add_argument("--out")
    args = parser.parse_args()
    length = args.prompt_tokens + args.new_tokens
    requests, source = texts(8, length)
    result = dict(date=datetime.date.today().isoformat(), machine=machine_name(), text=source, gamma=args.gamma,
                  prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, rows=[])
    for batch in (1, 8):
        drafter = SuffixDrafter()
        for name in ("fresh", "recurring"):
            row = dict(batch=batch, requests=name,
                       **run_pass(drafter, [list(r) for r in requests[:batch]], args.prompt_tokens, args.new_tokens,
                                  args.gamma))
            result["rows"].append(row)
            print(row)
    result["global_bytes_per_token"] = round(global_memory(requests, args.prompt_tokens), 1)
    print(f"global tree: {result['global_bytes_per_token']} bytes per token")
    if not args.no_draft_step:
        try:
            result["model_steps"] = draft_steps((1, 8))
            print("default pair, one step:", result["model_steps"])
        except FileNotFoundError as exc:
            print(f"no default pair: {exc}")
    write_json(result, args.out, f"suffix-lookup-{result['date']}.json")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
