"""Small in-memory models for engine tests (no files, no tokenizer)."""
import pytest
import torch

from specengine import Engine
from specengine.models import LlamaForCausalLM, ModelConfig
from specengine.models.config import RopeConfig


def tiny_model(vocab_size=32, seed=0, num_layers=2, hidden_size=32, eos=None, max_positions=256,
               logit_scale=1.0, head_dim=None) -> LlamaForCausalLM:
    """Four query heads on two KV heads of hidden_size // 4 each, or of head_dim (hidden_size then
    4 * head_dim): the GPU tests take 64 and 128, the head sizes the compiled kernels are built for."""
    if head_dim is not None:
        hidden_size = 4 * head_dim
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab_size, hidden_size=hidden_size,
                      intermediate_size=2 * hidden_size, num_layers=num_layers, num_heads=4, num_kv_heads=2,
                      head_dim=hidden_size // 4, max_position_embeddings=max_positions, rms_norm_eps=1e-6,
                      rope=RopeConfig(theta=10000.0), eos_token_ids=() if eos is None else (eos,))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model.eval().requires_grad_(False)


PAIR_VOCAB = 32


def tiny_pair(vocab_size: int = PAIR_VOCAB, max_positions: int = 1024):
    """The engine tests' (target, draft): a two-layer target and a one-layer draft of sharp logits
    (seeds 0 and 5) that agree often enough for drafts to be accepted and rejected. conftest's
    `tiny_pair` fixture holds one for the session."""
    return (tiny_model(vocab_size, seed=0, logit_scale=3.0, max_positions=max_positions),
            tiny_model(vocab_size, seed=5, num_layers=1, logit_scale=3.0, max_positions=max_positions))


DRAFTERS = ("model", "ngram", "suffix", "none")


def make_drafter(models, drafter: str = "model"):
    """A new drafter of this kind for the pair: the draft model, n-gram lookup (1 to 2 tokens), the
    suffix drafter, or None (target-only)."""
    from specengine.drafters.model import ModelDrafter
    from specengine.drafters.ngram import NgramDrafter
    from specengine.drafters.suffix import SuffixDrafter

    target, draft = models
    return {"model": lambda: ModelDrafter(draft, target.config.vocab_size, draft.config.vocab_size),
            "ngram": lambda: NgramDrafter(1, 2), "suffix": SuffixDrafter, "none": lambda: None}[drafter]()


def make_engine(models, drafter: str = "model", gamma=3, **kwargs) -> Engine:
    """An Engine of the pair's target with a new drafter of this kind (make_drafter), gamma 3."""
    return Engine(models[0], drafter=make_drafter(models, drafter), gamma=gamma, **kwargs)


def greedy_fixtures(vocab_size: int, prompts: list[list[int]], greedy):
    """A test module's (target, baseline) fixtures, to bind under those names: a tiny target of
    vocab_size with sharp logits, and its target-only outputs of the prompts under greedy params,
    which speculative greedy decoding must reproduce token for token."""
    @pytest.fixture(scope="module")
    def target():
        return tiny_model(vocab_size, seed=0, logit_scale=3.0)

    @pytest.fixture(scope="module")
    def baseline(target):
        return [r.token_ids for r in Engine(target).generate(prompts, greedy)]

    return target, baseline


def stop_across_tokens(tokenizer, result) -> str:
    """Four characters of a Result's text across a token boundary (the end of one token and the
    start of the next, within its first 11 tokens): a stop string that no single token holds."""
    ends = [len(tokenizer.decode(result.token_ids[:n], skip_special_tokens=True)) for n in range(1, 12)]
    boundary = next(e for e in ends[2:] if 0 < e < len(result.text) - 2)
    return result.text[boundary - 2:boundary + 2]


def device_head_dims():
    """(device, head_dim) of a GPU test whose logic also runs on the CPU path: on CUDA the head sizes
    the compiled kernels are built for, 64 and 128 (marked gpu); on the CPU one of them."""
    import pytest

    gpu = pytest.mark.gpu
    return [pytest.param("cpu", 64, id="cpu-64"), pytest.param("cuda", 64, marks=gpu, id="cuda-64"),
            pytest.param("cuda", 128, marks=gpu, id="cuda-128")]


def assert_kernels_ran(*models):
    """On CUDA, the models' forwards ran the compiled Triton step kernels: none fell back to the torch path."""
    for model in models:
        assert model.triton_fallback_reason is None, f"the Triton kernels fell back: {model.triton_fallback_reason}"
        if model.device.type == "cuda":
            assert model.backend.name == "triton"


def assert_blocks_ran_on_their_path(engine, device: str):
    """An engine with cuda_graphs and blocks of rounds ran them on its device's path: its target's and
    drafter's fixed-shape steps without a capture failure, the compiled kernels on CUDA (no torch
    fallback), and there graphs replayed, each block's rounds from one captured graph a round (its
    warm-ups undone before capture)."""
    assert engine.target_steps.fallback_reason is None and engine.drafter.steps.fallback_reason is None
    assert_kernels_ran(engine.target, engine.drafter.model)
    if device == "cuda":
        assert engine.target_steps.replays > 0 and engine.drafter.steps.replays > 0
        assert any(key[0] == "round" and entry.graph is not None
                   for key, entry in engine.target_steps.graphs.entries.items())


def join(drafter, prompts: list[list[int]], capacity: int = 32):
    """Requests join a drafter as they join the engine's running batch (engine.runner): with a
    staged_cache, each gets a staged row there holding all but its prompt's last token (prefilled
    whole), promoted to a row in use; then join_rows."""
    from specengine.steps.feed import feed

    cache = drafter.staged_cache(capacity)
    if cache is not None:
        cache.entries_end_at_lengths = True
        first = cache.staged
        cache.reserve(cache.rows_held + len(prompts), capacity)
        cache.stage_rows(len(prompts))
        with torch.inference_mode():  # as the engine runs (a fixed cache's buffers are inference tensors)
            for i, prompt in enumerate(prompts):
                feed(drafter.model, cache.staged_view(first + i, 1), [prompt[:-1]], cached=[0])
        cache.promote([first + i for i in range(len(prompts))])
    drafter.join_rows(prompts, capacity)
