"""The model pair that ships inside the package (trained by recipes/train_pair.py)."""
from __future__ import annotations

from pathlib import Path

PRETRAINED_DIR = Path(__file__).resolve().parent / "pretrained"
TARGET_DIR = PRETRAINED_DIR / "pycode-target"
DRAFT_DIR = PRETRAINED_DIR / "pycode-draft"


def shipped_pair() -> tuple[Path, Path] | None:
    """(target folder, draft folder) when the trained pair is installed, else None."""
    if all((d / "config.json").is_file() for d in (TARGET_DIR, DRAFT_DIR)):
        return TARGET_DIR, DRAFT_DIR
    return None
