"""Tokenizers of local checkpoint folders (transformers' AutoTokenizer, local files, no remote code)."""
from __future__ import annotations

import os
from pathlib import Path

from .models.loader import is_gguf, return_freed_memory


class TokenizerMismatchError(ValueError):
    """Target and draft do not share one vocabulary."""


def load_tokenizer(folder: str | Path):
    """The tokenizer of a checkpoint folder, or of a GGUF file's metadata."""
    from transformers import AutoTokenizer

    if is_gguf(folder):
        return _cached_gguf_tokenizer(Path(folder))
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"cannot load a tokenizer from {folder}: {e}") from None


def cache_dir() -> Path:
    """Where converted tokenizers live: $SPECENGINE_CACHE, else $XDG_CACHE_HOME/specengine, else
    ~/.cache/specengine."""
    if os.environ.get("SPECENGINE_CACHE"):
        return Path(os.environ["SPECENGINE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specengine"


def _cached_gguf_tokenizer(path: Path):
    """A GGUF file's tokenizer: converted by transformers from the file's metadata once (about 10 s
    for a 49k-token vocabulary), then loaded from the cache folder it was saved to (0.2 s), keyed
    by the file's name, size and modification time."""
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    from .models.gguf import gguf_tokenizer

    stat = path.stat()
    folder = cache_dir() / "tokenizers" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if (folder / "tokenizer_config.json").is_file():
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError):
            pass  # an unreadable cache entry: convert again
        else:
            return_freed_memory()  # loading's garbage
            return tokenizer
    tokenizer = gguf_tokenizer(path)
    return_freed_memory()  # the conversion's garbage
    try:  # the folder appears whole or not at all; a cache that cannot be written is skipped
        folder.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        tokenizer.save_pretrained(str(work))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(work, folder)
    except OSError:
        pass
    return tokenizer


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
