"""Train an EAGLE-3 draft head for SmolLM2-135M-Instruct (the default target, a Q4_1 GGUF file),
offline on a CPU, and write it in the published checkpoint format.

    python recipes/train_eagle3.py --work /work/eagle3-run --out /work/eagle3-run/head   # re-run to resume
    python recipes/train_eagle3.py ... --project-requests 6000 --self-requests 3000 --train-minutes 120

Stages, each resumable (its state in --work; a finished stage is skipped when run again):
  1. requests  chat requests of twelve kinds (writing, roleplay, reasoning, math, coding, extraction,
               STEM, humanities, translation, summarization, QA, retrieval-augmented answering) from
               templates x topics x details, some with a follow-up turn, coding requests about the
               standard library (specengine.devtools.corpus); and requests the target writes itself
               (the chat template up to the user's turn, sampled with one seed each, deduplicated and
               filtered). bench/bench_categories.py's prompts are dropped; 1 request in
               --heldout-share (a hash of the request and the seed) is held out.
  2. teach     the target answers them (specengine's Engine, target-only, on the GGUF file, batched;
               alternately greedy and T=1), in resumable shards. A follow-up turn is asked after the
               target's first answer.
  3. vocab     the draft vocabulary: the N ids the target's answers use most (plus the special ids);
               d2t/t2d; the share of answer tokens it covers is reported.
  4. features  the runtime's own target (specengine's load of the same file, its C++ products;
               prompt-sized calls run as GEMMs) captures, for every token of prompt + answer, the
               states entering the capture layers (LlamaForCausalLM.capture_features, what the
               engine hands the drafter) and gives the final (normed) hidden state from which the
               loss takes the target's distribution, and its argmax; stored as bfloat16 .npy
               shards (memory-mapped when training).
  5. train     the head, target frozen, with the training-time test below; soft cross-entropy against
               the target's distribution restricted to the draft vocabulary; cosine learning rate
               over a wall-clock budget; checkpoints; progress lines (tokens/s, loss, held-out accept).
  6. evaluate  held-out acceptance by draft position (T=0 and T=1), eval.json next to the head.
  7. export    the published-format folder: config.json, model.safetensors, README.md (model card),
               written by the runtime's writer (specengine.models.eagle3.save_eagle3) from the
               runtime's config of the head, and read back by its loader (load_eagle3).

The published format (checked against vLLM's llama_eagle3.py and its model runner, SGLang's
llama_eagle3.py, SpecForge's trainer and the EAGLE repository's; written here in my words):
- config.json: architectures ["LlamaForCausalLMEagle3"], a Llama config of ONE layer at the
  target's width (heads, kv heads, intermediate size, rope, eps), vocab_size = the target's,
  draft_vocab_size = the head's output size, target_hidden_size; the capture layers as
  eagle_aux_hidden_state_layer_ids, read by vLLM at the top level and then inside eagle_config
  ({"eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state": true}): this recipe writes both.
  Without them vLLM captures layers (2, L // 2, L - 3) of an L-layer target: (2, 15, 27) here.
- Captured state of layer i = the INPUT of decoder layer i, i.e. the residual stream after layer
  i - 1 (vLLM appends hidden_states + residual before running layer i). In transformers'
  output_hidden_states tuple, index 0 is the embedding output (= input of layer 0) and index i
  the output of layer i - 1 (= input of layer i); the last index (L) is after the final norm.
  So capture layer i is hidden_states[i], and hidden_states[L] is what the target's lm_head reads.
- Tensors (safetensors, no `model.` prefix): fc.weight [H, 3H] (the three states concatenated
  low, middle, high); midlayer.hidden_norm.weight [H], midlayer.input_layernorm.weight [H],
  midlayer.self_attn.{q,k,v}_proj.weight [heads*d | kv*d, 2H], o_proj [H, heads*d],
  midlayer.mlp.{gate,up,down}_proj, midlayer.post_attention_layernorm.weight, norm.weight,
  lm_head.weight [draft_vocab, H], d2t int64 [draft_vocab] (target id = draft id + d2t[draft id]),
  t2d bool [vocab] (vLLM ignores t2d). No embedding: the target's embed_tokens is shared.
- The layer: e = input_layernorm(embed(token)), h' = hidden_norm(h), x = cat([e, h']) (embedding
  first); attention on x (q/k/v take 2H); residual = h (taken before hidden_norm:
  norm_before_residual false) + o_proj(...); then post_attention_layernorm, mlp, + residual.
  That sum (before `norm`) is the head's output hidden; logits = lm_head(norm(output)).
- Drafting: the first step pairs the target's fused states of position t, fc([s_low, s_mid,
  s_high]), with the embedding of token t + 1 (the token sampled after t) at rope position t, and
  predicts token t + 2. Each later step feeds back the head's own output hidden (pre-norm, not
  through fc again) with the embedding of the token it just drafted, one position further on,
  attending to the keys of every earlier step of the chain and of the verified tokens.
- Training-time test (EAGLE-3, SpecForge): unroll k steps over every start position at once,
  each step's hidden input being the previous step's output; loss per step = soft cross-entropy
  -sum p log q with p = softmax of the target's logits restricted to the draft vocabulary, q the
  head's, on positions whose target argmax lies in the draft vocabulary (and that are in the
  loss mask); step j weighted 0.8^j; no feature-regression loss (EAGLE-3 dropped EAGLE-1's).
  SpecForge and the EAGLE repository also mask, at step j, the verified keys of positions
  t - j + 1 .. t from chain t's query (disputed in EAGLE issue #247); inference attends to all of
  them, so this recipe's attention is the inference one (Eagle3Head.ttt: step-0 keys of positions
  <= t plus the chain's own steps), and its rope positions are t + j as at inference.
  tests/test_eagle3_recipe.py checks that an exported head, loaded by the runtime, drafts chains
  whose q is this module's at every step (within float32's bound).

Measured throughput on this 2-core CPU and sizes that finish in a few hours:
bench/results/eagle3-recipe-trial-2026-12-03.md.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "recipes"))
from eagle3_head import Eagle3Head, save_head  # noqa: E402
from eagle3_requests import (distinct_non_benchmark, is_held_out, normalized, project_requests,  # noqa: E402
                             sane_request)
from resumable import batches_of, resume, save, set_lr  # noqa: E402

STEP_WEIGHT = 0.8  # step j of the unrolled chain weighs STEP_WEIGHT**j (EAGLE's)


def log(message: str):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def read_json(path: Path, default):
    return json.loads(path.read_text()) if path.is_file() else default


def write_json(path: Path, value):
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    tmp.replace(path)


def load_engine(target: Path):
    from specengine import Engine

    return Engine.from_pretrained(target)


# ---- 1. requests -----------------------------------------------------------------------------

def user_turn_prefix(tokenizer) -> str:
    """The chat template's text up to the user's message (system prompt, then the user's header)."""
    mark = "\x00MESSAGE\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    return text[: text.index(mark)]


def self_written_requests(engine, count: int, seed: int, max_tokens: int, batch: int) -> tuple[list[dict], dict]:
    """Requests the target writes: sampled (T=1, top-p 0.95) after the template's user header, one
    seed each; the sane ones, deduplicated. Returns (requests, stats)."""
    from specengine import SamplingParams

    prefix = engine.tokenizer(user_turn_prefix(engine.tokenizer), add_special_tokens=False)["input_ids"]
    out, seen, tried = [], set(), 0
    for start in range(0, count, batch):
        n = min(batch, count - start)
        params = [SamplingParams(max_new_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=seed * 1_000_003 + start + i)
                  for i in range(n)]
        for result in engine.generate([prefix] * n, params):
            tried += 1
            text = (result.text or "").strip()
            if result.finish_reason == "stop" and sane_request(text) and normalized(text) not in seen:
                seen.add(normalized(text))
                out.append(dict(kind="self", turns=[text], source="target"))
        log(f"requests: the target wrote {tried} of {count}, {len(out)} kept")
    return out, dict(tried=tried, kept=len(out))


def stage_requests(work: Path, target: Path, args) -> dict:
    path = work / "requests.json"
    saved = read_json(path, None)
    if saved is not None:
        return saved
    t0 = time.time()
    requests = project_requests(args.project_requests, args.seed)
    stats = dict(project=len(requests))
    if args.self_requests:
        engine = load_engine(target)
        written, stats["self"] = self_written_requests(engine, args.self_requests, args.seed, args.self_max_tokens,
                                                       args.teach_batch)
        requests += written
    unique = distinct_non_benchmark(requests)
    stats["dropped"] = len(requests) - len(unique)
    heldout = [r for r in unique if is_held_out(r["turns"][0], args.seed, args.heldout_share)][: args.heldout_requests]
    held = {id(r) for r in heldout}
    train = [r for r in unique if id(r) not in held
             and not is_held_out(r["turns"][0], args.seed, args.heldout_share)]
    saved = dict(train=train, heldout=heldout, stats=stats, seconds=time.time() - t0)
    write_json(path, saved)
    log(f"requests: {len(train)} train, {len(heldout)} held out ({stats}), {saved['seconds']:.0f} s")
    return saved


# ---- 2. teach --------------------------------------------------------------------------------

def answer_span(tokenizer, first_prompt: list[int], conversation: list[int], answer_text: str) -> tuple[int, int]:
    """Where the first answer sits in the re-templated conversation (empty if the template did not
    keep the first prompt as a prefix)."""
    if conversation[: len(first_prompt)] != first_prompt:
        return 0, 0
    n = len(tokenizer(answer_text, add_special_tokens=False)["input_ids"]) + 1  # and its end-of-turn token
    return len(first_prompt), min(len(first_prompt) + n, len(conversation))


def teach_batch(engine, requests: list[dict], first_index: int, max_new: int, seed: int):
    """The target answers each request (a follow-up turn after its first answer). Row i is
    greedy when first_index + i is even, else T=1 with its own seed. Returns per request
    (tokens [L] int32, answer mask [L] bool, temperature)."""
    from specengine import SamplingParams

    temps = [0.0 if (first_index + i) % 2 == 0 else 1.0 for i in range(len(requests))]
    params = [SamplingParams(max_new_tokens=max_new, temperature=t, seed=seed * 7919 + first_index + i)
              for i, t in enumerate(temps)]
    messages = [[{"role": "user", "content": r["turns"][0]}] for r in requests]
    prompts = [engine.chat_prompt(m) for m in messages]
    results = engine.generate(prompts, params)
    spans = [(0, 0)] * len(requests)
    follow = [i for i, r in enumerate(requests) if len(r["turns"]) > 1]
    if follow:
        convs = []
        for i in follow:
            first = engine.tokenizer.decode(results[i].token_ids, skip_special_tokens=True)
            messages[i] += [{"role": "assistant", "content": first}, {"role": "user", "content": requests[i]["turns"][1]}]
            convs.append(engine.chat_prompt(messages[i]))
            spans[i] = answer_span(engine.tokenizer, prompts[i], convs[-1], first)
        for i, conv, result in zip(follow, convs, engine.generate(convs, [params[i] for i in follow])):
            prompts[i], results[i] = conv, result
    rows = []
    for prompt, result, (a, b), temp in zip(prompts, results, spans, temps):
        tokens = np.array(prompt + result.token_ids, dtype=np.int32)
        answer = np.zeros(len(tokens), dtype=bool)
        answer[a:b] = True
        answer[len(prompt):] = True
        rows.append((tokens, answer, temp))
    return rows


def save_teach_shard(path: Path, rows, kinds: list[str]):
    np.savez(path, tokens=np.concatenate([r[0] for r in rows]), answer=np.concatenate([r[1] for r in rows]),
             lengths=np.array([len(r[0]) for r in rows]), temperature=np.array([r[2] for r in rows], dtype=np.float32),
             kind=np.array(kinds))


def stage_teach(work: Path, target: Path, requests: list[dict], name: str, args, minutes: float) -> list[Path]:
    """Shards teach/{name}-NNNNN.npz until every request is answered or the budget is spent."""
    folder = work / "teach"
    folder.mkdir(exist_ok=True)
    state_path = work / f"teach-{name}.json"
    state = read_json(state_path, dict(next_request=0, elapsed=0.0, tokens=0, answer_tokens=0))
    shards = sorted(folder.glob(f"{name}-*.npz"))
    if state["elapsed"] >= minutes * 60 or state["next_request"] >= len(requests):
        return shards
    engine = load_engine(target)
    while state["elapsed"] < minutes * 60 and state["next_request"] < len(requests):
        t0 = time.time()
        first = state["next_request"]
        chunk = requests[first: first + args.teach_batch]
        rows = teach_batch(engine, chunk, first, args.max_new, args.seed)
        shard = folder / f"{name}-{len(shards):05d}.npz"
        save_teach_shard(shard, rows, [r["kind"] for r in chunk])
        shards.append(shard)
        state["next_request"] += len(chunk)
        state["elapsed"] += time.time() - t0
        state["tokens"] += int(sum(len(r[0]) for r in rows))
        state["answer_tokens"] += int(sum(r[1].sum() for r in rows))
        write_json(state_path, state)
        log(f"teach {name}: {state['next_request']}/{len(requests)} requests, {state['tokens']} tokens "
            f"({state['answer_tokens']} answer), {state['elapsed'] / 60:.1f} min, "
            f"{state['next_request'] / state['elapsed']:.2f} requests/s, "
            f"{state['answer_tokens'] / state['elapsed']:.0f} answer tok/s")
    return shards


def load_teach(shards: list[Path]) -> list[dict]:
    """Every taught sequence: tokens, answer mask, temperature, kind, and where its features lie."""
    seqs = []
    for path in shards:
        with np.load(path) as z:
            tokens, answer, lengths, temps, kinds = z["tokens"], z["answer"], z["lengths"], z["temperature"], z["kind"]
        offset = 0
        for L, temp, kind in zip(lengths, temps, kinds):
            seqs.append(dict(tokens=tokens[offset: offset + L], answer=answer[offset: offset + L], temperature=float(temp),
                             kind=str(kind), shard=path.stem, offset=offset))
            offset += L
    return seqs


# ---- 3. vocab --------------------------------------------------------------------------------

def stage_vocab(work: Path, train: list[dict], heldout: list[dict], size: int, vocab_size: int, always: set[int]) -> dict:
    path = work / "vocab.json"
    saved = read_json(path, None)
    if saved is not None and saved["size"] == size:
        return saved
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in train:
        counts += np.bincount(s["tokens"][s["answer"]], minlength=vocab_size)
    if size > vocab_size:
        raise ValueError(f"--draft-vocab {size} exceeds the target's vocabulary of {vocab_size}")
    order = sorted(always) + [int(i) for i in np.argsort(-counts, kind="stable") if int(i) not in always]
    ids = sorted(order[:size])
    chosen = np.zeros(vocab_size, dtype=bool)
    chosen[ids] = True

    def coverage(seqs):
        tokens = np.concatenate([s["tokens"][s["answer"]] for s in seqs]) if seqs else np.zeros(0, dtype=np.int64)
        return round(float(chosen[tokens].mean()), 4) if len(tokens) else None

    saved = dict(size=size, ids=ids, distinct_answer_ids=int((counts > 0).sum()),
                 coverage_train=coverage(train), coverage_heldout=coverage(heldout))
    write_json(path, saved)
    log(f"vocab: {size} ids; they cover {saved['coverage_train']} of the train answer tokens, "
        f"{saved['coverage_heldout']} of the held-out ones ({saved['distinct_answer_ids']} distinct ids used)")
    return saved


# ---- 4. features -----------------------------------------------------------------------------

def target_config(target: Path):
    """The target's ModelConfig (a GGUF file's or a folder's), without loading its weights."""
    from specengine.models.config import ModelConfig
    from specengine.models.gguf import gguf_config, open_gguf
    from specengine.models.loader import is_gguf

    return ModelConfig.from_dict(gguf_config(open_gguf(target), target)) if is_gguf(target) else \
        ModelConfig.from_folder(target)


def load_target(target: Path, aux_layers: list[int]):
    """The runtime's target (a GGUF file's matrices kept as stored, float32 arithmetic; or a
    folder), capturing the states entering aux_layers in every forward."""
    from specengine.models import load_model

    model = load_model(target)
    model.capture_features(tuple(aux_layers))
    return model.eval()


def to_bf16_bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def from_bf16_bits(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a).view(np.int16)).view(torch.bfloat16).float()  # a copy: mmap slices are read-only


@torch.inference_mode()
def features_of(model, seqs: list[np.ndarray]):
    """Per sequence: captured states [L, k * H] (the inputs of the model's capture layers), final
    normed hidden [L, H] and the target's argmax [L], from one forward of the sequences right-padded
    into a batch (a row's positions see only its own earlier tokens, and its products do not depend
    on the rows beside it)."""
    B, T = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(B, T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.from_numpy(s.astype(np.int64))
    final = model(ids, torch.zeros(B, dtype=torch.long), model.new_cache(B, T, growable=False), kv_len=T)
    aux = model.features
    argmax = torch.cat([model.logits(final[:, i: i + 128]).argmax(-1) for i in range(0, T, 128)], 1)
    return [(aux[b, : len(s)], final[b, : len(s)], argmax[b, : len(s)]) for b, s in enumerate(seqs)]


def dense_rows(module, rows: int) -> torch.Tensor:
    """A model's embedding or output matrix [rows, H] as float32 values (a stored matrix dequantized
    as the runtime computes with it)."""
    from specengine.ops.blocks import dequantize_reference

    if hasattr(module, "matrix"):
        return dequantize_reference(module.matrix).float()
    return module.weight.detach().float()


def stage_features(work: Path, target: Path, shards: list[Path], aux_layers: list[int]) -> dict:
    """For every teach shard, features/<shard>.{aux,final,argmax}.npy; the target's embedding once
    (embed.npy), and its output matrix (lm_head.npy) when it is not the embedding. Each sequence is
    one forward of its own: its products are GEMMs at any batch, so padding would only add work
    (a fifth more on the trial's shards grouped into 2048-token batches)."""
    folder = work / "features"
    folder.mkdir(exist_ok=True)
    state_path = work / "features.json"
    state = read_json(state_path, dict(elapsed=0.0, tokens=0, done=[]))
    todo = [p for p in shards if p.stem not in state["done"]]
    if not todo and (work / "embed.npy").is_file():
        return state
    t_load = time.time()
    model = load_target(target, aux_layers)
    state["load_seconds"] = time.time() - t_load
    V = model.config.vocab_size
    embed = dense_rows(model.model.embed_tokens, V)
    np.save(work / "embed.npy", embed.numpy())
    if not model.config.tie_word_embeddings:  # a tied target's (SmolLM2's) output matrix is its embedding
        np.save(work / "lm_head.npy", dense_rows(model.lm_head, V).numpy())
    for path in todo:
        t0 = time.time()
        seqs = [s["tokens"] for s in load_teach([path])]
        results = [features_of(model, [seq])[0] for seq in seqs]
        for part, k in (("aux", 0), ("final", 1)):
            np.save(folder / f"{path.stem}.{part}.npy", to_bf16_bits(torch.cat([r[k] for r in results])))
        np.save(folder / f"{path.stem}.argmax.npy", torch.cat([r[2] for r in results]).numpy().astype(np.int32))
        state["done"].append(path.stem)
        state["elapsed"] += time.time() - t0
        state["tokens"] += int(sum(len(s) for s in seqs))
        write_json(state_path, state)
        log(f"features: {len(state['done'])}/{len(shards)} shards, {state['tokens']} tokens, "
            f"{state['tokens'] / state['elapsed']:.0f} tok/s")
    return state


class Features:
    """The features of taught sequences, memory-mapped from the shards."""

    def __init__(self, folder: Path):
        self.folder, self.maps = folder, {}

    def get(self, shard: str, part: str) -> np.ndarray:
        if (shard, part) not in self.maps:
            self.maps[shard, part] = np.load(self.folder / f"{shard}.{part}.npy", mmap_mode="r")
        return self.maps[shard, part]

    def batch(self, seqs: list[dict], seq_cap: int):
        """aux [B, T, k * H], final [B, T, H] float32; argmax, tokens [B, T] long; answer, valid [B, T] bool."""
        T = min(max(len(s["tokens"]) for s in seqs), seq_cap)
        B = len(seqs)
        widths = [self.get(seqs[0]["shard"], part).shape[1] for part in ("aux", "final")]
        aux, final = torch.zeros(B, T, widths[0]), torch.zeros(B, T, widths[1])
        argmax, tokens = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
        answer, valid = torch.zeros(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.bool)
        for b, s in enumerate(seqs):
            n, o = min(len(s["tokens"]), T), s["offset"]
            aux[b, :n] = from_bf16_bits(self.get(s["shard"], "aux")[o: o + n])
            final[b, :n] = from_bf16_bits(self.get(s["shard"], "final")[o: o + n])
            argmax[b, :n] = torch.from_numpy(self.get(s["shard"], "argmax")[o: o + n].astype(np.int64))
            tokens[b, :n] = torch.from_numpy(s["tokens"][:n].astype(np.int64))
            answer[b, :n] = torch.from_numpy(s["answer"][:n])
            valid[b, :n] = True
        return aux, final, argmax, tokens, answer, valid


# ---- 5. train --------------------------------------------------------------------------------

def make_head(target_cfg, aux_layers: list[int], draft_ids: list[int], embed: torch.Tensor) -> Eagle3Head:
    """A fresh head for the target (its ModelConfig): the runtime's config at the target's width."""
    from specengine.models.eagle3 import Eagle3Config

    cfg = Eagle3Config.for_target(target_cfg, tuple(aux_layers), len(draft_ids))
    torch.manual_seed(0)
    head = Eagle3Head(cfg, embed)
    head.set_vocab(torch.tensor(draft_ids, dtype=torch.int64))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    return head


def target_log_probs(final: torch.Tensor, lm_head_rows: torch.Tensor) -> torch.Tensor:
    """final [B, T, H], lm_head_rows [V', H] -> the target's log-probabilities over those rows [B, T, V']."""
    return F.log_softmax(final @ lm_head_rows.T, -1)


def shifted(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """x[:, t + by] at position t (fill past the end). x [B, T, ...]."""
    out = torch.full_like(x, fill)
    if by < x.shape[1]:
        out[:, : x.shape[1] - by] = x[:, by:]
    return out


def ttt_loss(head: Eagle3Head, batch, lm_head_draft: torch.Tensor, steps: int):
    """The weighted sum over steps of the soft cross-entropy; per step (loss, agreement with the
    target's argmax on all answer positions, positions). The draft vocabulary's logits (most of a
    step's cost) are computed only where the loss reads them."""
    aux, final, argmax, tokens, answer, valid = batch
    hiddens = head.ttt(aux, tokens, valid, steps)
    with torch.no_grad():
        p = target_log_probs(final, lm_head_draft).exp()  # [B, T, Vd]: the target's, at each position
        draft_ids = head.draft_ids
    total, per_step = 0.0, []
    for j, hidden in enumerate(hiddens):
        # chain t's step j predicts token t + j + 2 from the target's distribution at t + j + 1
        target_argmax = shifted(argmax, j + 1)
        scored = shifted(valid & answer, j + 2, False)
        rows, cols = (scored & head.t2d[target_argmax]).nonzero(as_tuple=True)
        logq = F.log_softmax(head.logits(hidden[rows, cols]).float(), -1)  # [N, Vd]
        loss = -(p[rows, cols + j + 1] * logq).sum(-1).mean() if len(rows) else hidden.sum() * 0
        total = total + STEP_WEIGHT ** j * loss
        with torch.no_grad():
            # agreement over every scored position (a target argmax outside the vocabulary is a miss)
            hits = (draft_ids[logq.argmax(-1)] == target_argmax[rows, cols]).sum().item() if len(rows) else 0
            per_step.append((loss.item(), hits, scored.sum().item()))
    return total, per_step


def stage_train(work: Path, head: Eagle3Head, train: list[dict], heldout: list[dict], lm_head: torch.Tensor, args):
    ckpt = work / "head.pt"
    features = Features(work / "features")
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    state = resume(ckpt, head, opt, torch.device("cpu"))
    budget = args.train_minutes * 60
    max_steps = args.max_steps or math.inf
    if state["elapsed"] >= budget or state["step"] >= max_steps:
        return state
    lm_head_draft = lm_head[head.draft_ids]
    seqs = [(s["tokens"], s) for s in train]
    stream = batches_of(seqs, args.batch_tokens, args.seq_cap, np.random.default_rng(state["step"]))
    log(f"train: {len(train)} sequences, {sum(len(s['tokens']) for s in train)} tokens, "
        f"{sum(int(s['answer'].sum()) for s in train)} answer tokens; steps unrolled {args.ttt_steps}")
    losses_csv = open(work / "train_loss.csv", "a")
    last_save = last_report = time.time()
    head.train()
    while state["elapsed"] < budget and state["step"] < max_steps:
        t0 = time.time()
        set_lr(opt, args.lr, state, budget, warmup_steps=args.warmup_steps, floor=0.05)
        batch = features.batch([s for _, s in next(stream)], args.seq_cap)
        loss, per_step = ttt_loss(head, batch, lm_head_draft, args.ttt_steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        dt = time.time() - t0
        positions = int(batch[5].sum())
        state["step"] += 1
        state["elapsed"] += dt
        state["tokens"] += positions
        agree = [a / max(n, 1) for _, a, n in per_step]
        losses_csv.write(f"{state['step']},{state['elapsed']:.1f},{state['tokens']},{loss.item():.4f},"
                         + ",".join(f"{x:.4f}" for x in agree) + "\n")
        done = state["elapsed"] >= budget or state["step"] >= max_steps
        if time.time() - last_report > args.report_seconds or done or state["step"] == 1:
            last_report = time.time()
            log(f"train: step {state['step']}, {state['elapsed'] / 60:.1f}/{args.train_minutes:.0f} min, "
                f"{positions / dt:.0f} tok/s, loss {loss.item():.3f}, agreement by step "
                + " ".join(f"{a:.2f}" for a in agree))
        if time.time() - last_save > args.save_seconds or done:
            if heldout:  # outside the clock
                metrics = evaluate(head, heldout[: args.progress_heldout], features, lm_head, args.ttt_steps, args.seq_cap)
                state["heldout"] = metrics
                log(f"train: held-out accepted length T=0 {metrics['t0']['mean_accepted']}, "
                    f"accept by position {metrics['t0']['accept_by_position']}; "
                    f"T=1 {metrics['t1']['accept_by_position']}")
                with open(work / "train_heldout.jsonl", "a") as f:
                    f.write(json.dumps(dict(step=state["step"], tokens=state["tokens"], **metrics)) + "\n")
                head.train()
            save(ckpt, head, opt, state)
            last_save = time.time()
    losses_csv.close()
    return state


# ---- 6. evaluate -----------------------------------------------------------------------------

@torch.no_grad()
def evaluate(head: Eagle3Head, seqs: list[dict], features: Features, lm_head: torch.Tensor, steps: int,
             seq_cap: int, batch: int = 4) -> dict:
    """Acceptance by draft position on the target's held-out answers, chains of `steps` drafts
    starting at every answer position (teacher forced on the target's tokens).
    T=0 (greedy answers): position j's figure is the share of chains whose drafts 1..j all equal
    the target's argmax: exactly what greedy verification accepts, since until the first miss the
    forced tokens are the drafted ones; mean_accepted = their sum (accepted drafts per round).
    T=1 (sampled answers): alpha_j = sum_x min(p, q) at step j along the target's path, and
    position j's figure the mean of alpha_1 * ... * alpha_j (an estimate: the path is the target's
    sample, not the accepted drafts')."""
    head.eval()
    draft_ids = head.draft_ids
    sums = {0: np.zeros(steps), 1: np.zeros(steps)}
    alphas = np.zeros(steps)
    chains = {0: 0, 1: 0}
    for kind in (0, 1):
        chosen = [s for s in seqs if (s["temperature"] == 0) == (kind == 0)]
        for i in range(0, len(chosen), batch):
            aux, final, argmax, tokens, answer, valid = features.batch(chosen[i: i + batch], seq_cap)
            logits = [head.logits(h) for h in head.ttt(aux, tokens, valid, steps)]
            T = tokens.shape[1]
            lengths = valid.sum(1)
            t = torch.arange(T)
            # chain t counts when its first prediction is an answer token and all its steps fit
            ok = shifted(answer, 2, False) & (t[None] + steps + 1 < lengths[:, None])
            if not ok.any():
                continue
            alive = ok.clone()
            prod = ok.float()
            for j, lg in enumerate(logits):
                if kind == 0:
                    alive &= draft_ids[lg.argmax(-1)] == shifted(argmax, j + 1)
                    sums[0][j] += alive.sum().item()
                else:
                    p = F.softmax(shifted(final, j + 1) @ lm_head.T, -1)[..., draft_ids]  # [B, T, Vd]
                    alpha = torch.minimum(p, F.softmax(lg.float(), -1)).sum(-1)
                    prod = prod * alpha
                    sums[1][j] += prod[ok].sum().item()
                    alphas[j] += alpha[ok].sum().item()
            chains[kind] += int(ok.sum())
    out = {}
    for kind in (0, 1):
        n = max(chains[kind], 1)
        by_pos = [round(float(x) / n, 4) for x in sums[kind]]
        out[f"t{kind}"] = dict(chains=chains[kind], accept_by_position=by_pos, mean_accepted=round(sum(by_pos), 3))
    out["t1"]["alpha_by_step"] = [round(float(x) / max(chains[1], 1), 4) for x in alphas]
    return out


# ---- 7. export -------------------------------------------------------------------------------

def model_card(meta: dict, metrics: dict) -> str:
    t0, t1 = metrics["t0"], metrics["t1"]
    times = meta["stage_minutes"]
    lines = [
        f"# EAGLE-3 draft head for {meta['target']}", "",
        "An EAGLE-3 draft head (one decoder layer at the target's width, fed with the target's states at "
        f"layers {meta['aux_layers']}) in the checkpoint format vLLM and SGLang load "
        "(`LlamaForCausalLMEagle3`), trained by `recipes/train_eagle3.py` on this machine's CPU.", "",
        "## Data",
        f"- Requests: {meta['requests']['train']} train, {meta['requests']['heldout']} held out (split by request); "
        f"{meta['requests']['stats']}. Twelve kinds from templates, follow-up turns, coding requests about the "
        "standard library, and requests the target wrote itself; the benchmark's prompts excluded.",
        f"- The target's own answers (greedy and T=1 alternately, at most {meta['max_new']} new tokens): "
        f"{meta['teach_tokens']} tokens, {meta['teach_answer_tokens']} of them answers.",
        f"- Draft vocabulary: {meta['draft_vocab']} ids, covering {meta['coverage_train']} of the train answer "
        f"tokens and {meta['coverage_heldout']} of the held-out ones.", "",
        "## Recipe",
        f"- Training-time test over {meta['ttt_steps']} steps, soft cross-entropy on the target's distribution "
        f"restricted to the draft vocabulary, step j weighted {STEP_WEIGHT}^j; AdamW lr {meta['lr']}, "
        f"cosine over {meta['train_minutes_budget']} min; {meta['train_steps']} steps, {meta['train_tokens']} "
        "positions seen.", "",
        "## Measured acceptance (held-out requests, teacher-forced chains)",
        f"- T=0: accepted by draft position {t0['accept_by_position']} ({t0['chains']} chains); "
        f"mean accepted drafts per round {t0['mean_accepted']} (tokens per round {round(1 + t0['mean_accepted'], 3)}).",
        f"- T=1: estimated acceptance by position {t1['accept_by_position']}, per-step sum min(p, q) "
        f"{t1['alpha_by_step']} ({t1['chains']} chains).", "",
        "## Time on this CPU",
        f"- {meta['machine']} (torch threads: {meta['threads']}); stages in minutes: "
        + ", ".join(f"{k} {v:.1f}" for k, v in times.items()) + ".",
        f"- Date: {meta['date']}.", "",
    ]
    return "\n".join(lines)


def export(head: Eagle3Head, out: Path, meta: dict, metrics: dict):
    save_head(head, out)
    (out / "eval.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    (out / "README.md").write_text(model_card(meta, metrics))


def bf16_rounded(head: Eagle3Head) -> Eagle3Head:
    """The head as exported (its float weights rounded to bfloat16), to measure what ships."""
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return head


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="the stages' state and data (outside the repository)")
    parser.add_argument("--out", type=Path, required=True, help="the exported head's folder")
    parser.add_argument("--target", type=Path, help="a GGUF file or a folder (default: specengine.shipped.default_target())")
    parser.add_argument("--project-requests", type=int, default=4000)
    parser.add_argument("--self-requests", type=int, default=1000, help="requests the target is asked to write")
    parser.add_argument("--self-max-tokens", type=int, default=64)
    parser.add_argument("--heldout-share", type=int, default=20, help="1 request in this many is held out")
    parser.add_argument("--heldout-requests", type=int, default=96, help="at most this many held-out requests")
    parser.add_argument("--teach-minutes", type=float, default=120)
    parser.add_argument("--teach-batch", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=160)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--aux-layers", help="comma-separated capture layers (default: vLLM's 2, L // 2, L - 3)")
    parser.add_argument("--train-minutes", type=float, default=90)
    parser.add_argument("--max-steps", type=int, default=0, help="stop training after this many steps (0: the budget)")
    parser.add_argument("--ttt-steps", type=int, default=4, help="draft steps unrolled in training and evaluated")
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--seq-cap", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--save-seconds", type=float, default=600)
    parser.add_argument("--report-seconds", type=float, default=30)
    parser.add_argument("--progress-heldout", type=int, default=16, help="held-out sequences measured at each save")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from specengine.devtools.benchmark import machine_name
    from specengine.shipped import default_target
    from specengine.tokenizer import load_tokenizer

    target = args.target or default_target()
    args.work.mkdir(parents=True, exist_ok=True)
    clock = read_json(args.work / "clock.json", {})

    def timed(name, fn, *a, **k):
        t0 = time.time()
        value = fn(*a, **k)
        clock[name] = clock.get(name, 0.0) + time.time() - t0
        write_json(args.work / "clock.json", clock)
        return value

    requests = timed("requests", stage_requests, args.work, target, args)
    teach_train = timed("teach", stage_teach, args.work, target, requests["train"], "train", args, args.teach_minutes)
    teach_held = timed("teach", stage_teach, args.work, target, requests["heldout"], "heldout", args, math.inf)
    train_seqs, held_seqs = load_teach(teach_train), load_teach(teach_held)
    if not train_seqs:
        raise SystemExit("no teacher data: give the teach stage some minutes")
    tokenizer = load_tokenizer(target)
    from specengine.models.eagle3 import default_feature_layers

    tcfg = target_config(target)
    aux_layers = ([int(x) for x in args.aux_layers.split(",")] if args.aux_layers
                  else list(default_feature_layers(tcfg.num_layers)))
    vocab = timed("vocab", stage_vocab, args.work, train_seqs, held_seqs, args.draft_vocab, tcfg.vocab_size,
                  set(tokenizer.all_special_ids))
    timed("features", stage_features, args.work, target, teach_train + teach_held, aux_layers)
    embed = torch.from_numpy(np.load(args.work / "embed.npy"))
    untied = args.work / "lm_head.npy"
    lm_head = torch.from_numpy(np.load(untied)) if untied.is_file() else embed
    head = make_head(tcfg, aux_layers, vocab["ids"], embed)
    state = timed("train", stage_train, args.work, head, train_seqs, held_seqs, lm_head, args)
    features = Features(args.work / "features")
    metrics = timed("evaluate", evaluate, bf16_rounded(head), held_seqs, features, lm_head, args.ttt_steps, args.seq_cap)
    log(f"evaluate: T=0 accepted by position {metrics['t0']['accept_by_position']} "
        f"(mean accepted {metrics['t0']['mean_accepted']}), T=1 {metrics['t1']['accept_by_position']}")
    teach = read_json(args.work / "teach-train.json", {})
    feats = read_json(args.work / "features.json", {})
    meta = dict(
        recipe="recipes/train_eagle3.py", target=target.name, aux_layers=aux_layers, machine=machine_name(),
        threads=torch.get_num_threads(), date=time.strftime("%Y-%m-%d"),
        requests=dict(train=len(requests["train"]), heldout=len(requests["heldout"]), stats=requests["stats"]),
        teach_requests=teach.get("next_request"), teach_tokens=teach.get("tokens"),
        teach_answer_tokens=teach.get("answer_tokens"), max_new=args.max_new,
        features_tokens=feats.get("tokens"), draft_vocab=args.draft_vocab, coverage_train=vocab["coverage_train"],
        coverage_heldout=vocab["coverage_heldout"], ttt_steps=args.ttt_steps, lr=args.lr,
        train_minutes_budget=args.train_minutes, train_steps=state["step"], train_tokens=state["tokens"],
        stage_minutes={k: round(v / 60, 2) for k, v in clock.items()},
        throughput=dict(
            teach_requests_per_s=round(teach["next_request"] / teach["elapsed"], 3) if teach.get("elapsed") else None,
            teach_tokens_per_s=round(teach["tokens"] / teach["elapsed"], 1) if teach.get("elapsed") else None,
            teach_answer_tokens_per_s=round(teach["answer_tokens"] / teach["elapsed"], 1) if teach.get("elapsed") else None,
            features_tokens_per_s=round(feats["tokens"] / feats["elapsed"], 1) if feats.get("elapsed") else None,
            train_positions_per_s=round(state["tokens"] / state["elapsed"], 1) if state.get("elapsed") else None))
    export(head, args.out, meta, metrics)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
