import os
from contextlib import contextmanager

import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. It must be chosen
# before any kernel module is imported (triton.jit reads it when decorating).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# `make test` runs the suite in one pytest worker per core (pytest-xdist): the cores are shared
# out, so that workers' OpenMP threads do not outnumber them (a parallel region whose thread is
# descheduled waits for it). Tests of thread counts set their own.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from specengine.devtools.tiny import make_config, save_random_checkpoint, train_tokenizer  # noqa: E402

# Architectures and the features each exercises; saved with transformers' own save_pretrained.
ARCH_CASES = {
    "llama3-rope-gqa": ("LlamaForCausalLM", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "llama-tied-bias": ("LlamaForCausalLM", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                                                  num_kv_heads=4)),
    "llama-linear-rope": ("LlamaForCausalLM", dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
                                                    num_kv_heads=1)),
    "mistral-sliding": ("MistralForCausalLM", dict(sliding_window=5)),
    "qwen2-qkv-bias": ("Qwen2ForCausalLM", {}),
    "qwen3-qk-norm-tied": ("Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
}


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer(vocab_size=300)


@pytest.fixture(scope="session")
def tiny_pair():
    """engine_util.tiny_pair(): the engine tests' in-memory (target, draft) of 32 tokens. Shared by
    the session: a test must not change the models (a backend, a device), only build engines on them."""
    from engine_util import tiny_pair

    return tiny_pair()


@pytest.fixture(scope="session")
def long_context_target(tmp_path_factory, tokenizer):
    """A tiny target with a context long enough for streams to outlast a shutdown's grace period."""
    folder = tmp_path_factory.mktemp("long") / "target"
    config = make_config(vocab_size=len(tokenizer), hidden_size=64, num_layers=2, max_position_embeddings=8192,
                         eos_token_id=tokenizer.eos_token_id)
    save_random_checkpoint(folder, config, tokenizer, seed=0, init_std=0.3)
    return folder


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(case, dtype) -> folder of a tiny random checkpoint saved in dtype (cached per
    session). A bfloat16 checkpoint loads on a CPU with bfloat16-stored matrices."""
    cache = {}

    def make(case: str, dtype: torch.dtype = torch.float32):
        if (case, dtype) not in cache:
            arch, overrides = ARCH_CASES[case]
            overrides = dict(overrides)
            folder = tmp_path_factory.mktemp(case)
            config = make_config(arch, vocab_size=97, **overrides)
            save_random_checkpoint(folder, config, init_std=0.2, seed=len(cache), dtype=dtype)
            cache[case, dtype] = folder
        return cache[case, dtype]

    return make


@pytest.fixture(scope="session")
def text_pair(tmp_path_factory, tokenizer):
    """A (target, draft) pair of tiny Llama folders sharing a real byte-level BPE tokenizer."""
    folder = tmp_path_factory.mktemp("pair")
    eos = tokenizer.eos_token_id
    target_cfg = make_config(vocab_size=len(tokenizer), hidden_size=64, num_layers=2, eos_token_id=eos)
    draft_cfg = make_config(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                            eos_token_id=eos)
    save_random_checkpoint(folder / "target", target_cfg, tokenizer, seed=0, init_std=0.3)
    save_random_checkpoint(folder / "draft", draft_cfg, tokenizer, seed=1, init_std=0.3)
    return folder / "target", folder / "draft"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def _session_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("specengine-cache")


@pytest.fixture(scope="module")
def session_cache(_session_cache):
    """SPECENGINE_CACHE set, for a module's tests, to one folder of this test session instead of
    the user's cache: the default target is converted there once for all the modules using it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECENGINE_CACHE", str(_session_cache))
        yield _session_cache


# The C++ ops' instruction sets, narrowest first. SPECENGINE_TEST_ISA limits the whole session
# to one of them, as on a CPU without the wider ones (docs/tests.md); the tests that limit it
# further still do, and those of a wider path are skipped.
ISAS = ("portable", "avx2", "avx512", "amx")
SESSION_ISA = os.environ.get("SPECENGINE_TEST_ISA", "amx")
if SESSION_ISA not in ISAS:
    raise pytest.UsageError(f"SPECENGINE_TEST_ISA must be one of {', '.join(ISAS)}, got {SESSION_ISA!r}")


def pytest_configure(config):
    if SESSION_ISA != "amx":
        from specengine import _C

        _C.set_cpu_isa_limit(SESSION_ISA)
        if _C.cpu_isa() != SESSION_ISA:
            raise pytest.UsageError(f"SPECENGINE_TEST_ISA={SESSION_ISA}: this CPU's widest is {_C.cpu_isa()}")


def pytest_report_header(config):
    from specengine import _C

    return f"specengine C++ ops: {_C.cpu_isa()} (SPECENGINE_TEST_ISA={SESSION_ISA})"


@contextmanager
def cpu_isa_limit(isa: str):
    """Run specengine._C's ops with at most this instruction set ('amx', 'avx512', 'avx2',
    'portable'), as on CPUs without the wider ones; a test of a path this CPU lacks, or one wider
    than the session's SPECENGINE_TEST_ISA, is skipped."""
    from specengine import _C

    if ISAS.index(isa) > ISAS.index(SESSION_ISA):
        pytest.skip(f"the session is limited to {SESSION_ISA} (SPECENGINE_TEST_ISA)")
    _C.set_cpu_isa_limit(isa)
    try:
        if _C.cpu_isa() != isa:
            pytest.skip(f"this CPU has no {isa}")
        yield
    finally:
        _C.set_cpu_isa_limit(SESSION_ISA)


@pytest.fixture
def rehearsed_captures(monkeypatch):
    """Where nothing is captured (a CPU), each captured call's first run follows a capture's
    warm-ups and their undoing (CapturedCalls._warm_up, as on a GPU), so that a stateful call whose
    state misses a tensor it updates decodes wrongly here too."""
    from specengine.steps.graphs import CapturedCalls
    real, rehearsed = CapturedCalls.run, set()

    def run(self, key, fn, state=None):
        if not self.use_graphs and (id(self), key) not in rehearsed:
            rehearsed.add((id(self), key))
            CapturedCalls._warm_up(fn, self.entries[key].buffers, state)
        return real(self, key, fn, state)
    monkeypatch.setattr(CapturedCalls, "run", run)


# specengine._C's ops that compute matrix products, alone or inside a whole layer.
CPP_PRODUCTS = ("linear_bf16_weight", "gemm_bf16_weight_amx", "linear_blocks", "gemm_blocks", "decoder_layer",
                "t5_decoder_block")


def forbid_cpp_products(monkeypatch):
    """Make every C++ matrix product fail the test where it runs."""
    from specengine import _C

    def cpp_product(*args, **kwargs):
        raise AssertionError("a C++ matrix product ran")
    for name in CPP_PRODUCTS:
        monkeypatch.setattr(_C, name, cpp_product)


def portable_cpu_kernels(on: bool = True):
    """The portable loops of CPUs without AVX2/FMA (on), or the widest paths this CPU has."""
    from specengine import _C

    return cpu_isa_limit("portable") if on else cpu_isa_limit(_C.cpu_isa())
