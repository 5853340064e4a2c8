"""Text the models were trained and measured on: the running interpreter's standard library,
split by file into a training side and a held-out side, and the chat prompts built from it.

Every recipe uses this one split (about 1 file in 16 held out), so prompts built from the
held-out side are text no shipped model trained on.
"""
from __future__ import annotations

import ast
import hashlib
import random
import sysconfig
from pathlib import Path

CHAT_KINDS = ("write", "write", "explain", "test", "improve", "code")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    return sorted(p for p in stdlib_root().rglob("*.py") if "site-packages" not in p.parts)


def is_held_out(path: Path) -> bool:
    """Deterministic split by file: about 1 file in 16 (6%) is held out."""
    rel = path.relative_to(stdlib_root()).as_posix()
    return hashlib.sha256(rel.encode()).digest()[0] % 16 == 0


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def documented_functions(text: str):
    """(name, docstring's first paragraph, source) of a module's public documented functions."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    lines = text.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            source = "\n".join(lines[node.lineno - 1: node.end_lineno])
            if doc and 20 <= len(doc) and len(source) < 2500:
                yield node.name, doc.split("\n\n")[0].replace("\n", " "), source


def code_prompts(held_out: bool, seed: int = 0, per_file: int = 8) -> list[dict]:
    """Requests about the functions of one side of the split, a few per file, shuffled: chat
    messages ({"kind", "chat": [{"role": "user", "content"}]}) asking to write, explain, test or
    improve a function, and raw code prefixes ({"kind": "code", "text"}) to continue."""
    rng = random.Random(seed)
    prompts = []
    for path in stdlib_files():
        if is_held_out(path) != held_out:
            continue
        funcs = list(documented_functions(read(path)))
        rng.shuffle(funcs)
        for name, doc, source in funcs[:per_file]:
            kind = rng.choice(CHAT_KINDS)
            if kind == "code":
                head = source.splitlines()
                prompts.append(dict(kind=kind, text="\n".join(head[: max(2, len(head) // 3)]) + "\n"))
                continue
            message = {
                "write": f"Write a Python function `{name}` that does the following: {doc}",
                "explain": f"Explain what this Python function does:\n\n```python\n{source}\n```",
                "test": f"Write unit tests for this Python function:\n\n```python\n{source}\n```",
                "improve": f"How could this Python code be improved?\n\n```python\n{source}\n```",
            }[kind]
            prompts.append(dict(kind=kind, chat=[{"role": "user", "content": message}]))
    rng.shuffle(prompts)
    return prompts


def encode_prompt(tokenizer, prompt: dict) -> list[int]:
    """Token ids of a code_prompts entry: chat through the tokenizer's template, code as it is."""
    if "chat" in prompt:
        return list(tokenizer.apply_chat_template(prompt["chat"], add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return tokenizer(prompt["text"])["input_ids"]


def heldout_chat_prompts(tokenizer, count: int, max_tokens: int = 384, seed: int = 0) -> list[list[int]]:
    """`count` held-out prompts as token ids (at most max_tokens each), in a fixed order."""
    out = []
    for p in code_prompts(held_out=True, seed=seed):
        ids = encode_prompt(tokenizer, p)
        if 4 <= len(ids) <= max_tokens:
            out.append(ids)
        if len(out) == count:
            return out
    raise ValueError(f"only {len(out)} held-out prompts of at most {max_tokens} tokens, not {count}")
