"""The default pair as it comes (gamma "auto", the engine's default) against target-only decoding,
on chat requests of twelve kinds, greedy, one request at a time, in one process.

    python bench/bench_categories.py [--quick] [--new-tokens 128] [--repeats 3] [--per-category 3]
                                     [--gamma auto|N] [--fresh-costs] [--out FILE]

Every request runs on both engines back to back, the order turning every repeat, so that a slow
stretch of the machine falls on both alike; a category's tokens per second is its requests'
tokens over their time (prefill included), its figure the median over the repeats. Per category:
the speed-up over target-only, the drafting engine's mean tokens per round, acceptance and drafts
per token. Also the first request's time to its first token on each engine (the drafting engine's
includes measuring its step costs, or reading them from the cache: --fresh-costs measures them
in a temporary cache folder, as a machine's first run does). --quick: one request of each kind,
64 new tokens, 2 repeats.
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from specengine import Engine, SamplingParams, default_pair
from specengine.devtools.benchmark import machine_name
from specengine.engine.costs import OtherLoad
from specengine.shipped import cache_dir

from common import cpu_name, write_json

PASSAGE = ("The Great Barrier Reef, off the coast of Queensland, Australia, is the world's largest coral reef "
           "system. It is made of over 2,900 individual reefs and 900 islands stretching over 2,300 kilometres. "
           "Rising sea temperatures have caused mass coral bleaching events in 1998, 2002, 2016, 2017 and 2020, "
           "and scientists warn that the reef could lose most of its coral cover this century unless warming "
           "is limited.")

DOCUMENTS = ("[1] The Eiffel Tower was completed in 1889 for the World's Fair and is 330 metres tall.\n"
             "[2] Gustave Eiffel's company designed and built the tower; the design is credited to Maurice "
             "Koechlin and Emile Nouguier.\n"
             "[3] The tower was the tallest man-made structure in the world until the Chrysler Building in "
             "New York was finished in 1930.")

# Chat requests of twelve kinds, three each (--per-category takes the first N of each).
CATEGORIES: dict[str, list[str]] = {
    "writing": [
        "Write a short story of about 100 words about a lighthouse keeper who finds a message in a bottle.",
        "Write a friendly email inviting my colleagues to a team lunch on Friday.",
        "Write a poem about the first snow of winter.",
    ],
    "qa": [
        "What is the capital of Canada, and why was it chosen?",
        "Why do cats purr?",
        "How long should I boil an egg to get a soft yolk?",
    ],
    "translation": [
        "Translate into French: 'The library opens at nine in the morning and closes at six in the evening.'",
        "Translate into Spanish: 'I would like to book a table for two people tomorrow night.'",
        "Translate into German: 'The weather was beautiful, so we went for a long walk by the river.'",
    ],
    "summarization": [
        f"Summarise the following text in two sentences.\n\n{PASSAGE}",
        "Summarise in three bullet points: Regular exercise improves heart health, helps control weight, "
        "strengthens bones and muscles, improves mood through the release of endorphins, and lowers the risk "
        "of diseases such as type 2 diabetes. Experts recommend at least 150 minutes of moderate activity a week.",
        "Give a one-paragraph summary of the story of Cinderella.",
    ],
    "math": [
        "Solve for x: 3x + 7 = 22. Show your steps.",
        "A shop sells pencils at 3 for $1. How much do 24 pencils cost? Explain.",
        "What is 15% of 240? Show how you computed it.",
    ],
    "code": [
        "Write a Python function that returns the n-th Fibonacci number iteratively.",
        "Write a JavaScript function that removes duplicate values from an array.",
        "Write a SQL query that returns the five customers with the highest total order amount.",
    ],
    "roleplay": [
        "You are a pirate captain. Greet your new crew and tell them about our next voyage.",
        "Pretend you are a tour guide in Rome and welcome a group of tourists to the Colosseum.",
        "Act as a friendly barista and take my coffee order.",
    ],
    "extraction": [
        "Extract every person's name and age from this text as a JSON list: 'Alice, 34, met her brother Tom, "
        "29, and their friend Maria, who is 41, at the station.'",
        f"List every year mentioned in this text, one per line.\n\n{PASSAGE}",
        "From the sentence 'Order #4521 for 3 laptops was shipped to Berlin on March 2nd by DHL', extract the "
        "order number, quantity, product, city, date and carrier as key: value lines.",
    ],
    "reasoning": [
        "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain your reasoning.",
        "Tom is taller than Sam, and Sam is taller than Ann. Who is the shortest? Explain.",
        "A farmer has 17 sheep. All but 9 run away. How many are left? Think step by step.",
    ],
    "stem": [
        "Explain how photosynthesis works.",
        "What is Newton's second law of motion? Give an example.",
        "Why is the sky blue?",
    ],
    "humanities": [
        "What were the main causes of the French Revolution?",
        "Explain the difference between ethics and morality.",
        "Who was Shakespeare and why is he important?",
    ],
    "rag": [
        f"Answer the question using only the documents below, citing them by number.\n\n{DOCUMENTS}\n\n"
        "Question: When was the Eiffel Tower completed, and who designed it?",
        f"Using the documents below, answer: how tall is the Eiffel Tower, and until when was it the tallest "
        f"structure in the world? Cite the documents.\n\n{DOCUMENTS}",
        f"Context:\n{PASSAGE}\n\nBased only on the context, how many islands does the Great Barrier Reef "
        "include, and what threatens it?",
    ],
}


class _Messages(logging.Handler):
    """Keeps the engine's log messages (where its step costs came from)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def first_token_s(engine: Engine, prompt: list[int]) -> float:
    """Seconds from adding a request to its first token (the request then runs to its end)."""
    start = time.perf_counter()
    request = engine.add_request(prompt, SamplingParams(max_new_tokens=8, temperature=0.0))
    seconds = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if seconds is None and out.request_id == request and out.new_token_ids:
                seconds = time.perf_counter() - start
    return seconds


def run(args) -> dict:
    target, draft = default_pair()
    plain = Engine.from_pretrained(target)
    prompts = {kind: [plain.chat_prompt([{"role": "user", "content": text}]) for text in texts[: args.per_category]]
               for kind, texts in CATEGORIES.items()}
    first = prompts["qa"][0]
    plain.generate([first], SamplingParams(max_new_tokens=8, temperature=0.0))  # the process's warm-up
    messages = _Messages()
    log = logging.getLogger("specengine")
    log.addHandler(messages)
    log.setLevel(logging.INFO)
    options = {} if args.gamma == "auto" else {"gamma": int(args.gamma)}  # "auto": the engine's default
    drafting = Engine.from_pretrained(target, draft, **options)
    # The first request of each engine: the drafting one's measures (or reads) its step costs.
    load = OtherLoad()
    first_s = {"drafting": first_token_s(drafting, first), "target-only": first_token_s(plain, first)}
    first_load = load.cores()
    costs_s = dict(drafting.gamma_controller.costs_by_batch.seconds) if drafting.gamma_controller else {}
    costs_from = [m for m in messages.lines if m.startswith("gamma='auto'")]
    print(f"first request, time to first token: drafting {first_s['drafting']:.3f} s, target-only "
          f"{first_s['target-only']:.3f} s; step costs: {costs_s} ({'; '.join(costs_from)}); other processes "
          f"kept {first_load or 0:.2f} cores busy", flush=True)

    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)
    engines = {"target-only": plain, "drafting": drafting}
    # by repeat, engine, category: [tokens, seconds, rounds, drafted, accepted, rejections]
    tallies: list[dict[str, dict[str, list[float]]]] = []
    per_prompt: dict[str, list[dict[str, float]]] = {}  # "kind i": by repeat, tok/s by engine
    outputs: dict[str, list[int]] = {}
    other_load: list[float | None] = []  # by repeat: cores other processes kept busy
    same = True
    for repeat in range(args.repeats):
        load = OtherLoad()
        tally = {name: {kind: [0.0] * 6 for kind in prompts} for name in engines}
        order = list(engines)[:: 1 if repeat % 2 == 0 else -1]
        for kind, kind_prompts in prompts.items():
            for i, prompt in enumerate(kind_prompts):
                rates = {}
                for name in order:
                    start = time.perf_counter()
                    (result,) = engines[name].generate([prompt], params)
                    seconds = time.perf_counter() - start
                    s = result.stats
                    t = tally[name][kind]
                    for j, value in enumerate((len(result.token_ids), seconds, s.rounds, s.drafted, s.accepted,
                                               s.rejections)):
                        t[j] += value
                    rates[name] = len(result.token_ids) / seconds
                    same &= result.token_ids == outputs.setdefault(f"{kind} {i}", result.token_ids)
                per_prompt.setdefault(f"{kind} {i}", []).append(rates)
        tallies.append(tally)
        other_load.append(load.cores())
        total = {name: sum(t[0] for t in tally[name].values()) / sum(t[1] for t in tally[name].values())
                 for name in engines}
        print(f"repeat {repeat}: target-only {total['target-only']:.1f} tok/s, drafting {total['drafting']:.1f} "
              f"tok/s ({total['drafting'] / total['target-only']:.3f}x); other processes kept "
              f"{other_load[-1] or 0:.2f} cores busy", flush=True)

    def median_rate(name: str, kinds) -> float:
        return statistics.median(sum(t[name][k][0] for k in kinds) / sum(t[name][k][1] for k in kinds)
                                 for t in tallies)

    categories = {}
    for kind in list(prompts) + ["all"]:
        kinds = list(prompts) if kind == "all" else [kind]
        base, spec = median_rate("target-only", kinds), median_rate("drafting", kinds)
        tokens, _, rounds, drafted, accepted, rejections = (sum(t["drafting"][k][j] for t in tallies for k in kinds)
                                                           for j in range(6))
        tested = accepted + rejections
        categories[kind] = dict(target_only_tok_s=base, drafting_tok_s=spec, speedup=spec / base,
                                tokens_per_round=tokens / rounds, acceptance=accepted / tested if tested else None,
                                drafts_per_token=drafted / tokens)
    print(f"\n| kind | target-only tok/s | default pair tok/s | x | tokens/round | acceptance | drafts/token |\n"
          f"| --- | --- | --- | --- | --- | --- | --- |")
    for kind, c in categories.items():
        acceptance = f"{c['acceptance']:.2f}" if c["acceptance"] is not None else "-"
        print(f"| {kind} | {c['target_only_tok_s']:.1f} | {c['drafting_tok_s']:.1f} | {c['speedup']:.3f} | "
              f"{c['tokens_per_round']:.3f} | {acceptance} | {c['drafts_per_token']:.3f} |")
    lowest = min(c["speedup"] for c in categories.values())
    print(f"\nlowest speed-up {lowest:.3f}x; greedy output identical on both engines: {same}")
    prompts_tok_s = {key: {name: statistics.median(r[name] for r in rates) for name in engines}
                     for key, rates in per_prompt.items()}
    prompt_speedups = {key: statistics.median(r["drafting"] / r["target-only"] for r in rates)
                       for key, rates in per_prompt.items()}
    print("per request (medians): " + ", ".join(
        f"{key} {prompts_tok_s[key]['target-only']:.0f}/{prompts_tok_s[key]['drafting']:.0f} tok/s "
        f"{prompt_speedups[key]:.2f}x" for key in per_prompt))
    return dict(date=datetime.date.today().isoformat(), machine=machine_name(), cpu=cpu_name(), cpus=os.cpu_count(),
                gamma=args.gamma, new_tokens=args.new_tokens, repeats=args.repeats, per_category=args.per_category,
                batch=1, temperature=0.0, first_token_s=first_s, costs_s=costs_s, costs_log=costs_from,
                first_request_other_load=first_load, other_load=other_load,
                categories=categories, lowest_speedup=lowest, prompt_tok_s=prompts_tok_s,
                prompt_speedups=prompt_speedups,
                runs=[{name: {kind: t for kind, t in by_kind.items()} for name, by_kind in tally.items()}
                      for tally in tallies],
                greedy_identical=same)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one request of each kind, 64 new tokens, 2 repeats")
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--per-category", type=int, help="requests of each kind (at most 3; default 3)")
    parser.add_argument("--gamma", default="auto", help="the drafting engine's gamma (default: its default, auto)")
    parser.add_argument("--fresh-costs", action="store_true",
                        help="measure the step costs in a temporary cache folder instead of reading stored ones")
    parser.add_argument("--out", help="JSON file (default bench/results/categories-<date>.json)")
    args = parser.parse_args()
    defaults = dict(new_tokens=64, repeats=2, per_category=1) if args.quick else dict(new_tokens=128, repeats=3,
                                                                                     per_category=3)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not 1 <= args.per_category <= 3:
        parser.error("--per-category must be 1, 2 or 3")
    if args.fresh_costs:  # a cache folder without step costs, with the converted tokenizers
        fresh = Path(tempfile.mkdtemp(prefix="specengine-cache-"))
        if (cache_dir() / "tokenizers").is_dir():
            shutil.copytree(cache_dir() / "tokenizers", fresh / "tokenizers")
        os.environ["SPECENGINE_CACHE"] = str(fresh)
    result = run(args)
    write_json(result, args.out, f"categories-{result['date']}.json")
    return 0 if result["greedy_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
