"""GGUF files: the four architectures and every tensor type the gguf package dequantizes, against
transformers (the original model for float files, transformers' own GGUF load for quantized
ones), with matrices kept as stored on every CPU backend and dequantized on request; conversion
to a folder, and bad files."""
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specengine.layers.blocks import BlockEmbedding, BlockLinear, TiedBlockHead
from specengine.models import CheckpointError, load_model
from specengine.models.gguf import GGUFError, convert_gguf
from specengine.devtools.tiny import make_config

from bounds import Float64Llama, assert_greedy_tokens_agree, assert_within, rope_error
from conftest import forbid_cpp_products
from gguf_util import write_gguf

ARCHS = {
    "llama": ("LlamaForCausalLM", dict(num_kv_heads=2)),
    "llama-tied": ("LlamaForCausalLM", dict(num_kv_heads=1, tie_word_embeddings=True)),
    "mistral": ("MistralForCausalLM", dict(sliding_window=6)),
    "qwen2": ("Qwen2ForCausalLM", {}),
    # head_dim 128, as in every Qwen3 release: transformers' GGUF load assumes it.
    "qwen3": ("Qwen3ForCausalLM", dict(tie_word_embeddings=True, num_heads=2, num_kv_heads=1)),
}
# Every type the gguf package dequantizes that llama.cpp uses for weights, spread over the matrices.
TYPE_SETS = {
    "legacy": {"q_proj": "Q8_0", "k_proj": "Q4_0", "v_proj": "Q4_1", "o_proj": "Q5_0", "gate_proj": "Q5_1",
               "up_proj": "F16", "down_proj": "BF16", "embed_tokens": "Q8_0", "lm_head": "Q4_1"},
    "k-quants": {"q_proj": "Q2_K", "k_proj": "Q3_K", "v_proj": "Q4_K", "o_proj": "Q5_K", "gate_proj": "Q6_K",
                 "up_proj": "Q4_K", "down_proj": "Q6_K", "embed_tokens": "Q6_K", "lm_head": "Q5_K"},
}
TOKENS = [[3, 17, 250, 9, 9, 42, 101, 7, 0, 299, 5, 64]]


def tiny_hf(case: str, seed: int = 0, **changes):
    arch, overrides = ARCHS[case]
    # Rows of 256: the K-quants' block length.
    cfg = make_config(arch, **{"vocab_size": 300, "hidden_size": 256, "num_layers": 2, "intermediate_size": 512,
                               "num_heads": 4, "num_kv_heads": 2, **overrides, **changes})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    return model


def exact_logits(hf, tokens=TOKENS):
    """The exact logits [T, V] of transformers' model on one token sequence and their float32 bound
    (tests/bounds.py), transformers' own float32 forward checked against them."""
    exact = Float64Llama.from_transformers(hf).logits(tokens[0])
    with torch.no_grad():
        exact.check(hf(torch.tensor(tokens)).logits[0], "transformers")
    return exact


def our_logits(model, tokens=TOKENS) -> torch.Tensor:
    ids = torch.tensor(tokens)
    cache = model.new_cache(len(tokens), 64)
    with torch.inference_mode():
        return model.logits(model(ids, torch.zeros(len(tokens), dtype=torch.long), cache))


@pytest.mark.parametrize("case", ARCHS)
def test_float_gguf_runs_the_original_model(case, tmp_path):
    """llama.cpp's names, its q/k row order and the metadata map back onto the original model,
    with the F32 matrices kept as stored (the default) and copied into dense ones."""
    hf = tiny_hf(case)
    path = tmp_path / "m.gguf"
    write_gguf(path, hf.config, hf.state_dict(), name=f"{case}-tiny")
    exact = exact_logits(hf)
    for weight_dtype in (None, "float32"):
        ours = load_model(path, weight_dtype=weight_dtype)
        assert ours.stored_matrices == (weight_dtype is None)
        assert ours.config.architecture == hf.config.architectures[0]
        assert ours.config.tie_word_embeddings == bool(hf.config.tie_word_embeddings)
        exact.check(our_logits(ours)[0], weight_dtype)


BACKENDS = ["torch", "cpp-ops", "cpp-layers"]


@pytest.mark.parametrize("types", TYPE_SETS)
@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_quantized_gguf_equals_transformers_gguf_load(case, types, tmp_path, monkeypatch):
    """The file's own model: matrices kept as stored give transformers' float32 load of the file on
    every CPU backend, to float32 summation error (the torch backend with no C++ product), and so
    does the dequantized copy."""
    hf = tiny_hf(case, seed=1)
    path = tmp_path / "q.gguf"
    write_gguf(path, hf.config, hf.state_dict(), TYPE_SETS[types], name=f"{case}-tiny")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    exact = exact_logits(theirs)
    assert exact.exact.abs().max() > 0.1  # the random blocks gave a model that says something
    ours = load_model(path)
    assert ours.backend.name == "cpp-layers"  # the default on a CPU
    # Random K-quant codes make large weights (logits in the hundreds); float32 sums in another
    # order differ from the exact ones by what the bound of tests/bounds.py allows, on any CPU.
    for backend in BACKENDS:
        ours.use_backend(backend)
        with monkeypatch.context() as patches:
            if backend == "torch":
                forbid_cpp_products(patches)
            exact.check(our_logits(ours)[0], backend)
    exact.check(our_logits(load_model(path, weight_dtype="float32"))[0], "dequantized")


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    """llama.cpp keeps Llama 3.1's rope scaling as a rope_freqs tensor of divisors, not metadata."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = tiny_hf("llama", rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config)
    dim = hf.config.head_dim
    plain = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    divisors = (plain / scaled.double()).numpy()
    assert divisors.max() > 7.9  # the scaling reaches this model's frequencies
    write_gguf(tmp_path / "l3.gguf", hf.config, hf.state_dict(), rope_freqs=divisors)
    ours = load_model(tmp_path / "l3.gguf", weight_dtype="float32")
    assert ours.config.rope.rope_type == "llama3" and ours.config.rope.factor == 8.0
    exact_logits(hf).check(our_logits(ours)[0])
    # Far positions, where the scaled frequencies have turned: the rotary tables equal transformers'.
    positions = torch.arange(6000, 6016)[None]
    cos, sin = ours.rope_at(positions, 6016)
    ref_cos, ref_sin = hf.model.rotary_emb(torch.zeros(1, 16, dim), positions)
    # Two float32 tables, each within rope_error of the exact one (tests/bounds.py).
    assert_within(cos, ref_cos, rope_error(positions))
    assert_within(sin, ref_sin, rope_error(positions))
    wrong = divisors.copy()
    wrong[-1] *= 1.5
    write_gguf(tmp_path / "bad.gguf", hf.config, hf.state_dict(), rope_freqs=wrong)
    with pytest.raises(GGUFError, match="rope_freqs tensor matches no llama3 rope scaling"):
        load_model(tmp_path / "bad.gguf")


def test_gguf_matrices_are_kept_as_stored_unless_a_weight_dtype_is_asked(tmp_path, caplog):
    """Each matrix keeps its file type (q, k and v, gate and up, as parts of one packed matrix);
    the few types without kernels here run dequantized to float32, each named once in the log;
    a weight_dtype dequantizes everything into dense matrices of that dtype."""
    import logging

    hf = tiny_hf("llama")
    write_gguf(tmp_path / "m.gguf", hf.config, hf.state_dict(), TYPE_SETS["legacy"])
    model = load_model(tmp_path / "m.gguf")
    layer = model.model.layers[0]
    assert [t.name for t in layer.self_attn.qkv_proj.weight_types] == ["Q8_0", "Q4_0", "Q4_1"]
    assert [t.name for t in layer.mlp.gate_up_proj.weight_types] == ["Q5_1", "F16"]
    assert [t.name for t in layer.mlp.down_proj.weight_types] == ["BF16"]
    assert isinstance(model.model.embed_tokens, BlockEmbedding) and isinstance(model.lm_head, BlockLinear)
    assert model.dtype == torch.float32 and not any(p.dim() > 1 for p in model.parameters())
    dense = load_model(tmp_path / "m.gguf", weight_dtype="bfloat16")
    assert dense.lm_head.weight.dtype == torch.bfloat16 and dense.dtype == torch.float32

    hf = tiny_hf("llama-tied")
    write_gguf(tmp_path / "k.gguf", hf.config, hf.state_dict(), TYPE_SETS["k-quants"])
    with caplog.at_level(logging.INFO, logger="specengine"):
        model = load_model(tmp_path / "k.gguf")
    assert isinstance(model.lm_head, TiedBlockHead) and model.lm_head.matrix is model.model.embed_tokens.matrix
    assert [t.name for t in model.model.layers[1].self_attn.qkv_proj.weight_types] == ["F32", "F32", "Q4_K"]
    lines = [r.getMessage() for r in caplog.records if "runs dequantized to float32" in r.getMessage()]
    assert len(lines) == 4 and any("blk.0.attn_q.weight is Q2_K" in line for line in lines)
    assert any("blk.1.attn_k.weight is Q3_K" in line for line in lines)


# ---- the real file the default pair's target comes from -------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    from specengine.shipped import smollm2_gguf

    return smollm2_gguf()


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_off_the_cpu_a_run_of_parts_of_one_type_is_one_part(device):
    """Loaded onto a GPU (meta, without one: the same copy off the CPU), a packed matrix holds each
    run of consecutive parts of one type as one part (layers.blocks: one launch of the Triton
    kernels): llama.cpp's Q4_K_M file has q, k, v and gate, up in Q4_K (one part each), but layer
    1's v in Q6_K (two parts). On the CPU the file's parts stay as they are."""
    from gguf_util import gguf_file

    path = gguf_file("tiny-llama.Q4_K_M.gguf")
    cpu, moved = load_model(path), load_model(path, device=device)

    def parts(model, name: str) -> list[list[str]]:
        """Each layer's parts of projection `name`, by type."""
        return [[t.name for t in m.weight_types] for n, m in model.named_modules() if n.endswith(name)]

    assert parts(cpu, "qkv_proj") == [["Q4_K", "Q4_K", "Q4_K"], ["Q4_K", "Q4_K", "Q6_K"]]
    assert parts(cpu, "gate_up_proj") == [["Q4_K", "Q4_K"]] * 2
    assert parts(moved, "qkv_proj") == [["Q4_K"], ["Q4_K", "Q6_K"]]
    assert parts(moved, "gate_up_proj") == [["Q4_K"]] * 2
    assert parts(moved, "down_proj") == parts(cpu, "down_proj") == [["Q4_K"], ["Q6_K"]]
    for stored, merged in zip(cpu.model.layers, moved.model.layers):
        assert merged.self_attn.qkv_proj.matrix.shape == stored.self_attn.qkv_proj.matrix.shape
        assert merged.self_attn.qkv_proj.part_0.device.type == device
    if device == "cuda":  # the rows, stacked
        for name in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
            want = torch.cat([p.data for p in cpu.get_submodule(f"model.layers.1.{name}").matrix.parts[:2]])
            assert torch.equal(moved.get_submodule(f"model.layers.1.{name}").part_0.cpu(), want)


def test_smollm2_gguf_logits_and_greedy_tokens_equal_transformers(smollm2):
    from specengine import Engine, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32).eval()
    ours = load_model(smollm2)
    assert ours.stored_matrices and ours.backend.name == "cpp-layers"
    ids = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407]]
    # Float32 sums in another order (the C++ ops; the torch path's ops are transformers'): within
    # the float32 bound of the exact logits, as transformers' own forward is.
    reference = Float64Llama.from_transformers(hf)
    exact = exact_logits(hf, ids)
    for backend in BACKENDS:
        ours.use_backend(backend)
        exact.check(our_logits(ours, ids)[0], backend)

    engine = Engine.from_pretrained(smollm2)
    messages = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
    prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    (result,) = engine.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True))
    with torch.no_grad():
        prompt_ids = torch.tensor([result.prompt_token_ids])
        expected = hf.generate(prompt_ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, prompt_ids.shape[1]:]
    # token for token up to a near tie of the exact logits, if there is one (tests/bounds.py)
    assert_greedy_tokens_agree(result.token_ids, expected.tolist(), reference, result.prompt_token_ids, 12)
    assert "def" in result.text


def test_convert_writes_a_folder_that_loads_as_the_gguf_does(smollm2, tmp_path):
    out = convert_gguf(smollm2, tmp_path / "smol", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] == 3
    assert cfg["tie_word_embeddings"] and cfg["rope_theta"] == 100000.0 and cfg["dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        assert "lm_head.weight" not in f.keys()
    ids = [[1, 9690, 198, 2683, 359, 253]]
    # The folder holds the file's matrices rounded to bfloat16, as the file dequantized into bfloat16 does.
    torch.testing.assert_close(our_logits(load_model(out), ids), our_logits(load_model(smollm2, weight_dtype="bfloat16"),
                                                                          ids), atol=0, rtol=0)
    from specengine.tokenizer import load_tokenizer

    tok = load_tokenizer(out)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|im_end|>" and len(tok) == 49152
    with pytest.raises(FileExistsError, match="not empty"):
        convert_gguf(smollm2, out, progress=False)


def test_convert_cli(smollm2, tmp_path, capsys):
    from specengine.cli import main

    assert main(["convert", str(smollm2), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert main(["convert", str(tmp_path / "missing.gguf"), str(tmp_path / "out2")]) == 2
    assert "missing.gguf does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out2").exists()
    # generate straight from the file dequantized into bfloat16, and from the folder it became:
    # the same greedy tokens
    runs = []
    for target in (smollm2, tmp_path / "out"):
        assert main(["generate", "--target", str(target), "--prompt", "def add(a, b):", "--temperature", "0",
                     "--max-new-tokens", "6", "--json", "--weight-dtype", "bfloat16"]) == 0
        runs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert runs[0] == runs[1] and len(runs[0]) == 6


# ---- bad files ---------------------------------------------------------------------------------

@pytest.fixture
def tiny_gguf(tmp_path):
    hf = tiny_hf("llama")
    path = tmp_path / "m.gguf"
    write_gguf(path, hf.config, hf.state_dict(), TYPE_SETS["legacy"])
    return path, hf


@pytest.mark.parametrize("keep", [40, 3000, -200])
def test_truncated_gguf_names_the_file(tiny_gguf, tmp_path, keep):
    path, _ = tiny_gguf
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep] if keep > 0 else data[:keep])
    with pytest.raises(GGUFError, match=r"cut.gguf (is not a readable GGUF file|is truncated)"):
        load_model(cut)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_text("hello, not a model")
    with pytest.raises(GGUFError, match="x.gguf is not a readable GGUF file"):
        load_model(path)
    with pytest.raises(FileNotFoundError, match="nope.gguf does not exist"):
        load_model(tmp_path / "nope.gguf")


def test_unsupported_gguf_architecture(tmp_path):
    hf = tiny_hf("llama")
    write_gguf(tmp_path / "g.gguf", hf.config, hf.state_dict(), architecture="gpt2")
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3"):
        load_model(tmp_path / "g.gguf")


def test_unsupported_gguf_tensor_type(tmp_path):
    import gguf

    hf = tiny_hf("llama")
    path = tmp_path / "t.gguf"
    write_gguf(path, hf.config, hf.state_dict())
    # Q8_K (llama.cpp's activation type) has no dequantization in the gguf package: relabel one
    # matrix's bytes as Q8_K blocks of the same size.
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K]
    rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
    writer = gguf.GGUFWriter(str(tmp_path / "t2.gguf"), "llama")
    for field in reader.fields.values():
        if field.name.startswith("llama.") or field.name == "general.name":
            writer.add_key_value(field.name, field.contents(), field.types[0])
    for t in reader.tensors:
        if t is tensor:
            data = np.zeros((rows, cols // block * size), dtype=np.uint8)
            writer.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType.Q8_K)
        else:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="blk.0.ffn_up.weight has type Q8_K, which neither this engine nor the gguf "
                                        "package can dequantize"):
        load_model(tmp_path / "t2.gguf")


def test_truncated_safetensors_names_the_file(checkpoint, tmp_path):
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint("llama3-rope-gqa"), folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model.safetensors is not a readable safetensors file"):
        load_model(folder)
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(CheckpointError, match=r"model.safetensors is not a readable safetensors file"):
        load_model(folder)


@pytest.mark.parametrize("types", TYPE_SETS)
def test_speculation_on_a_quantized_gguf_target_is_its_greedy_decoding(types, tmp_path):
    """Greedy speculative decoding of a quantized file (drafted by a smaller quantized file, and by
    n-grams) gives the tokens of target-only decoding and of transformers' generate on the file."""
    from specengine import Engine, SamplingParams
    from specengine.drafters.model import ModelDrafter
    from specengine.drafters.ngram import NgramDrafter

    hf = tiny_hf("llama", seed=2)
    write_gguf(tmp_path / "t.gguf", hf.config, hf.state_dict(), TYPE_SETS[types])
    # The draft: the target's own weights in Q8_0, so that many of its drafts are accepted.
    write_gguf(tmp_path / "d.gguf", hf.config, hf.state_dict(), {"": "Q8_0"})
    target, draft = load_model(tmp_path / "t.gguf"), load_model(tmp_path / "d.gguf")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="t.gguf", dtype=torch.float32).eval()
    theirs.generation_config.eos_token_id = None  # decode through end-of-text, as ignore_eos does
    prompts = [TOKENS[0], TOKENS[0][:5] * 3]
    params = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    base = [r.token_ids for r in Engine(target).generate(prompts, params)]
    reference = Float64Llama.from_transformers(theirs)
    with torch.no_grad():
        for prompt, tokens in zip(prompts, base):
            expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):]
            assert_greedy_tokens_agree(tokens, expected.tolist(), reference, prompt, 5)
    V = target.config.vocab_size
    for drafter in (ModelDrafter(draft, V, V), NgramDrafter()):
        engine = Engine(target, drafter=drafter, gamma=3)
        assert [r.token_ids for r in engine.generate(prompts, params)] == base
        if isinstance(drafter, ModelDrafter):  # its drafts were really tested, and some passed
            assert engine.last_run_stats.accepted > 0


# ---- files llama.cpp's quantizer wrote (tests/data/gguf) ------------------------------------

def _committed_files():
    from gguf_util import GGUF_FILES_DIR

    return sorted(p.name for p in GGUF_FILES_DIR.glob("*.gguf"))


@pytest.mark.parametrize("name", _committed_files())
def test_llama_cpp_quantized_files_run_as_stored(name):
    """Every weight type as llama.cpp's own quantizer writes it: each matrix kept in its file type,
    logits equal to transformers' float32 load of the file on every CPU backend, and greedy tokens
    equal to its generate (speculation drafted by n-grams included)."""
    from specengine import Engine, SamplingParams
    from specengine.drafters.ngram import NgramDrafter
    from gguf_util import gguf_file, tensor_types
    from specengine.tokenizer import load_tokenizer

    path = gguf_file(name)
    ours = load_model(path)
    stored = {t.name for m in ours.modules() for t in getattr(m, "weight_types", ())}
    assert stored == {t for n, t in tensor_types(path).items() if not n.endswith("norm.weight")}
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=name, dtype=torch.float32).eval()
    theirs.generation_config.eos_token_id = None
    ids = load_tokenizer(path)("def add(a, b):\n    return a + b")["input_ids"]
    reference = Float64Llama.from_transformers(theirs)
    exact = exact_logits(theirs, [ids])
    for backend in BACKENDS:
        ours.use_backend(backend)
        exact.check(our_logits(ours, [ids])[0], backend)
    ours.use_backend()
    with torch.no_grad():
        expected = theirs.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    runs = [Engine(ours, drafter=drafter, gamma=3).generate([ids], params)[0].token_ids
            for drafter in (None, NgramDrafter())]
    assert runs[1] == runs[0]  # speculation: our own arithmetic, bit for bit
    assert_greedy_tokens_agree(runs[0], expected, reference, ids, 3)
