"""The model pair that ships inside the package (trained by recipes/train_pair.py)."""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path

PRETRAINED_DIR = Path(__file__).resolve().parent / "pretrained"
TARGET_DIR = PRETRAINED_DIR / "pycode-target"
DRAFT_DIR = PRETRAINED_DIR / "pycode-draft"


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
