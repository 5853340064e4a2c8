"""Greedy outputs of a pair against transformers' greedy `generate`, token for token.

    python bench/check_greedy_vs_hf.py [--pair default|shipped] [--device cpu|cuda] [--prompts 8]
        [--new-tokens 64] [--out file.json]

Held-out requests, batch 1: Hugging Face `generate` on the target (float32, no EOS: it neither
stops nor forbids it), then specengine on the same device with ignore_eos: speculative (gamma 3)
and, on CUDA, the ways the engine runs there: speculative and target-only with CUDA graphs,
speculative reading back every 8 rounds; and the eager PyTorch loop. --pair default: the default
pair (SmolLM2's Q4_1 GGUF file as stored; chat prompts); shipped: the pycode pair in the
package (Hugging Face folders, nothing to fetch: the GPU machine's check; code prompts).
On CUDA every engine runs the compiled Triton step kernels; a fallback to the torch path is
recorded and makes the run exit with status 1. Writes bench/results/<label>-<date>.json (label
greedy-vs-hf unless given) or --out.
"""
import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
from specengine import Engine, SamplingParams, default_pair
from specengine.devtools.benchmark import eager_decode
from specengine.devtools.reference import transformers_model

from common import RESULTS

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--pair", choices=("default", "shipped"), default="default")
parser.add_argument("--device", default="cpu")
parser.add_argument("--prompts", type=int, default=8)
parser.add_argument("--new-tokens", type=int, default=64)
parser.add_argument("--label", default="greedy-vs-hf", help="writes bench/results/<label>-<date>.json")
parser.add_argument("--out", help="JSON path (instead of --label's)")
args = parser.parse_args()
device = torch.device(args.device)
if args.pair == "shipped":
    from specengine.shipped import heldout_prompts, shipped_pair

    target, draft = shipped_pair()
else:
    from specengine.devtools.corpus import heldout_chat_prompts

    target, draft = default_pair()
hf = transformers_model(target, device=device)
engines = {"spec": Engine.from_pretrained(target, draft, gamma=3, device=str(device), dtype="float32")}
if device.type == "cuda":
    engines["spec_graphs"] = Engine.from_pretrained(target, draft, gamma=3, device="cuda", dtype="float32",
                                                    cuda_graphs=True)
    engines["spec_blocks"] = Engine.from_pretrained(target, draft, gamma=3, device="cuda", dtype="float32",
                                                    cuda_graphs=True, rounds_per_read=8)
    engines["target_graphs"] = Engine.from_pretrained(target, device="cuda", dtype="float32", cuda_graphs=True)
tokenizer = engines["spec"].tokenizer
if args.pair == "shipped":
    prompts = heldout_prompts(tokenizer, args.prompts, length=64, start_fraction=1 / 3)
else:
    prompts = heldout_chat_prompts(tokenizer, args.prompts, max_tokens=256)
out = Path(args.out) if args.out else RESULTS / f"{args.label}-{datetime.date.today().isoformat()}.json"
result = dict(pair=args.pair, device=device.type, dtype="float32", prompts=args.prompts, new_tokens=args.new_tokens,
              runs=[])


def fallbacks() -> dict:
    """Each engine model's triton_fallback_reason (None: the kernels ran where the model takes them)."""
    models = {}
    for name, e in engines.items():
        models[f"{name}_target"] = e.target
        if e.drafter is not None:
            models[f"{name}_draft"] = e.drafter.model
    return {f"{name}_triton_fallback": m.triton_fallback_reason for name, m in models.items()}


for prompt in prompts:
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=0, attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
    run = dict(hf_len=len(expected), eos_in=tokenizer.eos_token_id in expected)
    for name, e in engines.items():
        (r,) = e.generate([prompt], SamplingParams(max_new_tokens=args.new_tokens, temperature=0, ignore_eos=True))
        run[f"same_{name}"] = r.token_ids == expected
    run["same_eager"] = eager_decode(engines["spec"].target, [prompt], args.new_tokens, 0.0, 0)[0] == expected
    result["runs"].append(run)
    result.update(fallbacks())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")  # after every prompt: a run cut short keeps them
    print(run, flush=True)
same = all(v for r in result["runs"] for k, v in r.items() if k.startswith("same_"))
print(f"all equal: {same}; wrote {out}")
fell = {k: v for k, v in fallbacks().items() if v}
if fell and device.type == "cuda":
    print(f"the Triton step kernels fell back to the torch path: {fell}")
    sys.exit(1)
