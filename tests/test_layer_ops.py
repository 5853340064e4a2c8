"""The C++ decoder-layer ops (specengine.ops.attention, specengine.ops.norm, specengine.ops.decoder_layer)
against their torch references."""
import pytest
import torch

from specengine.layers.rotary import rope_cos_sin, rope_inv_freq
from specengine.models import load_model
from specengine.models.config import RopeConfig
from specengine.models.llama import StepInputs
from specengine.ops.attention import apply_rope, attention_mask, cached_attention
from specengine.ops.decoder_layer import decoder_layer
from specengine.ops.norm import rms_norm

from bounds import (Float64Llama, Tracked, assert_within, attention_error_bound, relative_attention_error_bound,
                    rms_norm_error_bound, tracked_rope)
from conftest import ARCH_CASES, cpu_isa_limit


def attention_case(B, T, H, Hkv, D, capacity, starts, seed=0):
    """Random q/k/v for T new tokens per row at positions starts[b] + t, over a cache whose
    entries (including stale ones past each row's length) are random."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g)
    k = torch.randn(B, T, Hkv, D, generator=g)
    v = torch.randn(B, T, Hkv, D, generator=g)
    positions = torch.tensor(starts)[:, None] + torch.arange(T)
    cos, sin = rope_cos_sin(rope_inv_freq(RopeConfig(theta=10000.0), D), positions, torch.float32)
    cache_k = torch.randn(B + 1, capacity + 1, Hkv, D, generator=g)  # one allocated row more than in use
    cache_v = torch.randn(B + 1, capacity + 1, Hkv, D, generator=g)
    return q, k, v, cos, sin, positions, cache_k, cache_v


def run(impl, case, kv_len, window=None):
    q, k, v, cos, sin, positions, cache_k, cache_v = (t.clone() for t in case)
    out = cached_attention(q, k, v, cos, sin, positions, cache_k, cache_v, kv_len, window, impl=impl)
    return out, cache_k, cache_v


def check_attention(got, want, case, kv_len, window, answered=None):
    """The C++ op's output and the torch reference's, each within its float32 error bound of the
    exact attention (tests/bounds.py): rows that see a key (answered [B, T], default all)."""
    exact, bound = attention_error_bound(*case[:4], case[4], case[5], kv_len, window, cache_k=case[6],
                                         cache_v=case[7])
    answered = torch.ones(got.shape[:2], dtype=torch.bool) if answered is None else answered
    assert_within(got[answered], exact[answered], bound[answered], "C++")
    assert_within(want[answered], exact[answered], bound[answered], "torch")


def check_rotated_keys(got_k, want_k, case):
    """The cache's k after the writes: C++ and torch within twice the rotary's float32 bound of each
    other where a token wrote (the last one to write a slot, as both write), equal elsewhere."""
    k, cos, sin, positions = case[1], case[3], case[4], case[5]
    bound = torch.zeros(got_k.shape, dtype=torch.float64)
    slot = positions.clamp(max=got_k.shape[1] - 1)
    for b in range(k.shape[0]):
        for t in range(k.shape[1]):
            rotated = tracked_rope(Tracked(k[b, t].double()), cos[b, t].double(), sin[b, t].double(), 0.0)
            bound[b, slot[b, t]] = 2 * rotated.e
    assert_within(got_k, want_k, bound, "rotated keys")


SHAPES = [  # B, T, H, Hkv, D, capacity, starts
    (1, 1, 4, 2, 8, 16, [7]),              # one decode step, grouped heads
    (3, 1, 4, 4, 16, 40, [0, 17, 39]),     # ragged rows, one at the last slot
    (2, 5, 6, 3, 48, 64, [3, 50]),         # a verification of 4 drafts + 1
    (5, 9, 8, 1, 64, 32, [0, 4, 9, 1, 23]),  # gamma 8, multi-query attention
    (1, 33, 2, 2, 4, 40, [0]),             # a prefill
    (2, 4, 2, 1, 8, 10, [5, 8]),           # positions past the capacity (padding into the spill slot)
    (1, 3, 9, 3, 64, 300, [200]),          # SmolLM2's verification of 2 drafts + 1
    (2, 20, 4, 2, 64, 160, [0, 100]),      # a prefill and a continuation
    (3, 2, 4, 1, 128, 200, [62, 127, 150]),  # head size 128
    (1, 1, 2, 2, 64, 1100, [1000]),        # a long context
    (2, 5, 6, 2, 64, 12, [9, 1]),          # padding past the capacity at head size 64
]


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize("window", [None, 1, 3, 70])
@pytest.mark.parametrize("B,T,H,Hkv,D,capacity,starts", SHAPES)
def test_attention_matches_the_reference(B, T, H, Hkv, D, capacity, starts, window, isa):
    case = attention_case(B, T, H, Hkv, D, capacity, starts)
    kv_len = min(max(starts) + T, capacity)
    want, want_k, want_v = run("reference", case, kv_len, window)
    with cpu_isa_limit(isa):
        got, got_k, got_v = run("cpp", case, kv_len, window)
    positions = case[5]
    seen = torch.arange(kv_len)
    visible = (seen <= positions[..., None]) & (window is None or seen > positions[..., None] - (window or 0))
    answered = visible.any(-1)  # [B, T]: only padding past kv_len can see no key (the reference gives NaN)
    assert got.shape == want.shape == (B, T, H * D)
    check_attention(got, want, case, kv_len, window, answered)
    assert torch.equal(got[~answered], torch.zeros_like(got[~answered]))
    # The cache writes: values copied, keys rotated (the same arithmetic up to fused multiply-adds).
    assert torch.equal(got_v, want_v)
    check_rotated_keys(got_k, want_k, case)


def test_packed_projection_views_read_in_place():
    """q, k and v as column blocks of one [B, T, N] projection output (how the model passes them)."""
    B, T, H, Hkv, D = 3, 4, 4, 2, 8
    case = attention_case(B, T, H, Hkv, D, 16, [0, 3, 9])
    q, k, v = case[:3]
    packed = torch.cat([t.reshape(B, T, -1) for t in (q, k, v)], dim=-1)
    qv, kv, vv = packed.split((H * D, Hkv * D, Hkv * D), dim=-1)
    views = (qv.view(B, T, H, D), kv.view(B, T, Hkv, D), vv.view(B, T, Hkv, D))
    assert not views[0].is_contiguous()
    want = run("cpp", case, 13)
    got = run("cpp", (*views, *case[3:]), 13)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("D", [8, 64])
def test_one_visible_key_returns_its_value_exactly(D):
    """Position 0 sees only itself: softmax over one key is 1, so the output is v, bit for bit;
    at position 0 the rotary embedding is the identity, so the cached key is k."""
    case = attention_case(2, 1, 4, 2, D, 8, [0, 0])
    q, k, v = case[:3]
    out, cache_k, cache_v = run("cpp", case, 1)
    assert torch.equal(out, v.repeat_interleave(2, dim=2).reshape(2, 1, -1))
    assert torch.equal(cache_k[:2, 0], k[:, 0]) and torch.equal(cache_v[:2, 0], v[:, 0])


@pytest.mark.parametrize("D,capacity,starts", [(8, 24, [2, 11, 6]), (64, 400, [2, 300, 130])])
def test_stale_entries_past_a_rows_length_are_never_read(D, capacity, starts):
    """Rolled-back drafts stay in the cache past each row's length: poisoning them with NaN must
    not change any output (a query at position p reads keys 0..p only)."""
    B, T, H, Hkv = 3, 2, 4, 2
    kv_len = max(starts) + T
    case = list(attention_case(B, T, H, Hkv, D, capacity, starts))
    clean = run("cpp", case, kv_len)[0]
    for b, start in enumerate(starts):
        case[6][b, start + T:] = float("nan")
        case[7][b, start + T:] = float("nan")
    poisoned = run("cpp", case, kv_len)[0]
    assert torch.equal(poisoned, clean)


def test_a_rows_attention_does_not_depend_on_the_other_rows():
    """Bit for bit the same output for a row alone and in a batch with longer and shorter rows."""
    T, H, Hkv, D, capacity = 3, 6, 2, 64, 300
    case = attention_case(3, T, H, Hkv, D, capacity, [40, 250, 130])
    together = run("cpp", case, 253)[0]
    for b, start in enumerate([40, 250, 130]):
        alone = [t[b:b + 1].clone() for t in case]
        assert torch.equal(run("cpp", alone, start + T)[0][0], together[b])


def test_attention_errors_name_the_problem():
    case = attention_case(1, 2, 4, 2, 8, 8, [0])
    q, k, v, cos, sin, positions, cache_k, cache_v = case
    with pytest.raises(ValueError, match="kv_len must be in"):
        cached_attention(*case, 9, impl="cpp")
    with pytest.raises(ValueError, match="multiple of kv heads"):
        cached_attention(q[:, :, :3], k, v, cos, sin, positions, cache_k, cache_v, 2, impl="cpp")
    with pytest.raises(ValueError, match="float32 CPU"):
        cached_attention(q.double(), k, v, cos, sin, positions, cache_k, cache_v, 2, impl="cpp")
    with pytest.raises(ValueError, match="positions must be >= 0"):
        cached_attention(q, k, v, cos, sin, positions - 5, cache_k, cache_v, 2, impl="cpp")
    with pytest.raises(ValueError, match="impl must be one of"):
        cached_attention(*case, 2, impl="fast")


# ---- a query's bits: the same alone, chunked, batched, on any thread count ---------------------

def prompt_case(N, H, Hkv, D, seed=0):
    """One prompt's q [1, N, H, D], k and v [1, N, Hkv, D] (a row the op is fed in chunks)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, N, H, D, generator=g), torch.randn(1, N, Hkv, D, generator=g),
            torch.randn(1, N, Hkv, D, generator=g))


def rope(positions, D):
    return rope_cos_sin(rope_inv_freq(RopeConfig(theta=10000.0), D), positions, torch.float32)


def attend_chunked(attend, prompt, chunk, window, capacity):
    """The prompt's attention [N, H * D] with its tokens fed `chunk` a call onto an empty cache."""
    q, k, v = prompt
    N, Hkv, D = q.shape[1], k.shape[2], q.shape[3]
    cache_k, cache_v = torch.zeros(1, capacity + 1, Hkv, D), torch.zeros(1, capacity + 1, Hkv, D)
    outs = []
    for t0 in range(0, N, chunk):
        t1 = min(N, t0 + chunk)
        positions = torch.arange(t0, t1)[None]
        outs.append(attend(q[:, t0:t1], k[:, t0:t1], v[:, t0:t1], *rope(positions, D), positions, cache_k, cache_v,
                           t1, window))
    return torch.cat(outs, dim=1)[0]


def attend_in_batch(attend, prompt, window, capacity, seed=1):
    """The prompt's attention [N, H * D] unchunked, as row 1 of 3: the others at later positions
    over random caches (so kv_len runs past the prompt's keys, and the rows' work differs)."""
    q, k, v = prompt
    N, H, Hkv, D = q.shape[1], q.shape[2], k.shape[2], q.shape[3]
    g = torch.Generator().manual_seed(seed)
    starts = torch.tensor([capacity - N, 0, (capacity - N) // 3])
    positions = starts[:, None] + torch.arange(N)
    qb, kb, vb = (torch.cat([torch.randn(x.shape, generator=g), x, torch.randn(x.shape, generator=g)])
                  for x in (q, k, v))
    cache_k, cache_v = (torch.randn(3, capacity + 1, Hkv, D, generator=g) for _ in range(2))
    cache_k[1].zero_(), cache_v[1].zero_()
    return attend(qb, kb, vb, *rope(positions, D), positions, cache_k, cache_v, capacity, window)[1]


def queries_keep_their_bits(attend, prompt, window, chunks=(1, 5, 33), capacity=None) -> bool:
    """Whether every query of the prompt gets the same bits fed whole, in chunks of each size
    (decoding, verification, chunked prefill), as one row of a batch, and with 1 and 2 threads."""
    N = prompt[0].shape[1]
    capacity = capacity or N + 100
    whole = attend_chunked(attend, prompt, N, window, capacity)
    same = all(torch.equal(attend_chunked(attend, prompt, chunk, window, capacity), whole) for chunk in chunks)
    threads = torch.get_num_threads()  # torch's OpenMP runtime is the one specengine._C runs on
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            same &= torch.equal(attend_chunked(attend, prompt, N, window, capacity), whole)
            same &= torch.equal(attend_in_batch(attend, prompt, window, capacity), whole)
    finally:
        torch.set_num_threads(threads)
    return same


def cpp_attention(*args):
    return cached_attention(*args, impl="cpp")


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize("H,Hkv,D,window", [(9, 3, 64, None), (9, 3, 64, 100), (4, 4, 8, None), (8, 1, 128, 37)])
def test_a_querys_attention_does_not_depend_on_its_call(H, Hkv, D, window, isa):
    """512 tokens (SmolLM2's heads first): each query's bits at T = 1, 5, 33 and 512, batched,
    on 1 and 2 threads."""
    prompt = prompt_case(512, H, Hkv, D, seed=H + D)
    with cpu_isa_limit(isa):
        assert queries_keep_their_bits(cpp_attention, prompt, window)


def blocked_attention(block_of):
    """Attention in torch whose keys are taken in blocks of block_of(T) (online softmax: the
    running max and sum rescaled at each block). Every sum is a chain of elementwise float32 adds
    and exp is taken in float64, so that with a fixed block size each query's bits are its own
    (torch's reductions and float32 exp pick their order and code path by the tensor's shape);
    with a size that follows T (a kernel choosing its tiling by shape), the rescalings move."""
    def exp(x):
        return torch.exp(x.double()).float().nan_to_num(0.0)  # -inf - -inf (no key yet): weight 0

    def attend(q, k, v, cos, sin, positions, cache_k, cache_v, kv_len, window):
        B, T, H, D = q.shape
        group = H // k.shape[2]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rows = torch.arange(B)[:, None]
        cache_k[rows, positions], cache_v[rows, positions] = k, v
        keys = cache_k[:B, :kv_len].repeat_interleave(group, dim=2).permute(0, 2, 3, 1)[:, None]  # [B, 1, H, D, S]
        values = cache_v[:B, :kv_len].repeat_interleave(group, dim=2).permute(0, 2, 1, 3)[:, None]  # [B, 1, H, S, D]
        scores = torch.zeros(B, T, H, kv_len)
        for d in range(D):
            scores = scores + q[..., d, None] * keys[..., d, :]
        scores = (scores / D ** 0.5).masked_fill(~attention_mask(positions, kv_len, window)[:, 0, :, None, :],
                                                 float("-inf"))
        m = torch.full((B, T, H), float("-inf"))
        total, acc = torch.zeros(B, T, H), torch.zeros(B, T, H, D)
        block = block_of(T)
        for s0 in range(0, kv_len, block):
            part = scores[..., s0:s0 + block]
            m_new = torch.maximum(m, part.amax(-1))
            alpha, p = exp(m - m_new), exp(part - m_new[..., None])
            total, acc = total * alpha, acc * alpha[..., None]
            for j in range(part.shape[-1]):
                total = total + p[..., j]
                acc = acc + p[..., j, None] * values[..., s0 + j, :]
            m = m_new
        return (acc / total[..., None]).reshape(B, T, H * D)
    return attend


def test_an_order_that_follows_the_call_would_fail_the_invariance_test():
    """Planted: online softmax over key blocks whose size follows T; the same arithmetic with a
    fixed block size passes (so the check catches the order, not torch)."""
    prompt = prompt_case(80, 4, 2, 16, seed=3)
    assert queries_keep_their_bits(blocked_attention(lambda T: 16), prompt, None, chunks=(1, 7, 33))
    assert not queries_keep_their_bits(blocked_attention(lambda T: 8 * (1 + T % 3)), prompt, None, chunks=(1, 7, 33))


ACCURACY_CALLS = [  # T, start (kv_len = start + T)
    (1, 0),      # one key
    (5, 12),     # a verification over 17 keys
    (17, 0),     # a prefill of 17
    (33, 480),   # a chunk of a prefill, 513 keys
    (1, 512),    # a decode step over 513 keys
]


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize("window", [None, 5, 100])
@pytest.mark.parametrize("T,start", ACCURACY_CALLS)
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("D", [8, 64, 128])
def test_attention_is_accurate_on_hostile_shapes(D, group, T, start, window, isa):
    """Against the torch reference within float32 rounding: head sizes 8 to 128, 1 to 8 query
    heads a kv head, 1 to 513 keys, sliding windows, two ragged rows."""
    Hkv = 2
    case = attention_case(2, T, group * Hkv, Hkv, D, start + T + 3, [start, max(0, start - 3)], seed=D + group)
    kv_len = start + T
    want = run("reference", case, kv_len, window)[0]
    with cpu_isa_limit(isa):
        got = run("cpp", case, kv_len, window)[0]
    check_attention(got, want, case, kv_len, window)


def test_avx512_and_avx2_attention_agree_bit_for_bit():
    """Both run each lane's operations in the same order (layers.cpp), so they agree exactly."""
    case = attention_case(2, 37, 9, 3, 64, 600, [0, 500], seed=7)
    results = {}
    for isa in ("avx512", "avx2"):
        with cpu_isa_limit(isa):
            results[isa] = run("cpp", case, 537, 64)[0]
    assert torch.equal(results["avx512"], results["avx2"])


@pytest.mark.parametrize("shape", [(1, 192), (3, 5, 512), (7, 1), (2, 33), (0, 8)])
def test_rms_norm_matches_the_reference(shape):
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=g) * 3
    weight = torch.randn(shape[-1], generator=g)
    want = rms_norm(x, weight, 1e-6, impl="reference")
    got = rms_norm(x, weight, 1e-6, impl="cpp")
    assert got.shape == want.shape
    exact, bound = rms_norm_error_bound(x, weight, 1e-6)  # both float32, each within the bound
    assert_within(want, exact, bound, "reference")
    assert_within(got, exact, bound, "C++")


def test_rms_norm_exact_cases():
    """Unit rows with eps 0 have rms 1 (out = weight exactly); a strided input is read correctly."""
    weight = torch.randn(48)
    assert torch.equal(rms_norm(torch.ones(3, 48), weight, 0.0, impl="cpp"), weight.expand(3, 48))
    x = torch.randn(4, 96)[:, ::2]
    assert_within(rms_norm(x, weight, 1e-6, impl="cpp"), *rms_norm_error_bound(x, weight, 1e-6))


def test_rms_norm_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 8\]"):
        rms_norm(torch.ones(2, 7), torch.ones(8), 1e-6, impl="cpp")
    with pytest.raises(ValueError, match="float32 CPU"):
        rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-6, impl="cpp")


def layer_case(checkpoint, case: str, B: int, T: int, starts: list[int], capacity: int = 24, seed: int = 0):
    """Layer 1 of the case's bfloat16 checkpoint (bfloat16-stored matrices), a random residual
    stream x [B, T, hidden] at positions starts[b] + t, and a random cache (stale entries too)."""
    model = load_model(checkpoint(case, torch.bfloat16))
    layer = model.model.layers[1]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, model.config.hidden_size, generator=g)
    positions = torch.tensor(starts)[:, None] + torch.arange(T)
    cos, sin = rope_cos_sin(model._inv_freq, positions, torch.float32)
    cache = model.new_cache(B, capacity)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    kv_len = min(max(starts) + T, capacity)
    return model, layer, x, positions, cos, sin, cache, kv_len


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize("B,T,starts", [(1, 1, [9]), (3, 5, [0, 11, 4]), (2, 9, [6, 1])])
@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_decoder_layer_matches_the_torch_ops(case, B, T, starts, isa, checkpoint):
    """The whole-layer op against the layer's torch path on the same bfloat16-stored weights:
    the output and both cache writes (rows in use only; the spare row is untouched)."""
    model, layer, x, positions, cos, sin, cache, kv_len = layer_case(checkpoint, case, B, T, starts)
    attn = layer.self_attn
    # The exact results on these bfloat16 weights (the float32 cos and sin as given) and their
    # float32 bounds (tests/bounds.py): output, and layer 1's k and v after the writes.
    (exact, exact_k, exact_v), (bound, bound_k, bound_v) = Float64Llama.from_specengine(model).layer(
        1, x, positions, cos, sin, *cache.layer(1), kv_len)
    want_cache = model.new_cache(B, cache.capacity)
    want_cache.k.copy_(cache.k), want_cache.v.copy_(cache.v)
    step = StepInputs(positions, cos, sin, kv_len, impl="reference",
                      mask=attention_mask(positions, kv_len, attn.sliding_window))
    with torch.no_grad():
        after_attention, mlp_out = layer(x.clone(), None, step, want_cache)
        want = after_attention + mlp_out
        cache_k, cache_v = cache.layer(1)
        with cpu_isa_limit(isa):
            got = decoder_layer(x.clone(), layer.weights(), attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                layer.input_layernorm.eps, cos, sin, positions, cache_k, cache_v, kv_len,
                                attn.sliding_window)
    for name, result, cached in (("C++", got, cache), ("torch", want, want_cache)):
        assert_within(result, exact, bound, name)
        assert_within(cached.layer(1)[0], exact_k, bound_k, f"{name} keys")
        assert_within(cached.layer(1)[1], exact_v, bound_v, f"{name} values")
    assert torch.equal(cache.k[0], want_cache.k[0]) and torch.equal(cache.v[0], want_cache.v[0])  # layer 0's


def test_decoder_layer_updates_x_in_place(checkpoint):
    """x is the residual stream: the op returns x itself, updated (the model relies on it)."""
    model, layer, x, positions, cos, sin, cache, kv_len = layer_case(checkpoint, "llama3-rope-gqa", 2, 3, [0, 5])
    attn = layer.self_attn
    before = x.clone()
    out = decoder_layer(x, layer.weights(), attn.num_heads, attn.num_kv_heads, attn.head_dim, 1e-6, cos, sin,
                        positions, *cache.layer(1), kv_len)
    assert out is x
    assert not torch.equal(x, before)


def test_decoder_layer_errors_name_the_problem(checkpoint):
    model, layer, x, positions, cos, sin, cache, kv_len = layer_case(checkpoint, "qwen3-qk-norm-tied", 1, 2, [3])
    attn = layer.self_attn
    cache_k, cache_v = cache.layer(1)
    args = dict(num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, eps=1e-6, cos=cos,
                sin=sin, positions=positions, cache_k=cache_k, cache_v=cache_v, kv_len=kv_len)
    w = layer.weights()
    with pytest.raises(ValueError, match="qkv must be a contiguous torch.bfloat16"):
        decoder_layer(x, w._replace(qkv=w.qkv.float()), **args)
    with pytest.raises(ValueError, match=r"down must be \["):
        decoder_layer(x, w._replace(down=w.down[:, 1:].contiguous()), **args)
    with pytest.raises(ValueError, match="q_norm and k_norm come together"):
        decoder_layer(x, w._replace(k_norm=None), **args)
    with pytest.raises(ValueError, match="input_norm is required"):
        decoder_layer(x, w._replace(input_norm=None), **args)
    with pytest.raises(ValueError, match="x must be a contiguous float32"):
        decoder_layer(x.double(), w, **args)
    with pytest.raises(ValueError, match="kv_len must be in"):
        decoder_layer(x, w, **{**args, "kv_len": cache.capacity + 1})
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        decoder_layer(x, w, **{**args, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="positions must be >= 0"):
        decoder_layer(x, w, **{**args, "positions": positions - 9})


# ---- T5's relative attention -----------------------------------------------------------------

def relative_case(B, T, H, D, slots, starts, seed=0):
    """Random q/k/v, cache (stale entries included) and bias table for T new tokens per row."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    positions = torch.tensor(starts)[:, None] + torch.arange(T)
    cache_k = torch.randn(B + 1, slots, H, D, generator=g)
    cache_v = torch.randn(B + 1, slots, H, D, generator=g)
    table = torch.randn(slots + T, H, generator=g) * 3
    return q, k, v, positions, cache_k, cache_v, table


RELATIVE_SHAPES = [  # B, T, H, D, slots (capacity + 1 with writes), starts
    (1, 1, 4, 8, 17, [7]),               # one decode step
    (3, 5, 6, 16, 41, [0, 17, 35]),      # a verification of 4 drafts, ragged rows
    (2, 9, 2, 64, 33, [1, 20]),          # gamma 8
    (2, 4, 2, 8, 11, [5, 8]),            # positions past the capacity (padding into the spill slot)
]


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize("kind", ["self", "cross", "self-no-bias"])
@pytest.mark.parametrize("B,T,H,D,slots,starts", RELATIVE_SHAPES)
def test_relative_attention_matches_the_reference(B, T, H, D, slots, starts, kind, isa):
    from specengine.ops.attention import relative_attention

    q, k, v, positions, cache_k, cache_v, table = relative_case(B, T, H, D, slots, starts)
    if kind == "cross":  # encoder keys: each row sees its first n (n - 1 as the position), nothing written
        k = v = None
        positions = torch.tensor([[min(s + 2, slots - 1)] * T for s in starts])
        table, kv_len = None, slots
    else:
        kv_len = min(max(starts) + T, slots - 1)
        table = None if kind == "self-no-bias" else table
    results = {}
    with cpu_isa_limit(isa):  # the reference is torch's; the limit moves only the C++ path
        for impl in ("reference", "cpp"):
            ck, cv = cache_k.clone(), cache_v.clone()
            results[impl] = (relative_attention(q, k, v, positions, ck, cv, kv_len, table, impl=impl), ck, cv)
    (want, want_k, want_v), (got, got_k, got_v) = results["reference"], results["cpp"]
    assert got.shape == (B, T, H * D)
    # Both float32: each within the float32 bound of the exact attention (tests/bounds.py).
    exact, bound = relative_attention_error_bound(q, k, v, positions, cache_k, cache_v, kv_len, table)
    assert_within(want, exact, bound, "reference")
    assert_within(got, exact, bound, "C++")
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    if kind == "cross":
        assert torch.equal(got_k, cache_k)  # nothing written


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_a_relative_attention_querys_bits_do_not_depend_on_its_call(isa):
    """T5 self-attention shares cached_attention's kernels: a prompt fed whole, a token at a time
    or 7 at a time gives every query the same bits."""
    from specengine.ops.attention import relative_attention

    N, H, D = 40, 3, 16
    q, k, v, _, cache_k, cache_v, table = relative_case(1, N, H, D, N + 1, [0])
    results = []
    with cpu_isa_limit(isa):
        for chunk in (N, 1, 7):
            ck, cv = torch.zeros_like(cache_k), torch.zeros_like(cache_v)
            outs = [relative_attention(q[:, t0:t0 + chunk], k[:, t0:t0 + chunk], v[:, t0:t0 + chunk],
                                       torch.arange(t0, min(N, t0 + chunk))[None], ck, cv, min(N, t0 + chunk), table,
                                       impl="cpp") for t0 in range(0, N, chunk)]
            results.append(torch.cat(outs, dim=1))
    assert all(torch.equal(r, results[0]) for r in results[1:])


def test_relative_attention_bias_is_the_keys_distance_back():
    """One query at position 3 over keys 0..3 with equal scores: softmax of the bias rows 3, 2, 1, 0."""
    from specengine.ops.attention import relative_attention

    H, D = 1, 2
    q = torch.zeros(1, 1, H, D)
    cache_k = torch.zeros(1, 5, H, D)
    cache_v = torch.arange(5.0)[None, :, None, None].expand(1, 5, H, D).contiguous()
    table = torch.tensor([[0.0], [1.0], [2.0], [3.0], [9.0]])
    out = relative_attention(q, None, None, torch.tensor([[3]]), cache_k, cache_v, 5, table, impl="cpp")
    weights = torch.softmax(torch.tensor([3.0, 2.0, 1.0, 0.0]), 0)  # keys 0..3 lie 3..0 back
    torch.testing.assert_close(out[0, 0], (weights * torch.arange(4.0)).sum().expand(D))


def test_relative_attention_errors_name_the_problem():
    from specengine.ops.attention import relative_attention

    q, k, v, positions, cache_k, cache_v, table = relative_case(1, 2, 2, 4, 9, [3])
    with pytest.raises(ValueError, match="both k and v"):
        relative_attention(q, k, None, positions, cache_k, cache_v, 5, table)
    with pytest.raises(ValueError, match="kv_len must be in"):
        relative_attention(q, k, v, positions, cache_k, cache_v, 9, table)
    with pytest.raises(ValueError, match="bias_table must be"):
        relative_attention(q, k, v, positions, cache_k, cache_v, 5, table[:4])
    with pytest.raises(ValueError, match="float32 CPU"):
        relative_attention(q.double(), k, v, positions, cache_k, cache_v, 5, table, impl="cpp")
