"""GGUF files run as stored, against llama.cpp on the same files: decode and prefill rates.

    python bench/bench_gguf.py --llama-bench PATH [--files DIR] [--types Q4_1 Q8_0 Q4_K_M Q4_0]
        [--threads 2] [--repeats 3] [--new-tokens 128] [--prompt-tokens 512] [--out FILE.json]

Per file of the default target (SmolLM2-135M-Instruct: the wheel's Q4_1 file, and the others
made by bench/gguf_files.py into --files), one configuration after another within each repeat:
  llama.cpp     `llama-bench -t THREADS -p 0 -n NEW` (decode from an empty context, its tg rate)
                and `-p PROMPT -n 0` (its pp rate), built from llama-cpp-python's vendored source
  target-only   specengine decoding the file alone, greedy, batch 1, over 4 chat code requests
  speculative   the same with the default draft (smollm2-draft), gamma="auto"
Decode rate: tokens after the first over the time from the first token to the last (the prefill
excluded, as llama-bench's tg rate has none). Prefill rate: a PROMPT-token prompt's tokens over
the time to its first token, target-only. Greedy output of speculative decoding must equal
target-only decoding (asserted). llama.cpp's threads spin: run on an otherwise idle machine.
Medians over repeats; ratios are of medians from this one run.

llama.cpp (outside CI and the repository), from the sources llama-cpp-python's sdist vendors:
    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF
    cmake --build build -j2 --target llama-quantize llama-bench
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from specengine import Engine, SamplingParams
from specengine.shipped import DEFAULT_DRAFT_DIR, smollm2_gguf

from common import CHAT_REQUESTS, RESULTS, cpu_name

DEFAULT_FILES = Path.home() / ".cache" / "specengine" / "bench-gguf"


def file_of(kind: str, folder: Path) -> Path:
    if kind == "Q4_1":
        return smollm2_gguf()
    path = folder / f"SmolLM2-135M-Instruct.{kind}.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: make it with bench/gguf_files.py")
    return path


def llama_bench(binary: Path, path: Path, threads: int, prompt: int, new: int) -> float:
    """llama-bench's mean rate (tokens/s) of one test on one file."""
    out = subprocess.run([str(binary), "-m", str(path), "-t", str(threads), "-p", str(prompt), "-n", str(new),
                          "-r", "1", "-o", "json"], capture_output=True, text=True, check=True)
    (row,) = json.loads(out.stdout)
    return float(row["avg_ts"])


def decode_run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]], float]:
    """(decode tokens/s, each prompt's tokens, alpha): prompts one at a time, greedy."""
    rates, outputs = [], []
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    accepted = tested = 0
    for prompt in prompts:
        engine.add_request(prompt, params)
        tokens, first, stats = [], None, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.new_token_ids and first is None:
                    first, first_count = time.perf_counter(), len(out.new_token_ids)
                tokens += out.new_token_ids
                stats = out.stats
        rates.append((len(tokens) - first_count) / (time.perf_counter() - first))
        outputs.append(tokens)
        accepted += stats.accepted
        tested += stats.accepted + stats.rejections
    return statistics.median(rates), outputs, (accepted / tested if tested else float("nan"))


def prefill_rate(engine: Engine, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True))
    return len(prompt) / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bench", type=Path, required=True)
    parser.add_argument("--files", type=Path, default=DEFAULT_FILES)
    parser.add_argument("--types", nargs="+", default=["Q4_1", "Q8_0", "Q4_K_M", "Q4_0"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    files = {kind: file_of(kind, args.files) for kind in args.types}
    # Prefill is timed without the prefix cache, which would serve the repeated prompt from memory.
    engines = {kind: (Engine.from_pretrained(path), Engine.from_pretrained(path, DEFAULT_DRAFT_DIR, gamma="auto"),
                      Engine.from_pretrained(path, prefix_cache_bytes=0))
               for kind, path in files.items()}
    tokenizer = next(iter(engines.values()))[0].tokenizer
    prompts = [engines[args.types[0]][0].chat_prompt([{"role": "user", "content": text}])
               for text in CHAT_REQUESTS[:4]]
    long_prompt = (tokenizer(Path(__file__).read_text())["input_ids"] * 4)[:args.prompt_tokens]
    for target, spec, uncached in engines.values():  # warm: first calls allocate, gamma="auto" measures its costs
        decode_run(target, prompts[:1], 8)
        decode_run(spec, prompts[:1], 8)
        prefill_rate(uncached, long_prompt)
    runs = {kind: {name: [] for name in ("llamacpp_decode", "llamacpp_prefill", "target_decode", "spec_decode",
                                          "target_prefill", "spec_alpha")} for kind in files}
    for repeat in range(args.repeats):
        for kind, path in files.items():
            target, spec, uncached = engines[kind]
            r = runs[kind]
            r["llamacpp_decode"].append(llama_bench(args.llama_bench, path, args.threads, 0, args.new_tokens))
            r["llamacpp_prefill"].append(llama_bench(args.llama_bench, path, args.threads, args.prompt_tokens, 0))
            rate, base, _ = decode_run(target, prompts, args.new_tokens)
            r["target_decode"].append(rate)
            rate, tokens, alpha = decode_run(spec, prompts, args.new_tokens)
            assert tokens == base, f"{kind}: speculative greedy output differs from target-only"
            r["spec_decode"].append(rate)
            r["spec_alpha"].append(alpha)
            r["target_prefill"].append(prefill_rate(uncached, long_prompt))
            print(f"repeat {repeat} {kind}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in r.items()), flush=True)
    summary = {}
    for kind, r in runs.items():
        m = {k: statistics.median(v) for k, v in r.items()}
        m.update(target_vs_llamacpp=m["target_decode"] / m["llamacpp_decode"],
                 spec_vs_llamacpp=m["spec_decode"] / m["llamacpp_decode"],
                 prefill_vs_llamacpp=m["target_prefill"] / m["llamacpp_prefill"],
                 file_mb=files[kind].stat().st_size / 1e6)
        summary[kind] = m
    record = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
              "cpu": cpu_name(), "threads": args.threads, "repeats": args.repeats, "new_tokens": args.new_tokens,
              "prompt_tokens": args.prompt_tokens, "summary": summary, "runs": runs,
              "files": {k: str(v) for k, v in files.items()}}
    out = args.out or RESULTS / f"gguf-cpu-{record['date']}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{'file':8} {'MB':>6} {'llama.cpp tg':>12} {'target-only':>11} {'x':>5} {'spec':>7} {'x':>5} {'alpha':>5} "
          f"{'llama.cpp pp':>12} {'ours pp':>8} {'x':>5}")
    for kind, m in summary.items():
        print(f"{kind:8} {m['file_mb']:6.1f} {m['llamacpp_decode']:12.1f} {m['target_decode']:11.1f} "
              f"{m['target_vs_llamacpp']:5.2f} {m['spec_decode']:7.1f} {m['spec_vs_llamacpp']:5.2f} "
              f"{m['spec_alpha']:5.2f} {m['llamacpp_prefill']:12.1f} {m['target_prefill']:8.1f} "
              f"{m['prefill_vs_llamacpp']:5.2f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
