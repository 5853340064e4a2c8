"""Tensor parallelism on CPU: two gloo ranks under torchrun (tests/tp_worker.py) against one process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specengine import Engine, SamplingParams
from specengine.layers.parallel import TensorParallel, TensorParallelError
from specengine.models.config import ModelConfig
from specengine.models.llama import LlamaForCausalLM
from specengine.models.loader import load_model

from bounds import Float64Llama, assert_tokens_agree
from server_util import free_port
from tp_cases import GENERATIONS, logit_trace, serve_with_aborts

# Every architecture whose KV heads split in two (llama-linear-rope has one: the error case).
ARCHS = ["llama3-rope-gqa", "llama-tied-bias", "mistral-sliding", "qwen2-qkv-bias", "qwen3-qk-norm-tied"]
SEQUENCES = [[int(t) for t in torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n))]
             for n in (14, 6, 10)]
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
WORLD = 2


def torchrun(args: list[str], timeout: int = 600, **env) -> subprocess.CompletedProcess:
    """Run `args` (a script and its arguments, or -m module ...) on WORLD ranks."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environment.update(OMP_NUM_THREADS="1", **env)
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}",
               f"--master-port={free_port()}", *args]
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def models(checkpoint, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from gguf_util import write_gguf

    folders = {case: str(checkpoint(case)) for case in ARCHS}
    folders["llama3-rope-gqa-bf16"] = str(checkpoint("llama3-rope-gqa", torch.bfloat16))  # bfloat16 matrices
    # A GGUF file: each rank dequantizes a tensor whole, then keeps its slice.
    hf = AutoModelForCausalLM.from_pretrained(checkpoint("qwen2-qkv-bias"))
    path = tmp_path_factory.mktemp("gguf") / "qwen2.gguf"
    write_gguf(path, hf.config, hf.state_dict())
    folders["qwen2-gguf"] = str(path)
    return folders


@pytest.fixture(scope="module")
def ranks(models, text_pair, tmp_path_factory):
    """Each rank's (report, logits) from one torchrun of tp_worker.py, every round checked
    across the ranks (SPECENGINE_CHECK_RANKS)."""
    out = tmp_path_factory.mktemp("tp")
    spec = out / "spec.json"
    spec.write_text(json.dumps(dict(models=models, sequences=SEQUENCES, prompts=PROMPTS,
                                    pair=[str(p) for p in text_pair])))
    done = torchrun([str(Path(__file__).with_name("tp_worker.py")), str(spec), str(out)], SPECENGINE_CHECK_RANKS="1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [(json.loads((out / f"rank{r}.json").read_text()), load_file(out / f"rank{r}.safetensors"))
            for r in range(WORLD)]


def reference(folder) -> Float64Llama:
    """The exact forward of a checkpoint's weights, with float32 bounds (tests/bounds.py)."""
    from transformers import AutoModelForCausalLM

    return Float64Llama.from_transformers(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())


def exact_trace(exact: Float64Llama, sequences: list[list[int]]):
    """logit_trace's logits, exact and bounded: [B, T, V] bounds.Logits of each of its five steps."""
    from bounds import Logits

    prefixes = [s[:-4] for s in sequences]
    width = max(map(len, prefixes))
    rows = [[exact.logits(p + [0] * (width - len(p))) for p in prefixes],  # the padded prefill
            *[[exact.logits(s[:len(p) + step + 1])[-1:] for s, p in zip(sequences, prefixes)] for step in range(2)],
            [exact.logits(s[:len(p) + 4])[-2:] for s, p in zip(sequences, prefixes)],  # the chunk
            [exact.logits(s[:len(p) + 2] + [(s[len(p) + 2] + 7) % exact.lm_head.shape[0]])[-1:]
             for s, p in zip(sequences, prefixes)]]  # the replacement over the rolled-back chunk
    return [Logits(torch.stack([r.exact for r in step]), torch.stack([r.bound for r in step])) for step in rows]


@pytest.mark.parametrize("case", ARCHS + ["llama3-rope-gqa-bf16", "qwen2-gguf"])
def test_split_logits_equal_one_process_and_every_rank_alike(case, models, ranks):
    """Split products sum their parts across the ranks: another order of float32 sums, so the split
    logits and one process's are each within the float32 bound of the exact ones."""
    single = logit_trace(load_model(models[case]), SEQUENCES)
    exact = exact_trace(reference(models["qwen2-qkv-bias" if case == "qwen2-gguf" else case]), SEQUENCES)
    for i, want in enumerate(single):
        got = [logits[f"{case}/{i}"] for _, logits in ranks]
        exact[i].check(want, f"one process, step {i}")
        exact[i].check(got[0], f"two ranks, step {i}")
        assert all(torch.equal(g, got[0]) for g in got[1:]), "the ranks' logits differ"


def test_generations_equal_one_process(text_pair, ranks):
    """The ranks' tokens are one process's: greedy ones up to a near tie of the exact logits,
    seeded ones up to a decision within the float32 bound of its threshold (tests/bounds.py:
    the split sums round otherwise), where they may rightly part."""
    reports = [report["generations"] for report, _ in ranks]
    assert all(r == reports[0] for r in reports[1:]), "the ranks emitted different tokens"
    target, draft = map(reference, text_pair)
    for name, (gamma, params) in GENERATIONS.items():
        engine = Engine.from_pretrained(*text_pair, gamma=gamma)
        single = [r.token_ids for r in engine.generate(PROMPTS, [SamplingParams(**p) for p in params])]
        got = reports[0][name]
        if gamma == "auto":  # each process chose its own gammas: only greedy rows must agree
            single, got = single[:1], got[:1]
        for prompt, p, a, b in zip(PROMPTS, params, got, single):
            assert_tokens_agree(a, b, prompt, SamplingParams(**p), target, draft)


def test_aborts_and_joins_on_a_split_target_equal_one_process(text_pair, ranks):
    """Aborting a row that is not the batch's last, and a waiting request, on every rank alike:
    the other requests' tokens are those of one process."""
    reports = [report["serving"] for report, _ in ranks]
    assert all(r == reports[0] for r in reports[1:]), "the ranks emitted different tokens"
    single = serve_with_aborts(Engine.from_pretrained(*text_pair, gamma=3), PROMPTS)
    assert set(reports[0]) == set(single) == {"r0", "r1", "r2", "late", "dropped"}
    assert single["dropped"] == reports[0]["dropped"] == [] and len(single["late"]) == 10 and len(single["r1"]) == 10
    # serve_with_aborts' requests: r<i> with seed 11 + i, then "late" (prompt 0, seed 11 + len(PROMPTS))
    target, draft = map(reference, text_pair)
    requests = {f"r{i}": (prompt, 11 + i) for i, prompt in enumerate(PROMPTS)}
    requests["late"] = (PROMPTS[0], 11 + len(PROMPTS))
    for request_id, (prompt, seed) in requests.items():
        params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=seed)
        assert_tokens_agree(reports[0][request_id], single[request_id], prompt, params, target, draft)


@pytest.mark.parametrize("case", ARCHS)
def test_each_rank_holds_its_share_of_the_parameters(case, models, ranks):
    """The ranks' bytes add up to the model's, plus the replicated parts once more per extra
    rank (norms, row-parallel biases) and the vocabulary's padding rows."""
    model = load_model(models[case])
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    replicated = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                     if "norm" in name or name.endswith(("o_proj.bias", "down_proj.bias")))
    c = model.config
    heads = 1 if c.tie_word_embeddings else 2  # a tied head is the embedding
    padding = (-c.vocab_size % WORLD) * c.hidden_size * model.lm_head.weight.element_size() * heads
    held = [report["parameter_bytes"][case] for report, _ in ranks]
    assert sum(held) == total + (WORLD - 1) * replicated + padding
    assert max(held) <= total / WORLD + replicated + padding


def test_heads_that_do_not_split_are_named():
    cfg = ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=64,
                                     intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=1))
    with pytest.raises(TensorParallelError, match=r"num_key_value_heads \(1\) is not divisible by tensor_parallel=2"):
        LlamaForCausalLM(cfg, TensorParallel(0, 2))
    with pytest.raises(TensorParallelError, match=r"intermediate_size \(128\) is not divisible by tensor_parallel=3"):
        LlamaForCausalLM(ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=64,
                                                    intermediate_size=128, num_hidden_layers=1,
                                                    num_attention_heads=6, num_key_value_heads=3)),
                         TensorParallel(1, 3))


def test_tensor_parallel_outside_torchrun_says_how_to_run(text_pair, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(TensorParallelError, match="torchrun --nproc-per-node 2"):
        Engine.from_pretrained(*text_pair, tensor_parallel=2)
    with pytest.raises(ValueError, match="tensor_parallel must be a positive integer"):
        Engine.from_pretrained(*text_pair, tensor_parallel=0)


def test_cli_generate_on_two_ranks_prints_once_what_one_process_prints(text_pair):
    target, draft = map(str, text_pair)
    args = ["generate", "--target", target, "--draft", draft, "--prompt", "def f(x):", "--max-new-tokens", "12",
            "--temperature", "0", "--gamma", "3"]
    single = subprocess.run([sys.executable, "-m", "specengine", *args], capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr
    split = torchrun(["-m", "specengine", *args, "--tensor-parallel", str(WORLD)], timeout=300)
    assert split.returncode == 0, split.stderr[-4000:]
    assert split.stdout == single.stdout and single.stdout.strip()
    assert split.stderr.count("[specengine]") == 1  # rank 0's statistics line only
