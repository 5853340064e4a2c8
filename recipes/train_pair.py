"""Train specengine's shipped model pair from the Python standard library, offline, on CPU or CUDA.

    python recipes/train_pair.py                  # everything, resumable (re-run to continue)
    python recipes/train_pair.py --target-minutes 60 --draft-minutes 20

Stages (each skipped when its output exists; training resumes from its last checkpoint):
  1. corpus     the running interpreter's stdlib *.py files, split by file into train / held-out
  2. tokenizer  byte-level BPE, 8192 tokens, with <|endoftext|> between files
  3. target     Llama ~30M parameters, next-token cross-entropy
  4. draft      Llama ~3M parameters, half cross-entropy, half distillation from the target's logits
  5. export     bfloat16 Hugging Face folders (config, generation config, safetensors, tokenizer)
  6. evaluate   recipes/evaluate_pair.py measures the pair and writes the model cards
The learning rate follows a cosine over the stage's wall-clock budget, so a run of any length
ends annealed.
"""
from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specengine.devtools.corpus import is_held_out, read, stdlib_files

from resumable import resume, save, set_lr

ROOT = Path(__file__).resolve().parent.parent
EOS = "<|endoftext|>"
SHAPES = {
    "target": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                   intermediate_size=1408),
    "draft": dict(hidden_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=512),
}


def stage_tokenizer(work: Path):
    from transformers import PreTrainedTokenizerFast

    from specengine.devtools.tiny import EOS_TOKEN, train_tokenizer

    assert EOS_TOKEN == EOS
    out = work / "tokenizer"
    if (out / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(out)
    train = [p for p in stdlib_files() if not is_held_out(p)]
    fast = train_tokenizer(8192, (read(p) for p in train), model_max_length=1024, show_progress=True)
    fast.save_pretrained(out)
    return fast


def stage_corpus(work: Path, tokenizer) -> dict[str, np.ndarray]:
    paths = {split: work / f"{split}.npy" for split in ("train", "heldout")}
    if all(p.is_file() for p in paths.values()):
        return {k: np.load(p) for k, p in paths.items()}
    eos = tokenizer.convert_tokens_to_ids(EOS)
    streams = {"train": [], "heldout": []}
    files = stdlib_files()
    for path in files:
        ids = tokenizer(read(path))["input_ids"]
        streams["heldout" if is_held_out(path) else "train"].append(np.array(ids + [eos], dtype=np.uint16))
    out = {k: np.concatenate(v) for k, v in streams.items()}
    for k, p in paths.items():
        np.save(p, out[k])
    held = [p.relative_to(Path(sysconfig.get_paths()["stdlib"])).as_posix() for p in files if is_held_out(p)]
    (work / "heldout_files.json").write_text(json.dumps(held, indent=0))
    print(f"corpus: {len(files)} files, train {len(out['train']):,} tokens, held out {len(out['heldout']):,} "
          f"tokens in {len(held)} files")
    return out


def make_model(kind: str, vocab_size: int, eos: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=1024, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=eos, pad_token_id=None, rope_theta=10000.0,
                      architectures=["LlamaForCausalLM"], **SHAPES[kind])
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def autocast(device):
    """bfloat16 autocast on CUDA only: on CPUs without bfloat16 units (AVX2 only, like ours)
    bfloat16 matmuls were measured 5x slower than float32."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def batches(tokens: np.ndarray, batch: int, seq: int, seed: int):
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(tokens) - seq - 1, size=batch)
        chunk = np.stack([tokens[s: s + seq + 1] for s in starts]).astype(np.int64)
        yield torch.from_numpy(chunk)


@torch.no_grad()
def heldout_loss(model, tokens: np.ndarray, device, seq=512, max_tokens=200_000) -> float:
    model.eval()
    n = min(len(tokens) - 1, max_tokens) // seq * seq
    x = torch.from_numpy(tokens[: n + 1].astype(np.int64))
    total, count = 0.0, 0
    for i in range(0, n, seq * 8):
        inp = torch.stack([x[j: j + seq] for j in range(i, min(i + seq * 8, n), seq)]).to(device)
        tgt = torch.stack([x[j + 1: j + seq + 1] for j in range(i, min(i + seq * 8, n), seq)]).to(device)
        with autocast(device):
            logits = model(inp).logits
        total += F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), reduction="sum").item()
        count += tgt.numel()
    model.train()
    return total / count


def train(kind: str, work: Path, data, vocab_size: int, eos: int, minutes: float, device, teacher=None,
          distill_weight=0.5, name=None, batch=8, seq=256, lr=1.5e-3):
    """Train one model for `minutes` of wall clock (resuming its checkpoint); returns (model, state).

    With a teacher the loss is (1 - distill_weight) * cross-entropy + distill_weight * KL(teacher || model);
    name (default: kind) names the checkpoint and the loss log in `work`."""
    from tqdm import tqdm

    name = name or kind
    ckpt = work / f"{name}.pt"  # our own training state, written and read only by this script
    model = make_model(kind, vocab_size, eos).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    state = resume(ckpt, model, opt, device)
    budget = minutes * 60
    if state["elapsed"] >= budget:
        return model, state
    log = open(work / f"{name}_loss.csv", "a")
    stream = batches(data["train"], batch, seq, seed=state["step"] + (0 if kind == "target" else 10**6))
    bar = tqdm(total=int(budget), initial=int(state["elapsed"]), unit="s", desc=f"train {name}")
    model.train()
    last_save = time.time()
    while state["elapsed"] < budget:
        t0 = time.time()
        set_lr(opt, lr, state, budget, warmup_steps=100, floor=0.1)
        xy = next(stream).to(device)
        x, y = xy[:, :-1], xy[:, 1:]
        with autocast(device):
            logits = model(x).logits.float()
            loss = ce = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            if teacher is not None and distill_weight > 0:
                with torch.no_grad():
                    teacher_logp = F.log_softmax(teacher(x).logits.float(), -1)
                kd = F.kl_div(F.log_softmax(logits, -1), teacher_logp, log_target=True, reduction="batchmean") / seq
                loss = (1 - distill_weight) * ce + distill_weight * kd
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dt = time.time() - t0
        state["step"] += 1
        state["elapsed"] += dt
        state["tokens"] += x.numel()
        log.write(f"{state['step']},{state['elapsed']:.1f},{state['tokens']},{ce.item():.4f},{loss.item():.4f}\n")
        bar.update(int(state["elapsed"]) - bar.n)
        bar.set_postfix(loss=f"{ce.item():.3f}", tok_s=f"{x.numel() / dt:.0f}")
        if time.time() - last_save > 300 or state["elapsed"] >= budget:
            save(ckpt, model, opt, state)
            last_save = time.time()
    bar.close()
    log.close()
    return model, state


def export(kind: str, model, tokenizer, out: Path, meta: dict):
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="16MB")
    tokenizer.save_pretrained(out)
    GenerationConfig(eos_token_id=model.config.eos_token_id, do_sample=True, temperature=1.0,
                     max_new_tokens=128).save_pretrained(out)
    (out / "training.json").write_text(json.dumps(meta, indent=2))
    model.to(torch.float32)


def copy_heldout_list(work: Path, out: Path):
    """The held-out file names travel with the target, so tests can check the tokenizer on them."""
    (out / "heldout_files.json").write_text((work / "heldout_files.json").read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=str(ROOT / ".train-work"))
    parser.add_argument("--out", default=str(ROOT / "specengine" / "pretrained"))
    parser.add_argument("--target-minutes", type=float, default=90)
    parser.add_argument("--draft-minutes", type=float, default=30)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = stage_tokenizer(work)
    data = stage_corpus(work, tokenizer)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    V = len(tokenizer)
    t0 = time.time()
    target, target_state = train("target", work, data, V, eos, args.target_minutes, device)
    target_loss = heldout_loss(target, data["heldout"], device)
    print(f"target held-out loss {target_loss:.4f} (perplexity {math.exp(target_loss):.2f})")
    target.eval().requires_grad_(False)
    draft, draft_state = train("draft", work, data, V, eos, args.draft_minutes, device, teacher=target)
    draft_loss = heldout_loss(draft, data["heldout"], device)
    print(f"draft held-out loss {draft_loss:.4f} (perplexity {math.exp(draft_loss):.2f})")
    machine = f"{device.type}, {torch.get_num_threads()} threads" if device.type == "cpu" else torch.cuda.get_device_name()
    for kind, model, loss, state in (("target", target, target_loss, target_state),
                                     ("draft", draft, draft_loss, draft_state)):
        n_params = sum(p.numel() for p in model.parameters())
        meta = dict(kind=kind, parameters=n_params, heldout_loss=loss, heldout_perplexity=math.exp(loss),
                    train_steps=state["step"], train_tokens=state["tokens"], train_seconds=state["elapsed"],
                    machine=machine, torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
        export(kind, model, tokenizer, out / f"pycode-{kind}", meta)
    copy_heldout_list(work, out / "pycode-target")
    print(f"trained and exported in {time.time() - t0:.0f}s; folders in {out}; evaluating")
    import subprocess
    import sys

    subprocess.run([sys.executable, str(Path(__file__).with_name("evaluate_pair.py")), "--pair", str(out)],
                   check=True)


if __name__ == "__main__":
    main()
