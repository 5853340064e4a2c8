"""Tokenizers of local checkpoint folders (transformers' AutoTokenizer, local files, no remote code)."""
from __future__ import annotations

from pathlib import Path

from .models.loader import is_gguf


class TokenizerMismatchError(ValueError):
    """Target and draft do not share one vocabulary."""


def load_tokenizer(folder: str | Path):
    """The tokenizer of a checkpoint folder, or of a GGUF file's metadata."""
    from transformers import AutoTokenizer

    if is_gguf(folder):
        from .models.gguf import gguf_tokenizer

        return gguf_tokenizer(folder)
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"cannot load a tokenizer from {folder}: {e}") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(path: str | Path) -> bool:
    """Whether a checkpoint carries a tokenizer (a GGUF file always does)."""
    path = Path(path)
    return is_gguf(path) or any((path / name).is_file() for name in TOKENIZER_FILES)


def check_same_vocabulary(target_tok, draft_tok, target_dir, draft_dir):
    """Speculative sampling compares p and q token by token, so both must index one vocabulary."""
    if target_tok.get_vocab() != draft_tok.get_vocab():
        t, d = target_tok.get_vocab(), draft_tok.get_vocab()
        diff = sorted(set(t.items()) ^ set(d.items()), key=lambda kv: kv[1])[:3]
        raise TokenizerMismatchError(
            f"the tokenizers of {target_dir} ({len(t)} tokens) and {draft_dir} ({len(d)} tokens) differ "
            f"(e.g. {diff}); draft and target must share one vocabulary"
        )
    if target_tok.all_special_ids != draft_tok.all_special_ids:
        raise TokenizerMismatchError(
            f"the special tokens of {target_dir} {target_tok.all_special_ids} and {draft_dir} "
            f"{draft_tok.all_special_ids} differ"
        )
