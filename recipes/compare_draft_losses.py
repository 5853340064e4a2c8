"""Does distillation help the draft? Train a cross-entropy-only draft and compare it with the shipped one.

    python recipes/compare_draft_losses.py [--minutes M]

The shipped draft was trained with half cross-entropy, half KL to the target's logits. This
trains the same architecture on the same data stream with cross-entropy only, for the same
wall-clock budget by default (so it sees more tokens: no teacher forwards), then measures both
against the shipped target: held-out loss, and alpha at gamma=4, temperature 0 and 1, on the
held-out prompts of recipes/evaluate_pair.py. Writes bench/results/draft-loss-<date>.json.
Resumable like train_pair.py (checkpoint .train-work/draft-ce.pt).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import tempfile
from pathlib import Path

import torch

from specengine import Engine, SamplingParams
from specengine.shipped import heldout_prompts
from train_pair import EOS, ROOT, export, heldout_loss, stage_corpus, stage_tokenizer, train


def acceptance(target_dir: Path, draft_dir: Path, prompts_count: int, new_tokens: int) -> dict:
    engine = Engine.from_pretrained(target_dir, draft_dir, gamma=4)
    prompts = heldout_prompts(engine.tokenizer, prompts_count, length=48, start_fraction=0.5)  # as evaluate_pair
    out = {}
    for temperature in (0.0, 1.0):
        params = [SamplingParams(max_new_tokens=new_tokens, temperature=temperature, seed=i, ignore_eos=True)
                  for i in range(len(prompts))]
        engine.generate(prompts, params)
        s = engine.last_run_stats
        out[f"T={temperature:g}"] = dict(alpha=s.acceptance_rate, tokens_per_target_call=s.tokens_per_round)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=str(ROOT / ".train-work"))
    parser.add_argument("--pair", default=str(ROOT / "specengine" / "pretrained"))
    parser.add_argument("--minutes", type=float, default=0, help="0: the shipped draft's training time")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work, pair = Path(args.work), Path(args.pair)
    target_dir, distilled_dir = pair / "pycode-target", pair / "pycode-draft"
    distilled_meta = json.loads((distilled_dir / "training.json").read_text())
    minutes = args.minutes or distilled_meta["train_seconds"] / 60

    tokenizer = stage_tokenizer(work)
    data = stage_corpus(work, tokenizer)
    model, state = train("draft", work, data, len(tokenizer), tokenizer.convert_tokens_to_ids(EOS), minutes, device,
                         distill_weight=0.0, name="draft-ce")
    loss = heldout_loss(model, data["heldout"], device)
    rows = {"distilled (0.5 CE + 0.5 KL), shipped": dict(
        heldout_loss=distilled_meta["heldout_loss"], train_tokens=distilled_meta["train_tokens"],
        train_seconds=distilled_meta["train_seconds"], **acceptance(target_dir, distilled_dir, args.prompts,
                                                                     args.new_tokens))}
    with tempfile.TemporaryDirectory() as tmp:
        ce_dir = Path(tmp) / "pycode-draft-ce"
        export("draft", model, tokenizer, ce_dir, dict(kind="draft", loss="cross-entropy only"))
        rows["cross-entropy only"] = dict(heldout_loss=loss, train_tokens=state["tokens"],
                                          train_seconds=state["elapsed"],
                                          **acceptance(target_dir, ce_dir, args.prompts, args.new_tokens))
    print(f"{'draft':40s} {'loss':>6s} {'ppl':>7s} {'tokens':>9s} {'alpha T=0':>9s} {'alpha T=1':>9s}")
    for name, r in rows.items():
        print(f"{name:40s} {r['heldout_loss']:6.3f} {math.exp(r['heldout_loss']):7.1f} {r['train_tokens']:9d} "
              f"{r['T=0']['alpha']:9.3f} {r['T=1']['alpha']:9.3f}")
    date = datetime.date.today().isoformat()
    result = dict(date=date, machine=f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
                  torch=torch.__version__, gamma=4, prompts=args.prompts, new_tokens=args.new_tokens, drafts=rows)
    out = ROOT / "bench" / "results" / f"draft-loss-{date}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
