"""What the tensor-parallel tests run, in one process and on every rank alike."""
import torch

from specengine.steps.feed import feed

# name -> (gamma, one SamplingParams dict per prompt): greedy, seeded sampling with every warp,
# and gamma "auto" (chosen from each rank's timings, so rank 0's choice must rule).
GENERATIONS = {
    "greedy": (3, [dict(max_new_tokens=12, temperature=0.0)] * 3),
    "seeded": (2, [dict(max_new_tokens=12, temperature=1.0, seed=5), dict(max_new_tokens=9, top_k=5, seed=6),
                   dict(max_new_tokens=12, top_p=0.8, min_p=0.05, seed=7)]),
    # The last request has no seed: each process draws one, and rank 0's must rule.
    "auto": ("auto", [dict(max_new_tokens=12, temperature=0.0), dict(max_new_tokens=12, seed=1),
                      dict(max_new_tokens=10)]),
}


def serve_with_aborts(engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Requests joining and aborted mid-run (the first row while others run, then a waiting one),
    driven by step() until the engine drains: each request's tokens, by id (every rank alike)."""
    from specengine import SamplingParams

    params = [SamplingParams(max_new_tokens=10, temperature=1.0, seed=11 + i) for i in range(len(prompts) + 1)]
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params[i], f"r{i}")
    for step in range(100):
        if step == 2:
            engine.abort("r0")
            engine.add_request(prompts[0], params[-1], "late")
            engine.add_request(prompts[1], params[-1], "dropped")
            engine.abort("dropped")
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not (engine.has_unfinished_requests() or engine.has_pending_outputs()):
            break
    return tokens


@torch.no_grad()
def logit_trace(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Logits of a ragged prefill, two single-token steps at ragged positions, then a 2-token
    chunk rolled back and a replacement token decoded over its stale cache entries."""
    prefixes = [s[:-4] for s in sequences]
    cache = model.new_cache(len(sequences), 32)
    out = []
    hidden = model(torch.tensor([p + [0] * (max(map(len, prefixes)) - len(p)) for p in prefixes]),
                   cache.lengths.clone(), cache)
    out.append(model.logits(hidden))
    cache.lengths.zero_()
    feed(model, cache, prefixes)
    for step in range(2):
        tokens = torch.tensor([[s[len(p) + step]] for s, p in zip(sequences, prefixes)])
        out.append(model.logits(model(tokens, cache.lengths.clone(), cache)))
        cache.lengths.add_(1)
    chunk = torch.tensor([s[len(p) + 2: len(p) + 4] for s, p in zip(sequences, prefixes)])
    out.append(model.logits(model(chunk, cache.lengths.clone(), cache)))
    out.append(model.logits(model((chunk[:, :1] + 7) % model.config.vocab_size, cache.lengths.clone(), cache)))
    return out
