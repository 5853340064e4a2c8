"""Our Llama-family model against transformers' AutoModelForCausalLM on tiny random checkpoints."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from specengine.steps.feed import feed
from specengine.models import load_model
from specengine.models import llama
from specengine.models.llama import Attention
from specengine.ops import attention

from bounds import AMX_TERMS, Float64Llama, assert_within, rope_error
from conftest import ARCH_CASES, cpu_isa_limit, forbid_cpp_products

# Our float32 CPU forward runs specengine._C's fused layer ops: each whole decoder layer in one
# call where the matrices are stored in bfloat16 (a bfloat16 checkpoint), else one call per op.
# The torch ops are the path of every other device and dtype, and the reference of those ops.
# The Triton step kernels (the CUDA path) run here in Triton's interpreter.
# All must match transformers (which computes the bfloat16 checkpoints upcast to float32): each
# float32 forward, transformers' too, within its error bound of the exact logits of the same
# weights (tests/bounds.py), whatever the CPU and instruction-set path.
LAYER_OPS = pytest.mark.parametrize("layer_ops", ["whole-layer", "cpp-ops", "torch-ops", "triton"])
BACKENDS = {"whole-layer": "cpp-layers", "cpp-ops": "cpp-ops", "torch-ops": "torch", "triton": "triton"}


def load(case: str, layer_ops: str, checkpoint, monkeypatch):
    """(transformers' model, ours) on the case's checkpoint; bfloat16 for the whole-layer op."""
    folder = checkpoint(case, torch.bfloat16 if layer_ops == "whole-layer" else torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_model(folder)
    # compiled Triton takes CUDA tensors; test_step_kernels runs them there
    if layer_ops == "triton" and torch.cuda.is_available():
        pytest.skip("the Triton path runs here in the interpreter, on CPU tensors")
    if layer_ops in ("whole-layer", "cpp-ops"):  # the loader's choice on a CPU
        assert ours.backend.name == BACKENDS[layer_ops]
    else:
        ours.use_backend(BACKENDS[layer_ops])
    if layer_ops == "triton":
        def other_attention(*args):
            raise AssertionError("the Triton kernels were not taken")
        monkeypatch.setattr(attention, "cached_attention_reference", other_attention)
        monkeypatch.setattr(attention, "cached_attention_cpp", other_attention)
    if layer_ops == "whole-layer":
        def per_op_path(*args):
            raise AssertionError("the whole-layer op was not taken")
        monkeypatch.setattr(Attention, "forward", per_op_path)
        # at any row count (the model leaves prefill-sized calls to GEMMs, tested below)
        monkeypatch.setattr(llama, "gemm_sized", lambda tokens_per_row: False)
    return hf, ours


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


_EXACT: dict[str, Float64Llama] = {}


def exact_forward(hf) -> Float64Llama:
    """The exact forward of transformers' model's weights (tests/bounds.py), one per checkpoint."""
    folder = hf.config._name_or_path
    if folder not in _EXACT:
        _EXACT[folder] = Float64Llama.from_transformers(hf)
    return _EXACT[folder]


def exact_logits(hf, tokens: list[int], terms: int = 1):
    """The exact logits of transformers' model on tokens and their float32 bound (bounds.Logits),
    transformers' own float32 forward checked against them."""
    exact = exact_forward(hf).logits(tokens, terms)
    exact.check(hf_logits(hf, tokens), "transformers")
    return exact


@pytest.fixture(scope="module")
def sequences():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in (14, 6, 10)]


@LAYER_OPS
@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_prefill_matches_transformers_on_ragged_batch(case, layer_ops, checkpoint, sequences, monkeypatch):
    hf, ours = load(case, layer_ops, checkpoint, monkeypatch)
    B, T = len(sequences), max(map(len, sequences))
    tokens = torch.zeros(B, T, dtype=torch.int64)
    for b, s in enumerate(sequences):
        tokens[b, : len(s)] = torch.tensor(s)
    cache = ours.new_cache(B, 32)
    with torch.no_grad():
        logits = ours.logits(ours(tokens, torch.zeros(B, dtype=torch.int64), cache))
    for b, s in enumerate(sequences):
        exact_logits(hf, s).check(logits[b, : len(s)], f"row {b}")


@pytest.mark.parametrize("isa", ["amx", "avx512"])
@pytest.mark.parametrize("case", ["llama3-rope-gqa", "qwen3-qk-norm-tied"])
def test_a_prefill_of_many_rows_takes_gemms_and_matches_transformers(case, isa, checkpoint, monkeypatch):
    """From GEMM_MIN_TOKENS_PER_ROW rows on, a bfloat16 checkpoint's products are GEMMs (the per-op
    path), not the few-row C++ op: AMX tiles where the CPU has them, else float32 GEMMs on widened
    weights."""
    from specengine.ops import product

    ours = load_model(checkpoint(case, torch.bfloat16))
    calls = {"few-row": 0, "amx": 0, "widened": 0}

    def counted(name, op):
        def run(*args):
            calls[name] += 1
            return op(*args)
        return run
    monkeypatch.setattr(product, "linear_bf16_weight_cpp", counted("few-row", product.linear_bf16_weight_cpp))
    monkeypatch.setattr(product, "gemm_bf16_weight_amx_cpp", counted("amx", product.gemm_bf16_weight_amx_cpp))
    monkeypatch.setattr(product, "gemm_blocks_cpp", counted("widened", product.gemm_blocks_cpp))
    sequence = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = ours.new_cache(1, 48)
    with cpu_isa_limit(isa), torch.no_grad():
        logits = ours.logits(ours(torch.tensor([sequence]), torch.zeros(1, dtype=torch.int64), cache))
    assert calls["few-row"] == 0
    assert (calls["amx"] > 0, calls["widened"] > 0) == (isa == "amx", isa != "amx")
    hf = AutoModelForCausalLM.from_pretrained(checkpoint(case, torch.bfloat16), dtype=torch.float32).eval()
    # AMX tiles sum x in three bfloat16 terms: three times the products' terms (tests/bounds.py).
    exact = exact_forward(hf).logits(sequence, AMX_TERMS if isa == "amx" else 1)
    exact.check(logits[0])
    exact.check(hf_logits(hf, sequence), "transformers")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16-stored"])
@pytest.mark.parametrize("case", ["llama3-rope-gqa", "qwen3-qk-norm-tied"])
def test_the_torch_backend_runs_no_cpp_product(case, dtype, checkpoint, monkeypatch):
    """model.use_backend("torch") on a CPU float32 model (matrices in float32, or kept in bfloat16)
    runs torch's products at every size, prefill and decoding, never a C++ one, and gives
    transformers' float32 logits."""
    folder = checkpoint(case, dtype)
    ours = load_model(folder)
    assert (ours.device.type, ours.dtype, ours.backend.name) == ("cpu", torch.float32, "cpp-layers" if
                                                                 dtype == torch.bfloat16 else "cpp-ops")
    forbid_cpp_products(monkeypatch)
    sequence = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad(), pytest.raises(AssertionError, match="a C\\+\\+ matrix product ran"):
        ours(torch.tensor([sequence]), torch.zeros(1, dtype=torch.int64), ours.new_cache(1, 48))  # the check bites
    ours.use_backend("torch")
    cache = ours.new_cache(1, 48)
    with torch.no_grad():
        prefill = ours.logits(ours(torch.tensor([sequence[:-1]]), torch.zeros(1, dtype=torch.int64), cache))
        cache.lengths.add_(len(sequence) - 1)
        step = ours.logits(ours(torch.tensor([sequence[-1:]]), cache.lengths.clone(), cache))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    exact = exact_logits(hf, sequence)
    exact[:-1].check(prefill[0], "prefill")
    exact[-1].check(step[0, 0], "decoding step")


@LAYER_OPS
@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_step_by_step_decoding_with_rollback_matches_transformers(case, layer_ops, checkpoint, sequences, monkeypatch):
    """Rows of different lengths decode one token, then a 3-token chunk, then roll back and
    re-decode other tokens over the stale cache entries: every logit equals a fresh HF forward."""
    hf, ours = load(case, layer_ops, checkpoint, monkeypatch)
    reference = exact_forward(hf)
    prefixes = [s[:-4] for s in sequences]
    cache = ours.new_cache(len(sequences), 32)
    with torch.no_grad():
        feed(ours, cache, prefixes)
        for step in range(2):  # single-token steps at ragged positions
            tokens = torch.tensor([[s[len(p) + step]] for s, p in zip(sequences, prefixes)])
            logits = ours.logits(ours(tokens, cache.lengths.clone(), cache))
            cache.lengths.add_(1)
            for b, (s, p) in enumerate(zip(sequences, prefixes)):
                n = len(p) + step + 1
                reference.logits(s)[n - 1].check(logits[b, 0], f"row {b}, token {n}")
        # A verify-like chunk of 2 tokens, all rejected: the cache keeps stale entries past each
        # row's length (inside the longest row's attention span); then feed other tokens.
        chunk = torch.tensor([s[len(p) + 2: len(p) + 4] for s, p in zip(sequences, prefixes)])
        ours(chunk, cache.lengths.clone(), cache)
        replacement = (chunk[:, :1] + 7) % 97
        logits = ours.logits(ours(replacement, cache.lengths.clone(), cache))
        for b, (s, p) in enumerate(zip(sequences, prefixes)):
            seq = s[: len(p) + 2] + [int(replacement[b, 0])]
            reference.logits(seq)[-1].check(logits[b, 0], f"row {b} after the rollback")
            reference.logits(seq)[-1].check(hf_logits(hf, seq)[-1], "transformers")


def test_bfloat16_load_runs_close_to_float32(checkpoint, sequences):
    folder = checkpoint("qwen2-qkv-bias")
    fp32, bf16 = load_model(folder), load_model(folder, dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16
    tokens = torch.tensor([sequences[0]])
    with torch.no_grad():
        a = fp32.logits(fp32(tokens, torch.zeros(1, dtype=torch.int64), fp32.new_cache(1, 32)))
        b = bf16.logits(bf16(tokens, torch.zeros(1, dtype=torch.int64), bf16.new_cache(1, 32)))
    assert (a - b).abs().max() < 0.1 * a.abs().max()
    # Rotary frequencies are not rounded to the weights' dtype.
    assert bf16._inv_freq.dtype == torch.float32


def test_sharded_checkpoint_loads_identically(checkpoint, tmp_path, sequences):
    folder = checkpoint("llama3-rope-gqa")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    a, b = load_model(folder), load_model(tmp_path)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


def test_whole_layer_weights_follow_replaced_and_cast_parameters(checkpoint):
    """The model keeps its layers' weights between calls for the whole-layer op: a replaced
    parameter, an in-place change and a cast (also with parameters overwritten on conversion)
    must all be seen by the next forward."""
    folder = checkpoint("llama-tied-bias", torch.bfloat16)
    model, fresh = load_model(folder), load_model(folder)
    tokens = torch.tensor([[5, 17, 3, 44]])

    def logits(m):
        with torch.no_grad():
            return m.logits(m(tokens, torch.zeros(1, dtype=torch.int64), m.new_cache(1, 8)))

    assert model.whole_layer_weights() is not None
    torch.testing.assert_close(logits(model), logits(fresh), atol=0, rtol=0)
    down = model.model.layers[1].mlp.down_proj
    down.weight = torch.nn.Parameter(down.weight * 2)
    fresh.model.layers[1].mlp.down_proj.weight.data.mul_(2)
    torch.testing.assert_close(logits(model), logits(fresh), atol=0, rtol=0)
    model.model.layers[0].self_attn.o_proj.bias.data.add_(1.0)
    assert not torch.equal(logits(model), logits(fresh))
    fresh.model.layers[0].self_attn.o_proj.bias.data.add_(1.0)
    torch.testing.assert_close(logits(model), logits(fresh), atol=0, rtol=0)
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    try:
        torch.__future__.set_overwrite_module_params_on_conversion(True)
        model.to(torch.float32)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
    assert model.whole_layer_weights() is None  # float32 matrices: the per-op path
    assert model.backend.name == "cpp-ops"  # chosen again by the cast
    exact = Float64Llama.from_specengine(fresh).logits(tokens[0].tolist())  # both within the bound of it
    exact.check(logits(model)[0], "cast")
    exact.check(logits(fresh)[0], "whole layers")


def test_the_backend_is_chosen_at_load_and_checked(checkpoint, monkeypatch):
    """The loader's choice on a CPU follows the dtypes; a backend that cannot run the model is
    refused, saying why; a forward with gradients enabled runs the torch ops."""
    folder = checkpoint("qwen2-qkv-bias")
    fp32 = load_model(folder)
    assert fp32.backend.name == "cpp-ops"
    assert load_model(checkpoint("qwen2-qkv-bias", torch.bfloat16)).backend.name == "cpp-layers"
    assert load_model(folder, dtype="bfloat16").backend.name == "torch"
    with pytest.raises(ValueError, match="matrices stored in bfloat16"):
        fp32.use_backend("cpp-layers")
    with pytest.raises(ValueError, match="it runs on"):
        fp32.use_backend("cuda")
    assert fp32.backend.name == "cpp-ops"  # a refused backend changes nothing
    tokens = torch.tensor([[5, 17, 3]])

    def logits():
        return fp32.logits(fp32(tokens, torch.zeros(1, dtype=torch.int64), fp32.new_cache(1, 8)))

    def no_cpp(*args):
        raise AssertionError("a C++ op ran with gradients enabled")
    with monkeypatch.context() as patch, torch.enable_grad():
        patch.setattr(attention, "cached_attention_cpp", no_cpp)
        got = logits()
    fp32.use_backend("torch")
    with torch.no_grad():
        assert torch.equal(got, logits())


@pytest.mark.parametrize("backend", ["cpp-layers", "cpp-ops", "torch", "triton"])
@pytest.mark.parametrize("case", ["qwen3-qk-norm-tied", "mistral-sliding"])
def test_the_models_op_calls_pass_the_ops_checks(case, backend, checkpoint, monkeypatch):
    """The model calls each op's entry point without its checks (check=False); with them on
    (SPECENGINE_CHECK_OPS=1) every call of a prefill and a decode step passes them, same logits."""
    import specengine.ops
    from specengine.ops import decoder_layer

    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("the Triton path runs here in the interpreter, on CPU tensors")
    model = load_model(checkpoint(case, torch.bfloat16 if backend == "cpp-layers" else torch.float32))
    model.use_backend(backend)
    tokens = torch.tensor([[5, 17, 3, 44], [9, 2, 61, 7]])

    def logits():
        cache = model.new_cache(2, 16)
        with torch.no_grad():
            first = model.logits(model(tokens, torch.zeros(2, dtype=torch.int64), cache))
            cache.lengths.add_(4)
            return first, model.logits(model(tokens[:, :1], cache.lengths.clone(), cache))

    want = logits()
    checked = []
    for module, name in ((attention, "_checked_attention"), (decoder_layer, "_checked_layer")):
        def counted(*args, check=getattr(module, name)):
            checked.append(check.__name__)
            return check(*args)
        monkeypatch.setattr(module, name, counted)
    monkeypatch.setattr(specengine.ops, "CHECK_MODEL_CALLS", True)
    got = logits()
    assert set(checked) == {"_checked_layer" if backend == "cpp-layers" else "_checked_attention"}
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_rotary_table_rows_equal_computed_rotary(checkpoint):
    """On a CPU, rope_at reads cos/sin from a table (rope_cos_sin over positions 0..n-1) that
    grows with the limit and follows the model's dtype: every row must equal rope_cos_sin at that
    position, up to the limit and after a cast, and a forward whose padding starts at the
    cache's capacity (CUDA-graph buckets do) must find its positions in the table."""
    from specengine.layers.rotary import rope_cos_sin

    model = load_model(checkpoint("llama3-rope-gqa"))
    for limit in (5, 300, 1000):  # 256 rows, then grown twice
        positions = torch.tensor([[0, 1, limit - 1], [limit // 2, limit - 2, 3]])
        cos, sin = model.rope_at(positions, limit)
        assert model._rope_table[0].shape[0] >= limit
        want_cos, want_sin = rope_cos_sin(model._inv_freq, positions, model.dtype)
        # Two float32 computations of the tables, each within rope_error of the exact one (tests/bounds.py).
        assert_within(cos, want_cos, rope_error(positions))
        assert_within(sin, want_sin, rope_error(positions))
    model.to(torch.bfloat16)
    cos, _ = model.rope_at(torch.tensor([[7]]), 8)
    assert cos.dtype == torch.bfloat16
    assert torch.equal(cos, rope_cos_sin(model._inv_freq, torch.tensor([[7]]), torch.bfloat16)[0])
    fresh = load_model(checkpoint("llama3-rope-gqa"))
    cache = fresh.new_cache(2, 512)  # a table of the capacity's 512 rows would miss 512..514
    # Row 0 holds 4 entries: written (zeros), since a growable cache's memory is not zeroed and the
    # queries read them; row 1: padding at the spill slot.
    cache.pretend_filled(4)
    cache.lengths.copy_(torch.tensor([4, 512]))
    with torch.no_grad():
        hidden = fresh(torch.tensor([[5, 6, 7], [0, 0, 0]]), cache.lengths.clone(), cache, kv_len=512)
    assert hidden.shape[:2] == (2, 3) and torch.isfinite(hidden[0]).all()
