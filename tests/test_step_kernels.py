"""The decode step's Triton kernels (in the interpreter on CPU, compiled on a GPU) against the
torch path they replace: RMSNorm with the residual add, rotary with the cache write (and Qwen3's
q/k norms), split-KV attention over the static cache, SiLU-and-multiply."""
import pytest
import torch
import torch.nn.functional as F

from specengine.kernels.activation import silu_mul_triton
from specengine.kernels.attention import BLOCK_N, MAX_Q_ROWS, query_rows, split_count
from specengine.kernels.norm import add_rms_norm_triton
from specengine.ops.attention import apply_rope, cached_attention, cached_attention_reference, attention_mask
from specengine.ops.norm import rms_norm_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def close(got, want):
    if want.dtype == torch.bfloat16:  # one rounding of bfloat16 apart at most
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


def same_rounding(got, want):
    """Equal, where the kernel rounds as torch does: compiled, and in float32. The interpreter
    truncates float32 to bfloat16 instead of rounding to nearest: there, one bfloat16 step."""
    if want.dtype == torch.bfloat16 and not torch.cuda.is_available():
        step = 2.0 ** (torch.frexp(want.float()).exponent - 8).float()
        assert ((got.float() - want.float()).abs() <= step).all()
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, N", [(1, 1), (3, 111), (7, 576), (2, 2048)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_rms_norm_with_the_residual_add(dtype, rows, N, with_delta):
    g = torch.Generator().manual_seed(N)
    x = (torch.randn(rows, N, generator=g) * 3).to(dtype).to(DEVICE)
    delta = (torch.randn(rows, N, generator=g)).to(dtype).to(DEVICE) if with_delta else None
    weight = (1 + torch.randn(N, generator=g) * 0.1).to(dtype).to(DEVICE)
    residual = x + delta if with_delta else x.clone()
    out = add_rms_norm_triton(x, weight, 1e-6, delta)
    same_rounding(x, residual)  # the residual stream is x + delta, rounded as torch rounds it
    close(out, rms_norm_reference(residual, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (5, 111), (2, 1536), (3, 2049)])
def test_silu_and_multiply(dtype, shape):
    rows, inter = shape
    x = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).to(dtype).to(DEVICE)
    gate, up = x.split(inter, dim=-1)
    close(silu_mul_triton(x), F.silu(gate) * up)


def attention_case(B, T, H, Hkv, D, lengths, dtype, capacity, seed=0, packed=True):
    """q, k, v (views of one packed projection, as the model has them), rotary tables, positions
    (row b appends T tokens at lengths[b]; a position past the capacity is padding), and a cache
    whose earlier entries are random."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    q, k, v = qkv.split((H * D, Hkv * D, Hkv * D), dim=-1)
    q, k, v = q.view(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
    positions = torch.tensor(lengths)[:, None] + torch.arange(T)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], -1)
    cache_k = torch.randn(B + 1, capacity + 1, Hkv, D, generator=g).to(dtype)  # a row beyond the batch
    cache_v = torch.randn(B + 1, capacity + 1, Hkv, D, generator=g).to(dtype)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return [to(t) for t in (q, k, v, emb.cos().to(dtype), emb.sin().to(dtype), positions, cache_k, cache_v)]


# (B, T, H, Hkv, D, lengths, capacity, sliding window): head_dim 64 and 128, 1..8 query heads per
# KV head, KV lengths 1, a key block's edge +-1, 4097, a sliding window, padding past the capacity.
ATTENTION_CASES = [
    (1, 1, 4, 4, 64, [0], 16, None),                       # one key
    (2, 1, 8, 1, 64, [BLOCK_N - 2, BLOCK_N], 200, None),    # lengths 63 and 65 keys visible
    (3, 5, 6, 2, 128, [BLOCK_N - 5, 9, 130], 256, None),   # a verification of 5 tokens, group of 3
    (2, 9, 8, 8, 64, [0, 40], 64, None),                    # row 1 pads past the capacity (spill slot)
    (2, 3, 4, 2, 64, [5, 64], 64, None),                    # row 1 all padding (a graph bucket's spare row)
    (1, 3, 16, 2, 64, [4094], 4097, None),                  # 4097 keys, group of 8
    (2, 4, 4, 2, 64, [70, 3], 128, 5),                      # Mistral's sliding window
    # Prompts: their query rows (T * group) fill several blocks of MAX_Q_ROWS per KV head.
    (1, 75, 8, 1, 64, [0], 80, None),                       # 600 rows: 10 blocks, causal within the prompt
    (2, 24, 6, 2, 64, [3, 20], 48, 17),                     # group of 3: a block ends inside a token's heads
    (1, 33, 4, 1, 8, [2], 40, None),                        # head_dim 8: the block of D padded for tl.dot
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"B{c[0]}-T{c[1]}-H{c[2]}/{c[3]}-D{c[4]}-w{c[7]}")
def test_attention_over_the_cache_equals_the_torch_path(dtype, case):
    B, T, H, Hkv, D, lengths, capacity, window = case
    q, k, v, cos, sin, positions, cache_k, cache_v = attention_case(B, T, H, Hkv, D, lengths, dtype, capacity)
    kv_len = min(int(positions.max()) + 1, capacity)
    # The reference in float32 (bfloat16 inputs upcast): the kernels compute in float32 and round
    # once, while torch's bfloat16 attention rounds at every op.
    ref_k, ref_v = cache_k.float(), cache_v.float()
    want = cached_attention_reference(*(t.float() for t in (q, k, v, cos, sin)), positions, ref_k, ref_v, kv_len,
                                      attention_mask(positions, kv_len, window)).to(dtype)
    ref_k, ref_v = ref_k.to(dtype), ref_v.to(dtype)
    got = cached_attention(q, k, v, cos, sin, positions, cache_k, cache_v, kv_len, window, impl="triton")
    real = (positions < capacity)[..., None].expand(-1, -1, H * D)  # padding queries' outputs are ignored
    close(got[real], want[real])
    assert torch.isfinite(got).all(), "padding queries get finite outputs (the logits of a round are checked)"
    close(cache_k, ref_k)  # every written slot, the spill slot included; the other rows untouched
    close(cache_v, ref_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_with_qwen3_norms_in_the_same_launch(dtype):
    from specengine.kernels.rotary import rope_write_triton
    from specengine.ops.attention import token_stride

    B, T, H, Hkv, D = 2, 3, 4, 2, 64
    q, k, v, cos, sin, positions, cache_k, cache_v = attention_case(B, T, H, Hkv, D, [5, 0], dtype, 32)
    g = torch.Generator().manual_seed(1)
    q_norm, k_norm = ((1 + 0.2 * torch.randn(D, generator=g)).to(dtype).to(DEVICE) for _ in range(2))
    want_k = cache_k.clone()
    rows = torch.arange(B, device=DEVICE)[:, None]
    want_q = apply_rope(rms_norm_reference(q, q_norm, 1e-6), cos, sin)
    want_k[rows, positions] = apply_rope(rms_norm_reference(k, k_norm, 1e-6), cos, sin)
    got_q = rope_write_triton(q, k, v, tuple(token_stride(t) for t in (q, k, v)), cos, sin, positions, cache_k,
                              cache_v, q_norm, k_norm, 1e-6)
    close(got_q, want_q)
    close(cache_k, want_k)


def test_splits_fill_the_gpu_and_stay_fixed_for_a_graph():
    assert split_count(1, 8, 4097) * 8 >= 200  # one row still spreads over the SMs
    assert split_count(1, 8, 1) == 1 and split_count(64, 8, 4097) == 1
    assert split_count(2, 3, 700) == split_count(2, 3, 700)  # a function of (B, Hkv, kv_len) alone
    # A long prompt's query blocks fill the GPU alone: one split, partials as large as the output.
    assert split_count(1, 8, 8192, query_rows(8192, 4)[1]) == 1


def test_query_rows_per_program_are_bounded():
    assert query_rows(1, 1) == (16, 1)      # a tl.dot's smallest M
    assert query_rows(5, 8) == (64, 1)      # a verification of gamma 4, group of 8: one block
    assert query_rows(9, 8) == (MAX_Q_ROWS, 2)
    assert query_rows(131072, 8) == (MAX_Q_ROWS, 131072 * 8 // MAX_Q_ROWS)
    assert query_rows(5, 8, dot_fp32=True) == (16, 3)  # float32 dots hold their operands in registers


@pytest.mark.parametrize("case", ["llama3-rope-gqa", "mistral-sliding", "qwen3-qk-norm-tied"])
def test_bfloat16_model_with_the_kernels_errs_like_the_torch_path(case, checkpoint):
    """Whole forwards in bfloat16 (a ragged prefill, then a verification-sized step): the logits'
    error against the same weights in float32 is, with the step kernels, of the size of the torch
    path's own bfloat16 error (the float32 logits match transformers: test_models)."""
    from specengine.steps.feed import feed
    from specengine.models import load_model

    prompts = [[5, 9, 13, 2, 7, 1, 4], [3, 3], [8, 1, 6, 6, 2]]
    chunk = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]], device=DEVICE)

    def logits(dtype, kernels):
        model = load_model(checkpoint(case), device=DEVICE, dtype=dtype)
        model.use_backend("triton" if kernels else "torch")
        cache = model.new_cache(len(prompts), 32)
        with torch.no_grad():
            first = model.logits(feed(model, cache, prompts))
            step = model.logits(model(chunk, cache.lengths.clone(), cache))
        assert model.triton_fallback_reason is None
        return torch.cat([first.flatten(), step.flatten()]).float()

    exact = logits(torch.float32, False)
    torch_error = (logits(torch.bfloat16, False) - exact).abs().max()
    kernel_error = (logits(torch.bfloat16, True) - exact).abs().max()
    # The interpreter truncates to bfloat16 where a GPU rounds to nearest: about twice the error.
    assert kernel_error <= (1.5 if torch.cuda.is_available() else 2.5) * torch_error


def test_kernels_that_fail_fall_back_to_the_torch_path_and_say_why(checkpoint, monkeypatch, caplog):
    import specengine.kernels.attention as attention
    from specengine.steps.feed import feed
    from specengine.models import load_model

    def broken(*args, **kwargs):
        raise RuntimeError("PTX assembly failed")

    model = load_model(checkpoint("llama3-rope-gqa"), device=DEVICE)
    model.use_backend("triton")
    monkeypatch.setattr(attention, "decode_attention_triton", broken)
    prompts = [[5, 9, 13], [3]]
    with torch.no_grad():
        got = model.logits(feed(model, model.new_cache(2, 16), prompts))
        assert model.backend.name == "torch"  # from the failed forward on
        want = model.logits(feed(model, model.new_cache(2, 16), prompts))
    assert model.triton_fallback_reason == "RuntimeError: PTX assembly failed"
    assert "the Triton step kernels failed" in caplog.text
    torch.testing.assert_close(got, want)


# Head sizes: on a GPU those the compiled kernels are built for; in the interpreter (a CPU, which
# pays per program and operation, not per element) the tiny models' 8, padded to tl.dot's 16.
ENGINE_HEAD_DIMS = [64, 128] if torch.cuda.is_available() else [None]


@pytest.mark.parametrize("head_dim", ENGINE_HEAD_DIMS)
@pytest.mark.parametrize("rounds_per_read", [1, 3])
def test_the_engine_decodes_alike_with_the_step_kernels_in_fixed_shape_steps(rounds_per_read, head_dim):
    """Both models on the kernels inside the fixed-shape steps of cuda_graphs (padded buckets,
    attention over the whole capacity, rounds from device state; graphs replayed on a GPU): the
    same tokens as the torch path."""
    from specengine import Engine, SamplingParams
    from specengine.drafters.model import ModelDrafter

    from bounds import Float64Llama, assert_tokens_agree
    from engine_util import assert_kernels_ran, tiny_model

    V = 40
    prompts = [[1, 2, 3, 4, 5], [7, 7], [3, 9, 27]]
    params = [SamplingParams(max_new_tokens=n, temperature=t, seed=s) for n, t, s in [(9, 0.0, 1), (7, 1.0, 2),
                                                                                      (8, 0.8, 3)]]
    tokens = {}
    for kernels in (False, True):
        target = tiny_model(V, seed=0, logit_scale=3.0, max_positions=64, head_dim=head_dim)
        draft = tiny_model(V, seed=5, num_layers=1, logit_scale=3.0, max_positions=64, head_dim=head_dim)
        if not kernels:  # the exact forwards of these weights, for the comparison below
            exact = Float64Llama.from_specengine(target), Float64Llama.from_specengine(draft)
        target, draft = target.to(DEVICE), draft.to(DEVICE)
        for model in (target, draft):
            model.use_backend("triton" if kernels else "torch")
        engine = Engine(target, drafter=ModelDrafter(draft, V, V), gamma=2, cuda_graphs=True, max_batch_size=4,
                        rounds_per_read=rounds_per_read)
        tokens[kernels] = [r.token_ids for r in engine.generate(prompts, params)]
        if kernels:  # (the torch run's backend is "torch" by choice)
            assert_kernels_ran(target, draft)
    # Two arithmetics: the same tokens up to a near tie of the exact logits (greedy) or a seeded
    # decision within the float32 bound of its threshold, where they may rightly part (tests/bounds.py).
    for prompt, p, got, want in zip(prompts, params, tokens[True], tokens[False]):
        assert_tokens_agree(got, want, prompt, p, *exact)
