"""A prompt's prefill on a CPU: the AMX GEMMs against float32 GEMMs on widened weights.

    python bench/bench_prefill.py [--lengths 32 64 150 256] [--repeats 7] [--label prefill-cpu]

The default pair's target (SmolLM2-135M-Instruct, bfloat16 matrices, float32 compute): for each
prompt length, the median milliseconds of one prefill (the forward over the prompt and the logits
of its last token) with the products on AMX tiles (ops.linear's "amx") and with the instruction
set limited to AVX-512 (the widened weights and oneDNN's sgemm), interleaved call by call so that
both see the same machine; and the largest logit difference between the two. A CPU without AMX
measures only the second.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch

from specengine import _C, default_pair
from specengine.devtools.benchmark import machine_name
from specengine.models import load_model

from common import write_json


def prefill_ms(model, tokens: torch.Tensor) -> tuple[float, torch.Tensor]:
    cache = model.new_cache(1, tokens.shape[1] + 1)
    start = time.perf_counter()
    with torch.no_grad():
        logits = model.logits(model(tokens, torch.zeros(1, dtype=torch.int64), cache)[:, -1])
    return (time.perf_counter() - start) * 1e3, logits


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 150, 256])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--label", default="prefill-cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    model = load_model(default_pair()[0])
    widest = _C.cpu_isa()
    paths = ["amx", "avx512"] if widest == "amx" else [widest]
    rows = []
    for length in args.lengths:
        tokens = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        times = {path: [] for path in paths}
        logits = {}
        for _ in range(args.repeats + 1):  # the first round warms up
            for path in paths:
                _C.set_cpu_isa_limit(path)
                ms, logits[path] = prefill_ms(model, tokens)
                times[path].append(ms)
        _C.set_cpu_isa_limit(widest)
        row = {"prompt_tokens": length, **{f"{p}_ms": round(statistics.median(t[1:]), 2) for p, t in times.items()}}
        if len(paths) == 2:
            row["amx_vs_avx512"] = round(row["amx_ms"] / row["avx512_ms"], 3)
            row["max_logit_difference"] = float((logits["amx"] - logits["avx512"]).abs().max())
        print(row)
        rows.append(row)
    write_json({"machine": machine_name(), "date": datetime.date.today().isoformat(), "torch": torch.__version__,
                "threads": torch.get_num_threads(), "model": "SmolLM2-135M-Instruct (bfloat16 matrices, float32 compute)",
                "rows": rows}, args.out, f"{args.label}-{datetime.date.today().isoformat()}.json")


if __name__ == "__main__":
    main()
