"""Distil a small draft for SmolLM2-135M-Instruct (the default target) on CPU or CUDA, offline.

    python recipes/train_smollm2_draft.py                      # everything; re-run to resume
    python recipes/train_smollm2_draft.py --teach-minutes 50 --train-minutes 60

A draft earns its keep by agreeing with the target on what the target will write, so it is trained
on exactly that, and the teacher's tokens (its forward bounds the whole recipe on a CPU) are spent
once and reused:
  1. prompts   chat requests and code prefixes built from the standard library's *.py files,
               split by file (recipes/train_pair.py's split; the held-out files are never used)
  2. teach     the target answers the prompts (half greedy, half sampled at T=1); at every
               position its top-k log-probabilities are kept, in resumable shards
  3. held out  the teacher's answers to 64 held-out prompts, for the draft's held-out loss and
               agreement (logged at every checkpoint, against the training tokens seen)
  4. train     a 2-layer, d=256 Llama (embedding from a PCA of the target's, tied head) on the
               teacher's top-k (soft cross-entropy) plus the tokens themselves, epochs over the
               shards, cosine learning rate over the wall-clock budget, resumable
  5. export    a bfloat16 Hugging Face folder (no tokenizer files: it is the target's) whose head
               scores only the 8192 ids the teacher used most (q = 0 elsewhere, still lossless):
               the 49152-wide head was most of a draft step
Measure it with recipes/evaluate_smollm2_draft.py (alpha at gamma 1..8, c, the model card).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specengine.devtools.corpus import code_prompts, encode_prompt

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "recipes"))
from resumable import batches_of, resume, save, set_lr  # noqa: E402

TOP_K = 20
DRAFT_SHAPE = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=1024, head_dim=64)


# ---- 1. prompts ------------------------------------------------------------------------------

def split_prompts(tokenizer, seed: int, max_prompt: int, rounds: int, saved: dict | None = None) -> dict:
    """Train and held-out prompts. The train side grows in rounds: round r draws the requests
    again with seed + r (other functions of a file, other kinds of request), keeping only prompts
    not already in the list, so a teacher that has answered every prompt gets new ones while the
    answered ones keep their places (a resumed run reads the same shards)."""
    def encoded(held_out: bool, round_seed: int):
        prompts = code_prompts(held_out, round_seed)
        for p in prompts:
            p["ids"] = encode_prompt(tokenizer, p)
        return [p for p in prompts if 4 <= len(p["ids"]) <= max_prompt]

    out = saved or dict(train=encoded(False, seed), heldout=encoded(True, seed), rounds=1)
    out.setdefault("rounds", 1)
    seen = {tuple(p["ids"]) for p in out["train"]}
    while out["rounds"] < rounds:
        for p in encoded(False, seed + out["rounds"]):
            if tuple(p["ids"]) not in seen:
                seen.add(tuple(p["ids"]))
                out["train"].append(p)
        out["rounds"] += 1
    return out


# ---- 2. the teacher's answers and top-k ----------------------------------------------------

@torch.inference_mode()
def teach_batch(teacher, prompts: list[list[int]], max_new: int, temperature: float, eos: set[int],
                generator: torch.Generator):
    """The teacher continues each prompt; returns per row (tokens, top-k ids [L-1, K], top-k
    log-probs [L-1, K]) where position i holds the teacher's distribution for token i + 1."""
    device = teacher.device
    B, lengths = len(prompts), [len(p) for p in prompts]
    T = max(lengths)
    cache = teacher.new_cache(B, T + max_new + 1)
    padded = torch.tensor([p + [0] * (T - len(p)) for p in prompts], device=device)
    hidden = teacher(padded, torch.zeros(B, dtype=torch.long, device=device), cache, kv_len=T)
    logp = F.log_softmax(teacher.logits(hidden), -1)  # [B, T, V]
    top = logp.topk(TOP_K, -1)
    ids = [[top.indices[b, : lengths[b]]] for b in range(B)]
    vals = [[top.values[b, : lengths[b]]] for b in range(B)]
    seqs = [list(p) for p in prompts]
    cache.lengths.copy_(torch.tensor(lengths, device=device))
    last = logp[torch.arange(B), torch.tensor(lengths, device=device) - 1]  # [B, V]
    done = [False] * B
    for _ in range(max_new):
        if temperature == 0:
            nxt = last.argmax(-1)
        else:
            nxt = torch.multinomial((last / temperature).softmax(-1), 1, generator=generator)[:, 0]
        nxt_list = nxt.tolist()
        for b in range(B):
            if not done[b]:
                seqs[b].append(nxt_list[b])
                done[b] = nxt_list[b] in eos
        if all(done):
            break
        hidden = teacher(nxt[:, None], cache.lengths.clone(), cache)
        cache.lengths.add_(1)
        last = F.log_softmax(teacher.logits(hidden[:, 0]), -1)
        top = last.topk(TOP_K, -1)
        for b in range(B):
            if not done[b]:
                ids[b].append(top.indices[b: b + 1])
                vals[b].append(top.values[b: b + 1])
    out = []
    for b in range(B):
        L = len(seqs[b])
        out.append((np.array(seqs[b], dtype=np.int32),
                    torch.cat(ids[b])[: L - 1].cpu().numpy().astype(np.int32),
                    torch.cat(vals[b])[: L - 1].float().cpu().numpy().astype(np.float16)))
    return out


def load_teacher(target_dir: Path, device):
    from specengine.models import load_model

    # Float32 matrices on a CPU: a batch's products then run as float32 GEMMs, about twice the
    # tokens/s of the bfloat16 whole-layer kernels (made for one row) at 16-32 rows here.
    return load_model(target_dir, device, weight_dtype="float32" if device.type == "cpu" else None)


def stage_teach(work: Path, target_dir: Path, prompts: list[dict], minutes: float, device, batch: int,
                max_new: int, eos: set[int]):
    """Shards of teacher data until the budget is spent; a re-run continues after the last shard."""
    shards = sorted(work.glob("teach-*.npz"))
    state_path = work / "teach_state.json"
    state = json.loads(state_path.read_text()) if state_path.is_file() else dict(next_prompt=0, elapsed=0.0,
                                                                               tokens=0, generated=0)
    if state["elapsed"] >= minutes * 60 or state["next_prompt"] >= len(prompts):
        return shards
    teacher = load_teacher(target_dir, device)
    generator = torch.Generator(device=device).manual_seed(len(shards))
    while state["elapsed"] < minutes * 60 and state["next_prompt"] < len(prompts):
        t0 = time.time()
        chunk = prompts[state["next_prompt"]: state["next_prompt"] + batch]
        # Alternate greedy and sampled batches: greedy acceptance needs the argmax path, sampled
        # acceptance the distribution along sampled paths.
        temperature = 0.0 if (state["next_prompt"] // batch) % 2 == 0 else 1.0
        rows = teach_batch(teacher, [p["ids"] for p in chunk], max_new, temperature, eos, generator)
        shard = work / f"teach-{len(shards):05d}.npz"
        save_shard(shard, chunk, rows)
        shards.append(shard)
        state["next_prompt"] += len(chunk)
        state["elapsed"] += time.time() - t0
        state["tokens"] += sum(len(r[0]) for r in rows)
        state["generated"] += sum(len(r[0]) - len(p["ids"]) for r, p in zip(rows, chunk))
        state_path.write_text(json.dumps(state))
        print(f"teach: {state['next_prompt']} prompts, {state['tokens']} tokens ({state['generated']} generated), "
              f"{state['elapsed'] / 60:.1f} min, {state['tokens'] / state['elapsed']:.0f} tok/s", flush=True)
    return shards


def save_shard(path: Path, prompts: list[dict], rows):
    np.savez(path, tokens=np.concatenate([r[0] for r in rows]), lengths=np.array([len(r[0]) for r in rows]),
             prompt_lengths=np.array([len(p["ids"]) for p in prompts]),
             top_ids=np.concatenate([r[1] for r in rows]), top_logp=np.concatenate([r[2] for r in rows]))


def stage_heldout(work: Path, target_dir: Path, prompts: list[dict], device, max_new: int, eos: set[int],
                  count: int = 64) -> list[Path]:
    """The teacher's answers to held-out prompts (greedy, then sampled): the draft's held-out loss
    and agreement are measured on them, never trained on."""
    paths = [work / "heldout-greedy.npz", work / "heldout-sampled.npz"]
    if all(p.is_file() for p in paths):
        return paths
    teacher = load_teacher(target_dir, device)
    generator = torch.Generator(device=device).manual_seed(12345)
    chosen = prompts[:count]
    for path, temperature in zip(paths, (0.0, 1.0)):
        rows = []
        for i in range(0, len(chosen), 32):
            rows += teach_batch(teacher, [p["ids"] for p in chosen[i: i + 32]], max_new, temperature, eos, generator)
        save_shard(path, chosen, rows)
    return paths


@torch.no_grad()
def heldout_metrics(model, heldout: list[Path], device, seq_cap: int = 512) -> dict:
    """On the teacher's held-out answers (generated positions only): the draft's cross-entropy on
    the teacher's tokens, and how often its argmax is the teacher's argmax (on the greedy answers
    that is the acceptance rate of greedy drafting at gamma 1)."""
    model.eval()
    out = {}
    for path in heldout:
        seqs = load_shards([path])
        ce_sum = agree = count = 0.0
        for i in range(0, len(seqs), 8):
            x, y, top_ids, _, weight = (t.to(device) for t in collate(seqs[i: i + 8], seq_cap, 0.0))
            logits = model(x).logits.float()
            gen = weight > 0
            ce = F.cross_entropy(logits[gen], y[gen], reduction="sum")
            ce_sum += ce.item()
            agree += (logits.argmax(-1) == top_ids[..., 0])[gen].float().sum().item()
            count += gen.sum().item()
        kind = path.stem.split("-")[1]
        out[f"heldout_loss_{kind}"] = round(ce_sum / count, 4)
        out[f"heldout_top1_agreement_{kind}"] = round(agree / count, 4)
    model.train()
    return out


# ---- 3. the draft ----------------------------------------------------------------------------

def load_shards(shards):
    """Every taught sequence: (tokens [L], top ids [L-1, K], top log-probs [L-1, K], prompt length)."""
    seqs = []
    for path in shards:
        with np.load(path) as z:
            tokens, lengths, plens = z["tokens"], z["lengths"], z["prompt_lengths"]
            top_ids, top_logp = z["top_ids"], z["top_logp"]
        t = p = 0
        for L, P in zip(lengths, plens):
            seqs.append((tokens[t: t + L], top_ids[p: p + L - 1], top_logp[p: p + L - 1], int(P)))
            t, p = t + L, p + L - 1
    return seqs


def make_draft(target_dir: Path, vocab: int, eos: int, bos: int | None):
    """A small Llama whose embedding starts as the target's projected onto its top principal axes."""
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    target_cfg = json.loads((target_dir / "config.json").read_text())
    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=target_cfg["max_position_embeddings"],
                      tie_word_embeddings=True, rope_theta=target_cfg["rope_theta"], bos_token_id=bos,
                      eos_token_id=eos, rms_norm_eps=1e-5, architectures=["LlamaForCausalLM"], **DRAFT_SHAPE)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with safe_open(target_dir / "model.safetensors", framework="pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight").float()
    centred = emb - emb.mean(0)
    _, _, v = torch.linalg.svd(centred[torch.randperm(len(emb))[:16384]], full_matrices=False)
    projected = emb @ v[: DRAFT_SHAPE["hidden_size"]].T
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(projected * (0.02 / projected.std()))
    return model


def collate(batch, seq_cap: int, prompt_weight: float):
    T = min(max(len(s[0]) for s in batch), seq_cap) - 1
    B = len(batch)
    x = torch.zeros(B, T, dtype=torch.long)
    y = torch.full((B, T), -100, dtype=torch.long)
    top_ids = torch.zeros(B, T, TOP_K, dtype=torch.long)
    top_p = torch.zeros(B, T, TOP_K)
    weight = torch.zeros(B, T)
    for b, (tokens, ids, logp, plen) in enumerate(batch):
        n = min(len(tokens), T + 1) - 1
        x[b, :n] = torch.from_numpy(tokens[:n].astype(np.int64))
        y[b, :n] = torch.from_numpy(tokens[1: n + 1].astype(np.int64))
        top_ids[b, :n] = torch.from_numpy(ids[:n].astype(np.int64))
        top_p[b, :n] = torch.from_numpy(logp[:n].astype(np.float32)).exp()
        weight[b, :n] = 1.0
        weight[b, : max(0, plen - 1)] = prompt_weight  # positions predicting prompt tokens
    return x, y, top_ids, top_p, weight


def stage_train(work: Path, target_dir: Path, shards, heldout, minutes: float, device, vocab: int, eos: int,
                bos: int | None, max_tokens: int, lr: float, kd_weight: float, prompt_weight: float,
                seq_cap: int = 512):
    from tqdm import tqdm

    ckpt = work / "draft.pt"  # this recipe's own training state, read back with weights_only=True
    model = make_draft(target_dir, vocab, eos, bos).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    state = resume(ckpt, model, opt, device)
    budget = minutes * 60
    if state["elapsed"] >= budget:
        return model, state
    seqs = load_shards(shards)
    print(f"train: {len(seqs)} sequences, {sum(len(s[0]) for s in seqs)} tokens from {len(shards)} shards")
    stream = batches_of(seqs, max_tokens, seq_cap, np.random.default_rng(state["step"]))
    log = open(work / "draft_loss.csv", "a")
    bar = tqdm(total=int(budget), initial=int(state["elapsed"]), unit="s", desc="train draft")
    model.train()
    last_save = time.time()
    while state["elapsed"] < budget:
        t0 = time.time()
        set_lr(opt, lr, state, budget, warmup_steps=50, floor=0.05)
        x, y, top_ids, top_p, weight = (t.to(device) for t in collate(next(stream), seq_cap, prompt_weight))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x).logits.float()
        logq = F.log_softmax(logits, -1)
        ce = -logq.gather(-1, y.clamp(min=0)[..., None])[..., 0]
        soft = -(top_p * logq.gather(-1, top_ids)).sum(-1)  # the teacher's top-k mass, against the draft
        per_pos = (1 - kd_weight) * ce + kd_weight * soft
        loss = (per_pos * weight).sum() / weight.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            gen = weight == 1.0
            agree = (logits.argmax(-1) == top_ids[..., 0])[gen].float().mean().item()
        dt, positions = time.time() - t0, int((weight > 0).sum())
        state["step"] += 1
        state["elapsed"] += dt
        state["tokens"] += positions
        log.write(f"{state['step']},{state['elapsed']:.1f},{state['tokens']},{loss.item():.4f},{agree:.4f}\n")
        bar.update(int(state["elapsed"]) - bar.n)
        bar.set_postfix(loss=f"{loss.item():.3f}", agree=f"{agree:.3f}", tok_s=f"{positions / dt:.0f}")
        if time.time() - last_save > 300 or state["elapsed"] >= budget:
            # Held-out metrics against the training tokens seen so far (outside the clock).
            state["heldout"] = heldout_metrics(model, heldout, device)
            with open(work / "draft_heldout.jsonl", "a") as f:
                f.write(json.dumps(dict(step=state["step"], train_tokens=state["tokens"], **state["heldout"])) + "\n")
            save(ckpt, model, opt, state)
            last_save = time.time()
    bar.close()
    log.close()
    return model, state


def frequent_ids(shards, count: int, always: set[int]) -> torch.Tensor:
    """The `count` ids the teacher wrote or ranked most often (its tokens and its top-k), with
    `always` (the special tokens) among them, sorted."""
    counts = np.zeros(0, dtype=np.int64)
    for path in shards:
        with np.load(path) as z:
            seen = np.concatenate([z["tokens"], z["top_ids"][:, :4].reshape(-1)])
        c = np.bincount(seen)
        counts = np.pad(counts, (0, max(0, len(c) - len(counts))))
        counts[: len(c)] += c
    order = sorted(always) + [int(i) for i in np.argsort(-counts, kind="stable") if i not in always]
    return torch.tensor(sorted(order[:count]), dtype=torch.int64)


def export(model, out: Path, meta: dict, output_ids: torch.Tensor | None):
    """A bfloat16 folder; with output_ids the head scores only those ids (config output_vocab_size,
    tensor lm_head.token_ids: specengine's cheap draft head, q = 0 elsewhere)."""
    from safetensors.torch import load_file, save_file
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    # No tokenizer files: the draft is the target's, and SmolLM2's tokenizer.json alone is 3.5 MB
    # of the 30 MB the repository allows it. specengine then uses the target's tokenizer.
    model.to(torch.bfloat16).save_pretrained(out)
    GenerationConfig(eos_token_id=model.config.eos_token_id, bos_token_id=model.config.bos_token_id).save_pretrained(out)
    if output_ids is not None:
        weights = load_file(out / "model.safetensors")
        weights["lm_head.token_ids"] = output_ids
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        cfg = json.loads((out / "config.json").read_text())
        cfg["output_vocab_size"] = len(output_ids)
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=ROOT / ".train-work" / "smollm2-draft")
    parser.add_argument("--out", type=Path, default=ROOT / "specengine" / "pretrained" / "smollm2-draft")
    parser.add_argument("--target", type=Path, help="the target: a folder, or a GGUF file converted once into the cache "
                        "(default: specengine.default_target())")
    parser.add_argument("--teach-minutes", type=float, default=55)
    parser.add_argument("--train-minutes", type=float, default=65)
    parser.add_argument("--prompt-rounds", type=int, default=1,
                        help="rounds of train prompts (each round draws the requests again with a new seed)")
    parser.add_argument("--teach-batch", type=int, default=32)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--heldout-prompts", type=int, default=64,
                        help="held-out prompts the teacher answers (greedy and sampled) for the draft's held-out metrics")
    parser.add_argument("--max-prompt", type=int, default=384)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--kd-weight", type=float, default=0.7)
    parser.add_argument("--prompt-weight", type=float, default=0.2)
    parser.add_argument("--output-vocab", type=int, default=8192,
                        help="the head scores only the ids the teacher used most (0: the whole vocabulary)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from specengine.models.gguf import convert_gguf
    from specengine.models.loader import is_gguf
    from specengine.shipped import default_target
    from specengine.tokenizer import cache_dir, load_tokenizer

    device = torch.device(args.device)
    target_dir = args.target or default_target()
    if is_gguf(target_dir):  # the recipe reads a folder's config and embedding: the file as one, made once
        folder = cache_dir() / target_dir.name.split(".")[0]
        if not (folder / "config.json").is_file():
            print(f"converting {target_dir.name} once into {folder}")
            convert_gguf(target_dir, folder, progress=False)
        target_dir = folder
    args.work.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(target_dir)
    prompts_path = args.work / "prompts.json"
    saved = json.loads(prompts_path.read_text()) if prompts_path.is_file() else None
    prompts = split_prompts(tokenizer, args.seed, args.max_prompt, args.prompt_rounds, saved)
    if prompts != saved:
        prompts_path.write_text(json.dumps(prompts))
    print(f"prompts: {len(prompts['train'])} train, {len(prompts['heldout'])} held out")
    target_cfg = json.loads((target_dir / "config.json").read_text())
    eos = {target_cfg["eos_token_id"], tokenizer.eos_token_id}
    shards = stage_teach(args.work, target_dir, prompts["train"], args.teach_minutes, device, args.teach_batch,
                         args.max_new, eos)
    heldout = stage_heldout(args.work, target_dir, prompts["heldout"], device, args.max_new, eos,
                            args.heldout_prompts)
    model, state = stage_train(args.work, target_dir, shards, heldout, args.train_minutes, device,
                               target_cfg["vocab_size"],
                               tokenizer.eos_token_id, target_cfg.get("bos_token_id"), args.batch_tokens, args.lr,
                               args.kd_weight, args.prompt_weight)
    teach = json.loads((args.work / "teach_state.json").read_text())
    meta = dict(recipe="recipes/train_smollm2_draft.py", target=str(target_dir.name), device=str(device),
                threads=torch.get_num_threads(), prompt_rounds=prompts["rounds"], teacher_prompts=teach["next_prompt"],
                teacher_tokens=teach["tokens"], teacher_generated_tokens=teach["generated"],
                teach_minutes=teach["elapsed"] / 60, train_minutes=state["elapsed"] / 60,
                train_steps=state["step"], train_tokens=state["tokens"], shape=DRAFT_SHAPE, top_k=TOP_K,
                heldout_prompts=min(args.heldout_prompts, len(prompts["heldout"])), **state.get("heldout", {}),
                kd_weight=args.kd_weight, lr=args.lr, output_vocab=args.output_vocab or target_cfg["vocab_size"],
                date=time.strftime("%Y-%m-%d"))
    output_ids = None
    if args.output_vocab:
        output_ids = frequent_ids(shards, args.output_vocab, set(tokenizer.all_special_ids))
    export(model, args.out, meta, output_ids)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
