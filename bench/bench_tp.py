"""Tensor parallelism's bookkeeping on one machine: target-only rounds of a target split over N
ranks (torchrun, gloo on CPU, one thread per rank) against one process (1 thread and N threads).
On a CPU the ranks share its cores, so this measures what splitting costs, not a speedup.

    python bench/bench_tp.py [--target FOLDER | --widened LAYERS] [--ranks 2] [--batches 1 8] [--new-tokens 64]
                             [--repeats 3]

Per batch size: the median seconds per round (wall time of a generation / its rounds) of each
configuration over interleaved repeats, and the split's ratio to each single process. The target
defaults to the shipped pycode target (8 heads, 4 KV heads, 4 safetensors shards; the default
pair's SmolLM2 has 3 KV heads, which do not split in two). --widened LAYERS: that target embedded
in a Llama of d 2048, ffn 5632, 32 heads, 8 KV heads and LAYERS layers (models.widen, saved in
bfloat16 to a temporary folder): a step that reads far more weights per collective.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from specengine import Engine, SamplingParams
from specengine.devtools.benchmark import machine_name
from specengine.models.loader import load_model
from specengine.shipped import shipped_pair

from bench_costs import widened_target
from common import write_json

PROMPT = list(range(40, 72))  # 32 token ids


def seconds_per_round(engine: Engine, batch: int, new_tokens: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.generate([PROMPT] * batch, params)
    return (time.perf_counter() - start) / engine.last_run_rounds


def worker(args):
    """One rank (under torchrun) or the single process: a JSON line of seconds per round."""
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.target, tensor_parallel=args.ranks_here)
    seconds_per_round(engine, 1, 8)  # warm up
    result = {b: [seconds_per_round(engine, b, args.new_tokens) for _ in range(args.repeats)] for b in args.batches}
    if engine.target.tp is None or engine.target.tp.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def run(args, ranks: int, threads: int) -> dict[int, list[float]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = str(threads)
    common = [__file__, "--worker", "--target", str(args.target), "--threads", str(threads), "--ranks-here",
              str(ranks), "--new-tokens", str(args.new_tokens), "--repeats", "1", "--batches",
              *map(str, args.batches)]
    if ranks > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                   f"--master-port={port}", *common]
    else:
        command = [sys.executable, *common]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return {int(b): v for b, v in json.loads(line.removeprefix("RESULT ")).items()}


def save_widened(source: Path, layers: int, folder: Path) -> Path:
    """The widened source as a bfloat16 Hugging Face folder (its tokenizer files copied)."""
    wide = widened_target(load_model(source), layers)
    c = wide.config
    raw = json.loads((source / "config.json").read_text())
    raw.update(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_attention_heads=c.num_heads,
               num_key_value_heads=c.num_kv_heads, num_hidden_layers=c.num_layers, rms_norm_eps=c.rms_norm_eps,
               head_dim=c.head_dim, dtype="bfloat16")
    tensors = {name: t.to(torch.bfloat16).contiguous() for name, t in wide.checkpoint_tensors().items()
               if not (c.tie_word_embeddings and name == "lm_head.weight")}
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    return folder


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, help="a Hugging Face folder (default: the shipped pycode target)")
    parser.add_argument("--widened", type=int, metavar="LAYERS", help="the shipped target widened (see above)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (medians reported)")
    parser.add_argument("--out", help="JSON path (default bench/results/tp-cpu-<date>.json)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--ranks-here", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    args.target = args.target or shipped_pair()[0]
    scratch = None
    if args.widened:
        scratch = Path(tempfile.mkdtemp(prefix="widened-"))
        args.target = save_widened(args.target, args.widened, scratch)
    try:
        measure(args)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch)


def measure(args):
    configs = {"one process, 1 thread": (1, 1), f"one process, {args.ranks} threads": (1, args.ranks),
               f"{args.ranks} ranks, 1 thread each": (args.ranks, 1)}
    times: dict[str, dict[int, list[float]]] = {name: {b: [] for b in args.batches} for name in configs}
    for repeat in range(args.repeats):  # interleaved: drift hits every configuration alike
        for name, (ranks, threads) in configs.items():
            for b, seconds in run(args, ranks, threads).items():
                times[name][b] += seconds
            print(f"repeat {repeat + 1}: {name}: " + ", ".join(
                f"batch {b} {1e3 * times[name][b][-1]:.2f} ms/round" for b in args.batches), flush=True)
    split = f"{args.ranks} ranks, 1 thread each"
    medians = {name: {b: statistics.median(v) for b, v in per.items()} for name, per in times.items()}
    target = f"pycode target widened to {args.widened} layers" if args.widened else str(args.target)
    result = dict(machine=machine_name("cpu").rsplit(",", 1)[0], cpus=os.cpu_count(),
                  date=datetime.date.today().isoformat(), target=target, new_tokens=args.new_tokens,
                  repeats=args.repeats, torch=torch.__version__,
                  seconds_per_round={name: {str(b): s for b, s in per.items()} for name, per in medians.items()},
                  split_over_single={name: {str(b): medians[split][b] / s for b, s in per.items()}
                                     for name, per in medians.items() if name != split},
                  runs=times)
    for name, ratios in result["split_over_single"].items():
        print(f"{split} / {name}: " + ", ".join(f"batch {b} {r:.2f}x" for b, r in ratios.items()))
    suffix = f"-widened{args.widened}" if args.widened else ""
    write_json(result, args.out, f"tp-cpu{suffix}-{result['date']}.json")


if __name__ == "__main__":
    main()
