"""Target-only decoding against each drafter, on chat requests of twelve kinds, side by side in
one process: at T=0 and T=1, one request at a time and in batches.

    python bench/bench_categories.py [--quick] [--drafters model ngram suffix eagle3:HEAD ...]
        [--temperatures 0 1] [--batch 1 8] [--new-tokens 128] [--repeats 3] [--per-category 3]
        [--categories KIND ...] [--gamma auto|N] [--llama-bench PATH] [--threads N]
        [--target PATH] [--draft FOLDER] [--fresh-costs] [--out FILE]

Engines: target-only always, and one per --drafters entry (default: model): `model` the draft
model (the default pair as it comes, or --target with --draft), `ngram` prompt lookup, `suffix`
suffix decoding, `eagle3:HEAD` the EAGLE-3 head in folder HEAD; all at --gamma (default "auto",
the engine's default). Each engine loads the target itself: an EAGLE-3 engine has its target keep
the features of a few layers, which the others must not pay for. Suffix decoding drafts from
earlier requests' outputs too, so its engine is made anew for every pass (repeat, temperature,
batch): no request is drafted from its own output in an earlier pass.

At batch B a kind's requests (cycled to fill B) are submitted together, B at a time. Every batch
runs on every engine back to back, the engines' order turning every batch, so that a slow
stretch of the machine falls on all alike. Per kind, temperature and batch size, and over all
kinds: tokens per second (the batch's tokens over its time, prefill included; the median over
repeats), the speed-up over target-only, mean tokens per round (per target verification),
acceptance (drafts accepted / tested), acceptance at each draft position (accepted there / drafted
there, over all repeats) and drafts per token. At batch 1 also the decode rate (tokens after the
first over the time from the first to the last), which --llama-bench PATH sets beside llama.cpp's
decode rate on the same GGUF file (`llama-bench -p 0 -n NEW`, from an empty context; run once a
repeat). Greedy output must equal target-only's on every engine (else exit status 1). Also each
engine's first request's time to its first token (a drafting engine with gamma "auto" measures
its step costs then, or reads them from the cache: --fresh-costs measures them in a temporary cache
folder, as a machine's first run does). --quick: one request of each kind, 64 new tokens, 2
repeats. A target without a chat template gets the requests as plain text.
"""
from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specengine import Engine, SamplingParams, default_pair
from specengine.devtools.benchmark import machine_name, rotated
from specengine.engine.costs import OtherLoad
from specengine.models.loader import is_gguf
from specengine.shipped import cache_dir

from bench_gguf import llama_bench
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


TARGET_ONLY = "target-only"
KINDS_OF_DRAFTER = ("model", "ngram", "suffix", "eagle3")


def drafter_spec(text: str) -> tuple[str, Path | None]:
    """A --drafters entry: (kind, the EAGLE-3 head's folder or None)."""
    kind, _, head = text.partition(":")
    if kind not in KINDS_OF_DRAFTER:
        raise argparse.ArgumentTypeError(f"unknown drafter {text!r}: one of model, ngram, suffix, eagle3:HEAD")
    if kind == "eagle3":
        if not head:
            raise argparse.ArgumentTypeError("eagle3 takes its head's folder: eagle3:PATH")
        if not Path(head).is_dir():
            raise argparse.ArgumentTypeError(f"eagle3: the head folder {head} does not exist")
        return kind, Path(head)
    if head:
        raise argparse.ArgumentTypeError(f"{kind} takes no folder, got {text!r}")
    return kind, None


def engine_name(kind: str, head: Path | None) -> str:
    return f"eagle3:{head.name}" if head is not None else kind


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


@dataclass
class Tally:
    """What one engine did on some batches: tokens and time, and its rounds' drafts."""
    tokens: int = 0
    seconds: float = 0.0
    decode_tokens: int = 0      # tokens after each request's first (batch 1)
    decode_seconds: float = 0.0  # from each request's first token to its last (batch 1)
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)

    def add(self, other: "Tally"):
        for name in ("tokens", "seconds", "decode_tokens", "decode_seconds", "rounds", "drafted", "accepted",
                     "rejections"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("drafted_by_position", "accepted_by_position"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n


def run_batch(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[Tally, list[list[int]]]:
    """The prompts submitted together and decoded to their ends: (its tally, each one's tokens)."""
    tally = Tally()
    start = time.perf_counter()
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    tokens = {i: [] for i in ids}
    first: dict[str, tuple[float, int]] = {}  # request: (time of its first token, tokens it came with)
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = (now, len(out.new_token_ids))
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                s = out.stats
                tally.rounds += s.rounds
                tally.drafted += s.drafted
                tally.accepted += s.accepted
                tally.rejections += s.rejections
                tally.add(Tally(drafted_by_position=list(s.drafted_by_position),
                                accepted_by_position=list(s.accepted_by_position)))
                if out.request_id in first and len(prompts) == 1:
                    at, count = first[out.request_id]
                    tally.decode_tokens += len(tokens[out.request_id]) - count
                    tally.decode_seconds += now - at
    tally.seconds = time.perf_counter() - start
    tally.tokens = sum(len(t) for t in tokens.values())
    return tally, [tokens[i] for i in ids]


def batches_of(prompts: list[list[int]], batch: int) -> list[list[int]]:
    """Indices of a kind's requests in batches of `batch`: its prompts cycled to fill whole batches
    (a batch larger than the kind's requests repeats them, each with its own seed)."""
    count = math.ceil(max(len(prompts), batch) / batch) * batch
    order = [i % len(prompts) for i in range(count)]
    return [order[i:i + batch] for i in range(0, count, batch)]


def load_engines(args, target: Path, draft: Path | None) -> dict[str, Engine]:
    options = {} if args.gamma == "auto" else {"gamma": int(args.gamma)}  # "auto": the engine's default
    engines = {TARGET_ONLY: Engine.from_pretrained(target)}
    for kind, head in args.drafters:
        if kind == "model":
            engines[engine_name(kind, head)] = Engine.from_pretrained(target, draft, **options)
        elif kind == "eagle3":
            engines[engine_name(kind, head)] = Engine.from_pretrained(target, head, drafter="eagle3", **options)
        else:
            engines[engine_name(kind, head)] = Engine.from_pretrained(target, drafter=kind, **options)
    return engines


def renewed(args, target: Path, warm_prompt: list[int], batches: list[int]) -> Engine:
    """A new suffix-decoding engine, whose global tree holds no earlier outputs but a few tokens
    of its warm-up (a batch of each size, so that its first timed batch allocates nothing)."""
    options = {} if args.gamma == "auto" else {"gamma": int(args.gamma)}
    engine = Engine.from_pretrained(target, drafter="suffix", **options)
    for B in batches:
        run_batch(engine, [warm_prompt] * B, [SamplingParams(max_new_tokens=4, temperature=0.0)] * B)
    return engine


def figures(tallies: list[Tally], base: list[Tally] | None) -> dict:
    """One engine's figures over some kinds from its tally per repeat (base: target-only's)."""
    pooled = Tally()
    for t in tallies:
        pooled.add(t)
    rate = statistics.median(t.tokens / t.seconds for t in tallies)
    decode = [t.decode_tokens / t.decode_seconds for t in tallies if t.decode_seconds > 0]
    tested = pooled.accepted + pooled.rejections
    out = dict(tok_s=rate, tokens_per_round=pooled.tokens / pooled.rounds if pooled.rounds else None,
               acceptance=pooled.accepted / tested if tested else None,
               acceptance_by_position=[a / d if d else None for a, d in
                                       zip(pooled.accepted_by_position, pooled.drafted_by_position)],
               drafts_per_token=pooled.drafted / pooled.tokens if pooled.tokens else None,
               decode_tok_s=statistics.median(decode) if decode else None)
    if base is not None:
        out["speedup"] = rate / statistics.median(t.tokens / t.seconds for t in base)
    return out


def run(args) -> dict:
    target, draft = (args.target, args.draft) if args.target else default_pair()
    engines = load_engines(args, target, draft)
    plain = engines[TARGET_ONLY]

    def prompt_of(text: str) -> list[int]:
        if getattr(plain.tokenizer, "chat_template", None):
            return plain.chat_prompt([{"role": "user", "content": text}])
        return plain.tokenizer(text)["input_ids"]

    prompts = {kind: [prompt_of(text) for text in CATEGORIES[kind][: args.per_category]] for kind in args.categories}
    first = prompts[args.categories[0]][0]
    plain.generate([first], SamplingParams(max_new_tokens=8, temperature=0.0))  # the process's warm-up
    messages = _Messages()
    log = logging.getLogger("specengine")
    log.addHandler(messages)
    log.setLevel(logging.INFO)
    # The first request of each engine: one with gamma "auto" measures (or reads) its step costs.
    load = OtherLoad()
    first_s = {name: first_token_s(engine, first) for name, engine in engines.items()}
    first_load = load.cores()
    costs_s = {name: dict(e.gamma_controller.costs_by_batch.seconds) for name, e in engines.items()
               if e.gamma_controller is not None}
    costs_from = [m for m in messages.lines if m.startswith("gamma='auto'")]
    print("first request, time to first token: " + ", ".join(f"{n} {s:.3f} s" for n, s in first_s.items())
          + f"; step costs: {costs_s} ({'; '.join(costs_from)}); other processes kept {first_load or 0:.2f} "
          "cores busy", flush=True)
    hello = prompt_of("Hello!")  # warm-ups that leave the benchmark's requests alone
    for B in args.batch:  # each batch size's first batch (allocations)
        for engine in engines.values():
            run_batch(engine, [hello] * B, [SamplingParams(max_new_tokens=4, temperature=0.0)] * B)

    names = list(engines)
    settings = [(T, B) for T in args.temperatures for B in args.batch]
    # by setting, engine, kind: one Tally per repeat
    tallies = {s: {n: {k: [] for k in prompts} for n in names} for s in settings}
    llamacpp: list[float] = []
    differs = {n: 0 for n in names[1:]}  # greedy batches whose outputs are not target-only's
    other_load: list[float | None] = []
    turn = 0
    for repeat in range(args.repeats):
        load = OtherLoad()
        if args.llama_bench is not None:
            llamacpp.append(llama_bench(args.llama_bench, target, args.threads, 0, args.new_tokens))
        for T, B in settings:
            for name, (kind, _) in zip(names[1:], args.drafters):
                if kind == "suffix":
                    engines[name] = renewed(args, target, hello, args.batch)
            for k, (kind, kind_prompts) in enumerate(prompts.items()):
                tally = {n: Tally() for n in names}
                for b, batch in enumerate(batches_of(kind_prompts, B)):
                    params = [SamplingParams(max_new_tokens=args.new_tokens, temperature=T,
                                             seed=7919 * repeat + 101 * k + 11 * b + j) for j in range(B)]
                    outputs = {}
                    for name in rotated(names, turn):
                        t, outputs[name] = run_batch(engines[name], [kind_prompts[i] for i in batch], params)
                        tally[name].add(t)
                    turn += 1
                    if T == 0:
                        for name in names[1:]:
                            differs[name] += outputs[name] != outputs[TARGET_ONLY]
                for name in names:
                    tallies[T, B][name][kind].append(tally[name])
        other_load.append(load.cores())
        line = []
        for T, B in settings:
            rate = {n: sum(t[-1].tokens for t in tallies[T, B][n].values()) /
                    sum(t[-1].seconds for t in tallies[T, B][n].values()) for n in names}
            line.append(f"T={T:g} B={B}: " + ", ".join(f"{n} {rate[n]:.1f} tok/s" for n in names))
        print(f"repeat {repeat}: " + "; ".join(line)
              + (f"; llama.cpp decode {llamacpp[-1]:.1f} tok/s" if llamacpp else "")
              + f"; other processes kept {other_load[-1] or 0:.2f} cores busy", flush=True)
    results = {}
    llamacpp_rate = statistics.median(llamacpp) if llamacpp else None
    for T, B in settings:
        by_kind = {}
        for kind in [*prompts, "all"]:
            kinds = list(prompts) if kind == "all" else [kind]

            def over_kinds(name: str) -> list[Tally]:
                per_repeat = []
                for repeat in range(args.repeats):
                    pooled = Tally()
                    for k in kinds:
                        pooled.add(tallies[T, B][name][k][repeat])
                    per_repeat.append(pooled)
                return per_repeat

            base = over_kinds(TARGET_ONLY)
            by_kind[kind] = {name: figures(over_kinds(name), None if name == TARGET_ONLY else base)
                             for name in names}
            if llamacpp_rate is not None and B == 1:
                for f in by_kind[kind].values():
                    f["vs_llamacpp_decode"] = f["decode_tok_s"] / llamacpp_rate if f["decode_tok_s"] else None
        results[f"T={T:g} B={B}"] = by_kind
    report(results, names, llamacpp_rate)
    greedy_identical = {name: differs[name] == 0 for name in names[1:]}
    print(f"greedy output identical to target-only: {greedy_identical}")
    return dict(date=datetime.date.today().isoformat(), machine=machine_name(), cpu=cpu_name(), cpus=os.cpu_count(),
                threads=torch.get_num_threads(), target=str(target), draft=str(draft) if draft else None,
                drafters=names[1:], gamma=args.gamma, new_tokens=args.new_tokens, repeats=args.repeats,
                per_category=args.per_category, temperatures=args.temperatures, batches=args.batch,
                first_token_s=first_s, costs_s=costs_s, costs_log=costs_from, first_request_other_load=first_load,
                other_load=other_load, llamacpp_decode_tok_s=llamacpp_rate, llamacpp_runs=llamacpp,
                results=results, greedy_identical=greedy_identical,
                runs={f"T={T:g} B={B}": {n: {k: [t.__dict__ for t in ts] for k, ts in by_kind.items()}
                                         for n, by_kind in tallies[T, B].items()} for T, B in settings})


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def report(results: dict, names: list[str], llamacpp_rate: float | None):
    """A table per temperature and batch size: per kind, target-only's rate and each drafter's
    speed-up, tokens per round and acceptance; then acceptance by draft position over all kinds."""
    drafters = names[1:]
    for setting, by_kind in results.items():
        header = "| kind | target-only tok/s | " + " | ".join(f"{n}: x, tok/round, accept" for n in drafters)
        header += " | decode rate / llama.cpp's |" if "vs_llamacpp_decode" in by_kind["all"][TARGET_ONLY] else " |"
        print(f"\n{setting}\n{header}\n|" + " --- |" * (header.count("|") - 1))
        for kind, f in by_kind.items():
            cells = [f"{f[n]['speedup']:.3f}x, {_f(f[n]['tokens_per_round'], '.2f')}, {_f(f[n]['acceptance'], '.2f')}"
                     for n in drafters]
            row = f"| {kind} | {f[TARGET_ONLY]['tok_s']:.1f} | " + " | ".join(cells) + " |"
            if "vs_llamacpp_decode" in f[TARGET_ONLY]:
                row += " " + ", ".join(f"{n} {_f(f[n]['vs_llamacpp_decode'], '.2f')}" for n in names) + " |"
            print(row)
        for n in drafters:
            by_position = ", ".join(_f(a, ".2f") for a in by_kind["all"][n]["acceptance_by_position"]) or "no drafts"
            print(f"  {n}: acceptance by draft position (all kinds) [{by_position}]")
    if llamacpp_rate is not None:
        print(f"\nllama.cpp decode (llama-bench tg, empty context): {llamacpp_rate:.1f} tok/s; the B=1 column is "
              "each engine's decode rate over it")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one request of each kind, 64 new tokens, 2 repeats")
    parser.add_argument("--drafters", nargs="+", type=drafter_spec, default=[("model", None)],
                        metavar="DRAFTER", help="model, ngram, suffix, eagle3:HEAD_FOLDER (default: model); "
                                                "target-only always runs")
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0], help="default 0 1")
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8], help="batch sizes (default 1 8)")
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--per-category", type=int, help="requests of each kind (at most 3; default 3)")
    parser.add_argument("--categories", nargs="+", choices=list(CATEGORIES), default=list(CATEGORIES),
                        metavar="KIND", help=f"kinds of request (default all: {', '.join(CATEGORIES)})")
    parser.add_argument("--gamma", default="auto", help="the drafting engines' gamma (default: their default, auto)")
    parser.add_argument("--llama-bench", type=Path, help="llama.cpp's llama-bench binary: its decode rate on the "
                                                        "target's GGUF file as a column")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="llama-bench's threads (default: torch's)")
    parser.add_argument("--target", type=Path, help="the target's folder or GGUF file (default: the default pair's)")
    parser.add_argument("--draft", type=Path, help="the draft model's folder for `model` (with --target)")
    parser.add_argument("--fresh-costs", action="store_true",
                        help="measure the step costs in a temporary cache folder instead of reading stored ones")
    parser.add_argument("--out", help="JSON file (default bench/results/categories-<date>.json)")
    args = parser.parse_args(argv)
    defaults = dict(new_tokens=64, repeats=2, per_category=1) if args.quick else dict(new_tokens=128, repeats=3,
                                                                                     per_category=3)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not 1 <= args.per_category <= 3:
        parser.error("--per-category must be 1, 2 or 3")
    if min(args.batch) < 1 or min(args.temperatures) < 0 or args.new_tokens < 1 or args.repeats < 1:
        parser.error("batch sizes, --new-tokens and --repeats must be >= 1, temperatures >= 0")
    if args.gamma != "auto" and not args.gamma.isdigit():
        parser.error(f"--gamma must be 'auto' or a whole number, got {args.gamma!r}")
    if args.draft is not None and args.target is None:
        parser.error("--draft goes with --target (without either: the default pair)")
    if args.target is not None and args.draft is None and any(kind == "model" for kind, _ in args.drafters):
        parser.error("the model drafter needs --draft with --target")
    names = [engine_name(*d) for d in args.drafters]
    if len(set(names)) != len(names):
        parser.error(f"--drafters names one twice: {names}")
    if args.llama_bench is not None:
        gguf = args.target if args.target is not None else default_pair()[0]
        if not args.llama_bench.is_file():
            parser.error(f"--llama-bench {args.llama_bench} does not exist")
        if not is_gguf(gguf):
            parser.error(f"--llama-bench runs on the target's GGUF file; {gguf} is not one")
    if args.fresh_costs:  # a cache folder without step costs, with the converted tokenizers
        fresh = Path(tempfile.mkdtemp(prefix="specengine-cache-"))
        if (cache_dir() / "tokenizers").is_dir():
            shutil.copytree(cache_dir() / "tokenizers", fresh / "tokenizers")
        os.environ["SPECENGINE_CACHE"] = str(fresh)
    result = run(args)
    write_json(result, args.out, f"categories-{result['date']}.json")
    return 0 if all(result["greedy_identical"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
