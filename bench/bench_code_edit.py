"""Code editing on the default target: "rewrite this function so that ..." requests built from real
functions of the running interpreter's standard library, greedy, one request at a time, decoded by
target-only decoding, the n-gram (prompt lookup) drafter, the suffix drafter and the default pair's
draft model; optionally (--cross-vocab) also the pycode draft, which has a tokenizer of its own.

    python bench/bench_code_edit.py [--requests 8] [--new-tokens 128] [--repeats 3] [--gamma auto]

An edit copies most of its input, which is what prompt lookup and suffix decoding draft from.
Greedy output must be identical across the engines (checked: the exit status is 1 otherwise).
The engines take turns over the whole set, in an order that reverses each repeat; each figure is
the median over repeats. The suffix engine is new each repeat (its global tree empty), so no
repeat drafts from an earlier repeat's outputs.
"""
from __future__ import annotations

import argparse
import calendar
import colorsys
import datetime
import fnmatch
import html
import inspect
import shlex
import string
import textwrap
import urllib.parse

from specengine import Engine, SamplingParams, default_pair
from specengine.devtools.benchmark import machine_name
from specengine.shipped import DRAFT_DIR

from common import Turns, write_json

# (function, the change asked for): short pure-Python functions whose source ships with Python.
EDITS = [
    (shlex.quote, "it also accepts bytes, decoding them as UTF-8 first"),
    (textwrap.indent, "the prefix defaults to four spaces"),
    (fnmatch.filter, "it returns a set instead of a list"),
    (colorsys.rgb_to_hsv, "it returns the hue in degrees, from 0 to 360"),
    (calendar.leapdays, "it raises ValueError when y1 is greater than y2"),
    (string.capwords, "it keeps the original spacing between words"),
    (html.escape, "it also escapes backslashes as &#x5C;"),
    (urllib.parse.urldefrag, "it returns a plain tuple instead of a DefragResult"),
]


def edit_requests(limit: int | None = None) -> list[str]:
    """The requests' texts: the change, then the function's source."""
    return [f"Rewrite this function so that {change}. Reply with the complete new function only.\n\n"
            f"```python\n{inspect.getsource(fn)}```" for fn, change in EDITS[:limit]]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=len(EDITS), help=f"at most {len(EDITS)}")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gamma", default="auto", help="drafts per round for every drafter, or auto")
    parser.add_argument("--cross-vocab", action="store_true", help="also the pycode draft (its own tokenizer)")
    parser.add_argument("--target", help="the target (default: the default pair's)")
    parser.add_argument("--draft", help="the draft model (default: the default pair's)")
    parser.add_argument("--out")
    args = parser.parse_args()
    gamma = args.gamma if args.gamma == "auto" else int(args.gamma)
    pair_target, pair_draft = default_pair()
    target, draft = args.target or pair_target, args.draft or pair_draft
    makers = {
        "target-only": lambda: Engine.from_pretrained(target),
        "ngram": lambda: Engine.from_pretrained(target, drafter="ngram", gamma=gamma),
        "suffix": lambda: Engine.from_pretrained(target, drafter="suffix", gamma=gamma),
        "model draft": lambda: Engine.from_pretrained(target, draft, gamma=gamma),
    }
    if args.cross_vocab:
        makers["pycode draft (own tokenizer)"] = lambda: Engine.from_pretrained(target, DRAFT_DIR, gamma=gamma)
    engines = {name: None if name == "suffix" else make() for name, make in makers.items()}  # suffix: each repeat
    chat = engines["target-only"]
    prompts = [chat.chat_prompt([{"role": "user", "content": text}]) for text in edit_requests(args.requests)]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)
    for engine in filter(None, engines.values()):  # warm-up (and gamma="auto"'s costs)
        engine.generate([prompts[0][:32]], SamplingParams(max_new_tokens=8, temperature=0.0))
    turns = Turns(key_width=28)
    for repeat in range(args.repeats):
        engines["suffix"] = makers["suffix"]()  # an empty global tree each repeat
        engines["suffix"].generate([prompts[0][:32]], SamplingParams(max_new_tokens=8, temperature=0.0))
        for name in turns.order(engines, repeat):
            turns.timed_pass(repeat, name, engines[name], prompts, params)
    same = turns.same
    result = dict(date=datetime.date.today().isoformat(), machine=machine_name(), target=str(target), draft=str(draft),
                  gamma=args.gamma, new_tokens=args.new_tokens, requests=len(prompts), repeats=args.repeats, batch=1,
                  **turns.summary(baseline_of=lambda name: "target-only"), greedy_identical=same,
                  output_tokens=sum(len(o) for o in turns.first_outputs[""]))
    print(f"greedy identical across engines: {same}")
    write_json(result, args.out, f"code-edit-{result['date']}.json")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
