"""Greedy outputs of the default pair against transformers' greedy `generate`, token for token.

    python bench/check_greedy_vs_hf.py [--prompts 8] [--new-tokens 64]

Held-out chat requests, batch 1: Hugging Face `generate` on the converted target (float32, no EOS:
it neither stops nor forbids it), specengine speculative (gamma 3) with ignore_eos, and the eager
PyTorch loop. Writes bench/results/<label>-<date>.json (label greedy-vs-hf unless given).
"""
import argparse
import datetime
import json

import torch
from transformers import AutoModelForCausalLM

from specengine import Engine, SamplingParams, default_pair
from specengine.benchmark import eager_decode
from specengine.corpus import heldout_chat_prompts

from common import RESULTS

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--prompts", type=int, default=8)
parser.add_argument("--new-tokens", type=int, default=64)
parser.add_argument("--label", default="greedy-vs-hf", help="writes bench/results/<label>-<date>.json")
args = parser.parse_args()
target, draft = default_pair()
hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
spec = Engine.from_pretrained(target, draft, gamma=3)
runs = []
for prompt in heldout_chat_prompts(spec.tokenizer, args.prompts, max_tokens=256):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=0, attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
    (r,) = spec.generate([prompt], SamplingParams(max_new_tokens=args.new_tokens, temperature=0, ignore_eos=True))
    eager = eager_decode(spec.target, [prompt], args.new_tokens, 0.0, 0)[0]
    runs.append(dict(hf_len=len(expected), same_spec=r.token_ids == expected, same_eager=eager == expected,
                     eos_in=spec.tokenizer.eos_token_id in expected))
print(runs)
out = RESULTS / f"{args.label}-{datetime.date.today().isoformat()}.json"
out.write_text(json.dumps(dict(prompts=args.prompts, new_tokens=args.new_tokens, runs=runs), indent=1) + "\n")
print(f"all equal: {all(r['same_spec'] and r['same_eager'] for r in runs)}; wrote {out}")
