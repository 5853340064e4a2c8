"""A draft with a tokenizer of its own: the shipped pycode draft (8,192 tokens, trained on the
standard library's Python) against the default target (SmolLM2-135M-Instruct, 49,152 tokens),
beside target-only decoding and the default pair's draft (the target's tokenizer), greedy, one
request at a time, on chat requests and on code-editing requests (bench_code_edit.py's).

    python bench/bench_cross_vocab.py [--requests 8] [--new-tokens 64] [--repeats 3] [--gamma auto]

Reports each engine's tokens per second and acceptance rate per request set, the pair's share of
shared tokens, and whether greedy output is identical across the engines (the exit status is 1
otherwise). The engines take turns over each set, in an order that reverses each repeat; each
figure is the median over repeats.
"""
from __future__ import annotations

import argparse
import datetime

from specengine import Engine, SamplingParams, default_pair
from specengine.devtools.benchmark import machine_name
from specengine.shipped import DRAFT_DIR

from bench_code_edit import EDITS, edit_requests
from common import CHAT_REQUESTS, Turns, write_json


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8, help="per set (at most 8)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gamma", default="auto", help="drafts per round for both drafts, or auto")
    parser.add_argument("--target", help="the target (default: the default pair's)")
    parser.add_argument("--draft", help="the cross-vocabulary draft (default: the pycode draft)")
    parser.add_argument("--out")
    args = parser.parse_args()
    gamma = args.gamma if args.gamma == "auto" else int(args.gamma)
    pair_target, pair_draft = default_pair()
    target, cross_draft = args.target or pair_target, args.draft or DRAFT_DIR
    engines = {"target-only": Engine.from_pretrained(target),
               "default draft (same tokenizer)": Engine.from_pretrained(target, pair_draft, gamma=gamma),
               "pycode draft (own tokenizer)": Engine.from_pretrained(target, cross_draft, gamma=gamma)}
    vocab = engines["pycode draft (own tokenizer)"].drafter.vocab
    print(f"{cross_draft}: {vocab.num_shared} tokens shared with the target, {vocab.share:.0%} of a sample text's")
    chat = engines["target-only"]
    sets = {"chat": CHAT_REQUESTS[:args.requests], "code edit": edit_requests(min(args.requests, len(EDITS)))}
    prompts = {name: [chat.chat_prompt([{"role": "user", "content": text}]) for text in texts]
               for name, texts in sets.items()}
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)
    for engine in engines.values():  # warm-up (and gamma="auto"'s costs)
        engine.generate([prompts["chat"][0]], SamplingParams(max_new_tokens=8, temperature=0.0))
    turns = Turns(key_width=42)
    for repeat in range(args.repeats):
        for set_name, set_prompts in prompts.items():
            for name in turns.order(engines, repeat):
                turns.timed_pass(repeat, f"{set_name}: {name}", engines[name], set_prompts, params, set_name)
    same = turns.same
    result = dict(date=datetime.date.today().isoformat(), machine=machine_name(), target=str(target),
                  cross_vocab_draft=str(cross_draft), same_tokenizer_draft=str(pair_draft), gamma=args.gamma,
                  new_tokens=args.new_tokens, requests=len(sets["chat"]), repeats=args.repeats, batch=1,
                  shared_tokens=vocab.num_shared, share=vocab.share,
                  **turns.summary(baseline_of=lambda key: key.split(": ")[0] + ": target-only"),
                  greedy_identical=same)
    print(f"greedy identical across engines: {same}")
    write_json(result, args.out, f"cross-vocab-{result['date']}.json")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
