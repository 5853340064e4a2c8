"""The 1B target with its matrices kept as a GGUF file stores them (Q4_K, Q8_0), on the Triton
block kernels: its logits against its own "torch" backend, and its replayed decode step against the
weight-read floor of the bytes it holds.

    python bench/bench_step_stored.py [--device cuda] [--types Q4_K Q8_0] [--layers 22] [--batches 1]
        [--out step-stored.json] [--small]

The model: bench_step.py's widened target's shape (the shipped pycode target widened to d 2048,
ffn 5632, 32 query heads on 8 KV heads of 64, `--layers` deep, its 8192-token tied embedding),
float32 compute, every matrix (the embedding and head too) stored in the weight type as random
blocks under sane float16 scales (weights of about 0.02): valid blocks of the type, which a kernel
reads as it reads a file's (it never looks at values to decide what to read); their logits mean
nothing, and are compared only with the torch backend's over the same blocks. Drawn on the host
by devtools.tiny.random_blocks, as devtools.tiny.blocks_of draws the K-quants (quantizing 1B
weights with gguf's numpy would take minutes, and the K-quants cannot be quantized there at all),
each matrix then moved to the device (where its parts are merged, as a loaded file's are).

Per weight type, written to the JSON after every figure:
  - correctness, first: logits of a prefill (2 prompts of 40 tokens: the prompt kernel), a
    verification-sized step (2 rows of 4 tokens) and a decode step (2 rows of 1) on "triton",
    against "torch" (dequantized matrices, then F.linear): the largest difference over the largest
    logit, at most REL_TOLERANCE (float32 summation order gives ~1e-6; a wrong weight gives ~1);
    and a row's product through two of the model's matrices alone, in 9 rows and as a token of an
    [8, 5] verification, bit for bit (kernels.blocks' batch invariance, compiled);
  - launches per decoder layer (bench_step.launches_per_layer: CUDA kernels of an eager step);
  - the step at 64 cached tokens replayed from a CUDA graph (steps.graphs.FixedShapeSteps), median
    ms, against the floor: the bytes the model holds (its matrices as stored, its norms) over this
    device's copy bandwidth (bench/common.py's yardstick, as bench_step.py's floor).
The model's triton_fallback_reason is recorded; exit status 1 on CUDA if the kernels fell back, a
graph was not replayed, or the logits or the batch check failed.

--small: the same logic on a tiny widened shape (2 layers, d 256, vocabulary 128) in Triton's
interpreter on a CPU (chosen here before the kernels are imported), eager steps, few repetitions,
the decode kernel on tiles of 256 weight rows (the interpreter pays per program; the same bits,
see kernels.blocks): a dry run of the script (tests/test_gpu_verdicts.py runs it), measuring
nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys

import numpy as np
import torch

if not torch.cuda.is_available():  # the Triton kernels then run in the interpreter (a dry run)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specengine.devtools.benchmark import machine_name  # noqa: E402
from specengine.devtools.tiny import random_blocks  # noqa: E402
from specengine.kernels import blocks as kernels  # noqa: E402
from specengine.models.config import ModelConfig  # noqa: E402
from specengine.models.llama import LlamaForCausalLM  # noqa: E402
from specengine.ops.blocks import MatrixPart, WeightType, linear_blocks  # noqa: E402
from specengine.shipped import TARGET_DIR  # noqa: E402
from specengine.steps.graphs import FixedShapeSteps  # noqa: E402

from bench_step import CACHED, launches_per_layer  # noqa: E402
from common import copy_bandwidth, timeit, write_json  # noqa: E402

# bench_costs.widened_target's shape; --small's.
WIDE = dict(hidden_size=2048, intermediate_size=5632, num_heads=32, num_kv_heads=8)
SMALL = dict(hidden_size=256, intermediate_size=256, num_heads=4, num_kv_heads=2, vocab_size=128)
# Each weight type's float16 fields: (byte offset in the block, size of the value drawn). Q8_0:
# d * q, q in [-128, 128): |w| ~ 64 d. Q4_K: (d * sc) * q - dmin * m, sc and m in [0, 64), q in
# [0, 16): |w| ~ 240 d - 32 dmin. Weights of about 0.02, as a trained 1B model's.
SCALES = {"Q8_0": [(0, 3e-4)], "Q4_K": [(0, 8e-5), (2, 3e-4)]}
REL_TOLERANCE = 1e-3  # largest logit difference over the largest logit, triton against torch
PROMPT_TOKENS = 40    # the correctness prefill: from 32 tokens a row, the prompt kernel


def widened_config(layers: int, small: bool) -> ModelConfig:
    return dataclasses.replace(ModelConfig.from_folder(TARGET_DIR), num_layers=layers, **(SMALL if small else WIDE))


def random_part(weight_type: str, rows: int, K: int, rng: np.random.Generator, device: torch.device) -> MatrixPart:
    """rows of K weights in weight_type on device: random quants under float16 scales drawn from
    [size / 2, size)."""
    scale_ranges = {offset: (size / 2, size) for offset, size in SCALES[weight_type]}
    data = torch.from_numpy(random_blocks(weight_type, rows, K, rng, scale_ranges))
    return MatrixPart(WeightType[weight_type], data.to(device))


def stored_model(cfg: ModelConfig, weight_type: str, device: torch.device, seed: int = 0) -> LlamaForCausalLM:
    """A stored-matrix LlamaForCausalLM of cfg, every matrix random blocks of weight_type (set on
    device), norms 1, on the "triton" backend."""
    model = LlamaForCausalLM(cfg, stored_matrices=True)
    rng = np.random.default_rng(seed)
    modules = dict(model.named_modules())
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name, sources in model.stored_matrix_sources().items():
        module = modules[name]
        rows = [q, kv, kv] if name.endswith("qkv_proj") else [module.out_features // len(sources)] * len(sources)
        module.set_parts([random_part(weight_type, n, module.in_features, rng, device) for n in rows])
    model = model.to(device).eval().requires_grad_(False)
    model.use_backend("triton")
    return model


def held_bytes(model) -> int:
    """The bytes a step reads: the matrices as stored (buffers) and the norms (parameters)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def compare_logits(model) -> dict:
    """Logits on "triton" against "torch": a prefill, a verification-sized step, a decode step."""
    device, V = model.device, model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    calls = [("prefill", torch.randint(0, V, (2, PROMPT_TOKENS), generator=g), 0),
             ("verify", torch.randint(0, V, (2, 4), generator=g), PROMPT_TOKENS),
             ("step", torch.randint(0, V, (2, 1), generator=g), PROMPT_TOKENS + 4)]
    logits = {}
    for backend in ("torch", "triton"):
        model.use_backend(backend)
        cache = model.new_cache(2, 64)
        for name, tokens, start in calls:
            tokens = tokens.to(device)
            begin = torch.full((2,), start, dtype=torch.int64, device=device)
            logits[backend, name] = model.logits(model(tokens, begin, cache, kv_len=start + tokens.shape[1])).float()
    found = {}
    for name, _, _ in calls:
        got, want = logits["triton", name], logits["torch", name]
        scale = want.abs().max().item()
        found[f"{name}_rel_error"] = (got - want).abs().max().item() / max(scale, 1e-30)
        found[f"{name}_same_argmax"] = float((got.argmax(-1) == want.argmax(-1)).float().mean())
        found[f"{name}_finite"] = bool(torch.isfinite(got).all() and torch.isfinite(want).all())
    return found


def batch_invariant(model) -> bool:
    """A row's product through layer 0's gate/up (two parts) and down (split K) projections: the same
    bits alone, in 9 rows and as a token of an [8, 5, K] verification."""
    same = True
    g = torch.Generator().manual_seed(2)
    for module in (model.model.layers[0].mlp.gate_up_proj, model.model.layers[0].mlp.down_proj):
        K = module.in_features
        x = (torch.randn(40, K, generator=g) * 0.5).to(model.device)
        alone = linear_blocks(x[:1], module.matrix, None, "triton")
        last = linear_blocks(x[39:], module.matrix, None, "triton")
        nine = linear_blocks(x[:9], module.matrix, None, "triton")
        verification = linear_blocks(x.view(8, 5, K), module.matrix, None, "triton").view(40, -1)
        for got, want in ((nine[:1], alone), (verification[:1], alone), (verification[39:], last)):
            same &= bool(torch.equal(got.view(torch.int32), want.view(torch.int32)))
    return same


def replayed_step_ms(model, batch: int, reps: int, warmup: int) -> tuple[float, int, str | None]:
    """(median ms of a one-token step at CACHED positions, graph replays, the graphs' fallback reason):
    FixedShapeSteps, CUDA graphs on CUDA (eager on a CPU), as bench_step.step_ms."""
    steps = FixedShapeSteps(model, batch, 256)
    steps.new_batch(batch)
    tokens = torch.zeros(batch, 1, dtype=torch.int64, device=model.device)
    start = torch.full((batch,), CACHED, dtype=torch.int64, device=model.device)
    call = lambda: steps(tokens, start)  # noqa: E731
    for _ in range(warmup):  # the first ones capture the graph
        call()
    ms = 1e3 * timeit(call, model.device, min_reps=reps, budget_s=0.0)
    return ms, steps.replays, steps.fallback_reason


def main(argv=None) -> int:
    tiles = kernels.GEMV_BLOCK_N, kernels.GEMV_TILE
    try:
        return run(argv)
    finally:  # a dry run in a test's process leaves the kernels' tiles as they were
        kernels.GEMV_BLOCK_N, kernels.GEMV_TILE = tiles


@torch.inference_mode()  # as the engine runs: the kernels have no autograd
def run(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--types", nargs="+", choices=sorted(SCALES), default=["Q4_K", "Q8_0"])
    parser.add_argument("--layers", type=int, help="decoder layers (default 22, the 1B target; --small: 2)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
    parser.add_argument("--small", action="store_true", help="a tiny widened shape: a dry run (on a CPU, interpreted)")
    parser.add_argument("--out", help="JSON path (default bench/results/step-stored-<device>-<date>.json)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    if not on_cuda and not args.small:
        parser.error("on a CPU the Triton kernels run interpreted: only --small (a dry run)")
    layers = max(2, args.layers or (2 if args.small else 22))  # launches per layer subtract a one-layer step
    cfg = widened_config(layers, args.small)
    bandwidth = copy_bandwidth(device)
    result = dict(machine=machine_name(device), date=datetime.date.today().isoformat(), torch=torch.__version__,
                  device=device.type, small=args.small, layers=layers, hidden_size=cfg.hidden_size,
                  copy_bandwidth_gb_s=bandwidth / 1e9, rel_tolerance=REL_TOLERANCE, models={})
    save = lambda: write_json(result, args.out, f"step-stored-{device.type}-{result['date']}.json")  # noqa: E731
    print(f"# {result['machine']}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; {layers} layers of d {cfg.hidden_size}"
          f"{' (small: a dry run)' if args.small else ''}", flush=True)
    reps, warmup = (50, 5) if on_cuda else (2, 1)
    if not on_cuda:  # interpreted: fewer, larger programs (a row's bits follow the split of K, not the tiles)
        kernels.GEMV_BLOCK_N, kernels.GEMV_TILE = 256, 256 * kernels.GEMV_BLOCK_R
    failed = []
    for weight_type in args.types:
        model = stored_model(cfg, weight_type, device)
        weight_bytes = held_bytes(model)
        floor_ms = 1e3 * weight_bytes / bandwidth
        entry = result["models"][weight_type] = dict(weight_bytes=weight_bytes, floor_ms=floor_ms, batches={})
        try:
            found = compare_logits(model)  # leaves the model on "triton" (or on "torch", had it fallen back)
            found["batch_invariant"] = batch_invariant(model)
            entry["triton_fallback_reason"] = model.triton_fallback_reason
            found["ok"] = (found["batch_invariant"] and model.triton_fallback_reason is None
                           and all(found[f"{n}_finite"] for n in ("prefill", "verify", "step"))
                           and max(found[f"{n}_rel_error"] for n in ("prefill", "verify", "step")) <= REL_TOLERANCE)
            entry["correctness"] = found
            save()
            print(f"{weight_type}: {weight_bytes / 1e9:.3f} GB held; logits against torch: "
                  + ", ".join(f"{n} {found[f'{n}_rel_error']:.1e}" for n in ("prefill", "verify", "step"))
                  + f" of the largest; batch-invariant {found['batch_invariant']}", flush=True)
            entry["launches_per_layer"] = launches_per_layer(model, args.batches[0])
            save()
            for batch in args.batches:
                ms, replays, graphs_fallback = replayed_step_ms(model, batch, reps, warmup)
                entry["batches"][str(batch)] = dict(step_ms=ms, ratio_to_floor=ms / floor_ms, replays=replays,
                                                    graphs_fallback_reason=graphs_fallback)
                print(f"{weight_type}: batch {batch}: {entry['launches_per_layer']:.1f} launches/layer, {ms:.3f} ms a "
                      f"{'replayed' if replays else 'eager'} step ({ms / floor_ms:.2f}x the {floor_ms:.3f} ms floor)",
                      flush=True)
                save()
        except Exception as e:  # noqa: BLE001 (a type that fails is reported, the others still run)
            entry["error"] = f"{type(e).__name__}: {e}"[:500]
            print(f"{weight_type}: {entry['error']}", flush=True)
        entry["triton_fallback_reason"] = entry.get("triton_fallback_reason") or model.triton_fallback_reason
        save()
        problems = [entry.get("error"), entry["triton_fallback_reason"] and "the Triton kernels fell back",
                    not entry.get("correctness", {}).get("ok") and "the logits or the batch check failed",
                    on_cuda and any(not b["replays"] for b in entry["batches"].values()) and "no graph replayed"]
        if any(problems):
            failed.append(f"{weight_type}: " + "; ".join(p for p in problems if p))
        del model
        if on_cuda:
            torch.cuda.empty_cache()
    for line in failed:
        print("FAILED " + line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
