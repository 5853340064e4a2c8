"""models.widen: the widened model computes its source's function (the benchmarks' memory-bound
target relies on it) and refuses shapes it cannot embed the source in."""
import pytest
import torch

from specengine.models.widen import widen

from bounds import Float64Llama, within
from engine_util import tiny_model


def logits_of(model, tokens: list[int]) -> torch.Tensor:
    """Prefill all but the last token, then one decode step: logits [T, V] of both calls."""
    cache = model.new_cache(1, 64)
    prefill = torch.tensor([tokens[:-1]])
    first = model.logits(model(prefill, cache.lengths.clone(), cache))[0]
    cache.lengths.add_(prefill.shape[1])
    step = model.logits(model(torch.tensor([tokens[-1:]]), cache.lengths.clone(), cache))[0]
    return torch.cat([first, step])


@pytest.mark.parametrize("backend", ["cpp-ops", "torch"], ids=["cpp-ops", "torch-ops"])
@pytest.mark.parametrize("shape", [dict(hidden_size=96, intermediate_size=160, num_heads=12, num_kv_heads=3, num_layers=4),
                                   dict(hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, num_layers=2)],
                         ids=["wider-deeper", "same-shape"])
@torch.inference_mode()
def test_widened_model_computes_the_source(shape, backend):
    source = tiny_model(vocab_size=50, seed=3, hidden_size=32, logit_scale=4.0)  # 4 heads of 8, 2 kv heads, 2 layers
    wide = widen(source, **shape)
    for m in (source, wide):
        m.use_backend(backend)
    assert wide.config.hidden_size == shape["hidden_size"] and len(wide.model.layers) == shape["num_layers"]
    tokens = [5, 17, 3, 44, 9, 21, 30, 2]
    expected, got = logits_of(source, tokens), logits_of(wide, tokens)
    # Each model's float32 logits within its own float32 bound of its exact ones (tests/bounds.py).
    exact_source, exact_wide = (Float64Llama.from_specengine(m).logits(tokens) for m in (source, wide))
    exact_source.check(expected, "source")
    exact_wide.check(got, "widened")
    # The exact functions differ only by the widened norm weights' and eps's float32 rounding (u
    # relative, once each), less than the rounding of each norm's output that the bound carries.
    assert within(exact_wide.exact, exact_source.exact, exact_source.bound)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@torch.inference_mode()
def test_widening_adds_parameters_that_matter_for_cost_not_output():
    source = tiny_model(vocab_size=50, seed=3, hidden_size=32)
    wide = widen(source, hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=2, num_layers=3)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(wide) > 3 * count(source)
    # The extra layer's matrices that read the residual are random, not zero: it really computes.
    extra = wide.model.layers[2]
    assert extra.self_attn.qkv_proj.weight.abs().sum() > 0 and extra.mlp.gate_up_proj.weight.abs().sum() > 0
    # A different seed changes the filler weights, never the output.
    other = widen(source, hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=2, num_layers=3, seed=1)
    assert not torch.equal(other.model.layers[2].mlp.gate_up_proj.weight, extra.mlp.gate_up_proj.weight)
    exact = Float64Llama.from_specengine(wide).logits([1, 2, 3])  # both within its float32 bound
    exact.check(logits_of(wide, [1, 2, 3]), "seed 0")
    exact.check(logits_of(other, [1, 2, 3]), "seed 1")


@pytest.mark.parametrize("shape, message", [
    (dict(hidden_size=16), "hidden_size 16 is smaller"),
    (dict(num_layers=1), "num_layers 1 is smaller"),
    (dict(num_heads=6, num_kv_heads=4), "multiple of num_kv_heads"),
    (dict(num_heads=4, num_kv_heads=4), "query heads per kv head"),
])
def test_widen_refuses_shapes_that_cannot_hold_the_source(shape, message):
    source = tiny_model(vocab_size=50, hidden_size=32)
    args = dict(hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=2, num_layers=2) | shape
    with pytest.raises(ValueError, match=message):
        widen(source, **args)
