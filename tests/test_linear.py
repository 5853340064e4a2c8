"""The bfloat16-weight matrix product (specengine.ops.linear) against its float32 reference."""
import pytest
import torch

from specengine.models import load_model
from specengine.ops.linear import linear_bf16_weight

from bounds import AMX_TERMS, Float64Llama, assert_within, product_difference_bound, product_error_bound
from conftest import ARCH_CASES, cpu_isa_limit

# The C++ op's AVX-512 and AVX2/FMA tiles, and the plain loops of CPUs without either.
IMPLS = ["cpp-avx512", "cpp-avx2", "cpp-portable"]


def product(x, weight, bias, impl):
    with cpu_isa_limit(impl.removeprefix("cpp-")):
        return linear_bf16_weight(x, weight, bias, impl="cpp")


def operands(R, K, N, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, K, generator=g)
    weight = torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g) if bias else None
    return x, weight, b


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("R", [1, 2, 3, 4, 5, 6, 7, 9, 33])
@pytest.mark.parametrize("K,N", [(1, 1), (15, 3), (16, 2), (17, 5), (33, 7), (48, 9), (192, 97), (513, 64), (64, 8193)])
def test_matches_the_float32_reference(impl, R, K, N):
    x, weight, bias = operands(R, K, N, bias=N % 2 == 1)
    want = linear_bf16_weight(x, weight, bias, impl="reference")
    got = product(x, weight, bias, impl)
    # Only the summation order differs: two float32 sums, each within its error bound of the exact one.
    assert got.shape == want.shape == (R, N)
    assert_within(got, want, product_difference_bound(x, weight, bias))


@pytest.mark.parametrize("impl", IMPLS)
def test_exact_on_integer_operands(impl):
    """Small integers make every product and partial sum exact in float32, in any order:
    a wrong lane, a dropped tail element or a misplaced bias shows up as an inequality."""
    g = torch.Generator().manual_seed(1)
    for R, K, N in [(1, 37, 11), (5, 48, 7), (9, 100, 13), (4, 16, 4), (3, 64, 6), (2, 96, 9)]:
        x = torch.randint(-8, 9, (R, K), generator=g).float()
        weight = torch.randint(-8, 9, (N, K), generator=g).bfloat16()
        bias = torch.randint(-8, 9, (N,), generator=g).float()
        want = x @ weight.float().t() + bias
        assert torch.equal(product(x, weight, bias, impl), want)


def test_keeps_leading_dimensions_and_accepts_strided_input():
    x, weight, _ = operands(6, 32, 10, bias=False)
    x3 = x.view(2, 3, 32)
    # Two float32 products of the same operands (tests/bounds.py).
    assert_within(linear_bf16_weight(x3, weight), linear_bf16_weight(x3, weight, impl="reference"),
                  product_difference_bound(x3, weight))
    strided = torch.randn(32, 6).t()  # [6, 32], not contiguous
    assert_within(linear_bf16_weight(strided, weight), linear_bf16_weight(strided.contiguous(), weight, impl="reference"),
                  product_difference_bound(strided, weight))
    assert linear_bf16_weight(torch.randn(0, 32), weight).shape == (0, 10)


@pytest.mark.parametrize("bad,message", [
    (dict(x=torch.randn(2, 31)), "x must be"),
    (dict(x=torch.randn(2, 32).double()), "x must be float32"),
    (dict(weight=torch.randn(10, 32)), "weight must be bfloat16"),
    (dict(weight=torch.randn(32, 10).bfloat16().t()), "contiguous"),
    (dict(bias=torch.randn(9)), "bias must be"),
    (dict(impl="cuda"), "impl must be"),
])
def test_bad_arguments_are_named(bad, message):
    args = dict(x=torch.randn(2, 32), weight=torch.randn(10, 32).bfloat16(), bias=None, impl="auto")
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        linear_bf16_weight(**args)


def test_the_instruction_set_limit_is_checked_and_restored():
    from specengine import _C

    widest = _C.cpu_isa()
    with pytest.raises(ValueError, match="cpu isa must be 'amx', 'avx512', 'avx2' or 'portable', not 'sse4'"):
        _C.set_cpu_isa_limit("sse4")
    assert _C.cpu_isa() == widest
    with cpu_isa_limit("portable"):
        assert _C.cpu_isa() == "portable"
    assert _C.cpu_isa() == widest


# Prompt-sized products (GEMM_MIN_TOKENS_PER_ROW or more tokens per row) on CPUs without AMX: the
# weights widened 32 rows at a time and float32 FMA tiles (ops.product, ops.blocks_cpp.gemm_blocks_cpp).
WIDENED_IMPLS = ["avx512", "avx2", "portable"]


@pytest.mark.parametrize("isa", WIDENED_IMPLS)
@pytest.mark.parametrize("T,K,N", [(32, 17, 5), (40, 576, 97), (33, 100, 1), (64, 1536, 33)])
def test_prompt_sized_products_match_the_float32_reference(isa, T, K, N):
    from specengine.ops.product import product_cpp

    x, weight, bias = operands(2 * T, K, N, bias=N % 2 == 1)
    x = x.view(2, T, K)
    with cpu_isa_limit(isa):
        got = product_cpp(x, weight, bias)
    exact = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    scale = x.double().abs() @ weight.double().abs().t() + (0 if bias is None else bias.double().abs())
    assert got.shape == (2, T, N) and got.dtype == torch.float32
    assert ((got.double() - exact).abs() <= (K + 2) * 2.0 ** -24 * scale).all()


@pytest.mark.parametrize("isa", WIDENED_IMPLS)
def test_a_prompts_rows_do_not_depend_on_the_prompts_beside_it(isa):
    """Bitwise: a prompt's product alone, in a batch of prompts (whatever they hold) and cut in
    chunks of GEMM_MIN_TOKENS_PER_ROW or more tokens."""
    from specengine.ops.product import GEMM_MIN_TOKENS_PER_ROW, product_cpp

    x, weight, bias = operands(3 * 100, 576, 200, bias=True)
    prompts = x.view(3, 100, 576)
    with cpu_isa_limit(isa):
        alone = product_cpp(prompts[1:2], weight, bias)
        assert torch.equal(product_cpp(prompts, weight, bias)[1:2], alone)
        prompts[0] = 1000.0
        assert torch.equal(product_cpp(prompts, weight, bias)[1:2], alone)
        chunks = [product_cpp(prompts[1:2, t:t + 50], weight, bias) for t in (0, 50)]
        assert torch.equal(torch.cat(chunks, dim=1), alone)
        one_chunk = slice(60, 60 + GEMM_MIN_TOKENS_PER_ROW)
        assert torch.equal(product_cpp(prompts[1:2, one_chunk], weight, bias), alone[:, one_chunk])


def same_bits_in_any_batch(product, prompts: torch.Tensor) -> bool:
    """Whether product(x) gives short prompts [B, T < GEMM_MIN_TOKENS_PER_ROW, K] (as a prefill batches them)
    and one-token rows (as a decode step does) the same bits alone and beside any others."""
    same = True
    alone = [product(prompts[b:b + 1]) for b in (0, 17, 39)]
    for B in (2, 18, 40):
        batch = product(prompts[:B])
        same &= all(torch.equal(batch[b:b + 1], a) for b, a in zip((0, 17, 39), alone) if b < B)
    rows = prompts[:, 0]
    return same and torch.equal(product(rows)[17], product(rows[17:18])[0])


@pytest.mark.parametrize("isa", WIDENED_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_layers_rows_get_the_same_bits_in_any_batch(dtype, isa):
    """A model layer's C++ product (ops.product): steps.feed batches short prompts on this."""
    from specengine.ops.product import product_cpp

    g = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(97, 576, generator=g).to(dtype), torch.randn(97, generator=g)
    prompts = torch.randn(40, 5, 576, generator=g)
    with torch.no_grad(), cpu_isa_limit(isa):
        assert same_bits_in_any_batch(lambda x: product_cpp(x, weight, bias), prompts)


def test_a_sum_whose_order_follows_the_batch_fails_the_batch_test():
    """Planted: the sum over k cut where a shape-chosen blocking would cut it (by the row count)."""
    g = torch.Generator().manual_seed(8)
    weight, prompts = torch.randn(97, 576, generator=g), torch.randn(40, 5, 576, generator=g)

    def by_shape(x):
        step = 64 if x.numel() // x.shape[-1] > 8 else 192
        return sum(x[..., k:k + step] @ weight[:, k:k + step].t() for k in range(0, 576, step))

    assert not same_bits_in_any_batch(by_shape, prompts)


# The AMX op: prompt-sized products, tiles of 16 rows and 32 k, blocks of 32 columns.
AMX_SHAPES = [(1, 1, 1), (15, 2, 15), (16, 31, 16), (17, 32, 17), (33, 33, 31), (64, 576, 33), (40, 1537, 97),
              (100, 64, 8193), (3, 48, 32)]


def amx_product(x, weight, bias):
    with cpu_isa_limit("amx"):
        return linear_bf16_weight(x, weight, bias, impl="amx")


@pytest.mark.parametrize("R,K,N", AMX_SHAPES)
def test_the_amx_op_matches_the_float32_reference(R, K, N):
    x, weight, bias = operands(R, K, N, bias=N % 2 == 1)
    got = amx_product(x, weight, bias)
    want = linear_bf16_weight(x, weight, bias, impl="reference")
    assert got.shape == want.shape == (R, N)
    # Each within its float32 bound of the exact product: x in three bfloat16 terms, and one sum.
    assert_within(got, want, product_error_bound(x, weight, bias, terms=AMX_TERMS)
                  + product_error_bound(x, weight, bias))


def test_the_amx_op_is_exact_on_integer_operands():
    g = torch.Generator().manual_seed(2)
    for R, K, N in [(17, 37, 11), (32, 64, 33), (5, 100, 16), (48, 33, 47)]:
        x = torch.randint(-8, 9, (R, K), generator=g).float()
        weight = torch.randint(-8, 9, (N, K), generator=g).bfloat16()
        bias = torch.randint(-8, 9, (N,), generator=g).float()
        assert torch.equal(amx_product(x, weight, bias), x @ weight.float().t() + bias)


def test_the_amx_op_keeps_all_of_float32s_significand():
    """x = 1 + 2^-10 + 2^-20 needs all three bfloat16 terms (1, 2^-10, 2^-20): with two the
    result would be 1 + 2^-10."""
    x = torch.full((16, 1), 1 + 2 ** -10 + 2 ** -20)
    weight = torch.ones(3, 1, dtype=torch.bfloat16)
    assert torch.equal(amx_product(x, weight, None), x.expand(16, 3))


def test_an_amx_row_does_not_depend_on_the_other_rows():
    """Each row's sums run in the same order whatever else the call holds: a prompt prefills
    alike alone or in a batch (bitwise)."""
    x, weight, bias = operands(70, 576, 100, bias=True)
    together = amx_product(x, weight, bias)
    for r in (0, 15, 16, 69):
        assert torch.equal(amx_product(x[r:r + 1], weight, bias)[0], together[r])
        assert torch.equal(amx_product(x[r:r + 17], weight, bias)[0], together[r])


def test_the_amx_op_is_refused_where_it_cannot_run():
    x, weight, _ = operands(32, 64, 16, bias=False)
    with cpu_isa_limit("avx512"), pytest.raises(ValueError, match="impl 'amx' needs a CPU with AMX"):
        linear_bf16_weight(x, weight, impl="amx")


@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_bfloat16_checkpoints_keep_bfloat16_matrices_and_match_transformers(case, checkpoint, tmp_path):
    """A bfloat16 checkpoint on CPU computes in float32 from bfloat16-stored matrices: the same
    numbers as transformers running the checkpoint upcast to float32."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(checkpoint(case)).to(torch.bfloat16).save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = load_model(tmp_path)
    assert ours.dtype == torch.float32
    assert ours.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    assert ours.model.layers[0].input_layernorm.weight.dtype == torch.float32
    upcast = load_model(tmp_path, weight_dtype="float32")
    assert upcast.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float32
    tokens = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]])
    # Each float32 forward within its error bound of the exact logits of these weights (tests/bounds.py).
    exact = Float64Llama.from_transformers(hf).logits(tokens[0].tolist())
    with torch.no_grad():
        exact.check(hf(tokens).logits[0], "transformers")
        for model in (ours, upcast):
            got = model.logits(model(tokens, torch.zeros(1, dtype=torch.int64), model.new_cache(1, 16)))
            exact.check(got[0], model.model.layers[0].mlp.gate_up_proj.weight.dtype)


def test_weight_dtype_combinations_that_are_not_supported_are_named(checkpoint):
    folder = checkpoint("qwen2-qkv-bias")
    with pytest.raises(ValueError, match="weight_dtype"):
        load_model(folder, dtype="bfloat16", weight_dtype="float32")
    # A float32 checkpoint stays float32 unless asked otherwise.
    assert load_model(folder).model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    narrowed = load_model(folder, weight_dtype="bfloat16")
    assert narrowed.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
