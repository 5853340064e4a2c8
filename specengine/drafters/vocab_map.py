"""Mapping a draft's vocabulary onto its target's, for a draft with a tokenizer of its own.

Terms:
  - a token's *text* is the bytes it stands for. Byte-level BPE spells bytes as printable characters
    (GPT-2's table: 'Ġ' is a space, 'Ċ' a newline); SentencePiece writes a space as '▁' and an
    unprintable byte as '<0xNN>'. Both are read back to bytes, so "Ġthe" and "▁the" are one text.
    An added token (special or not: "<|endoftext|>", "<|im_start|>") is its content, and matches
    only an added token of the other side with the same content: "<s>" the string of three
    characters is not the token "<s>".
  - a *shared* token is a text both vocabularies hold: one target id and one draft id. The draft
    proposes shared tokens only, so every proposal maps to one target id.
  - a target token's *draft form* is the draft ids fed to the draft for it: the shared token's
    draft id, or, for a token the draft lacks, the draft tokenization of its text (computed once
    per token id and kept).
  - the *share* of a pair is the fraction of the target's tokens in a fixed sample text (prose,
    code, a chat turn) that are shared: frequent tokens weigh as often as they occur. A draft can
    never propose an unshared token, so the share bounds its acceptance rate (alpha <= share on
    such text). At alpha = 0.5 a round emits at most 1 / (1 - 0.5) = 2 tokens on average, whatever
    gamma, and each draft step costs time: below a share of MIN_SHARE speculation cannot pay, and
    such a pair is refused with a message naming both models and the share.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import torch

from ..tokenizer import TokenizerMismatchError

MIN_SHARE = 0.5

# A fixed sample for the share: English prose, Python and a chat turn (the texts pairs are run on).
SAMPLE_TEXT = """\
The quick brown fox jumps over the lazy dog. Speculative decoding lets a small model propose a few
tokens that a large model then checks in one pass, so the output is exactly what the large model
would have written, only sooner. Most of the time the small model guesses common words correctly:
articles, punctuation, the ends of words and the closing brackets of code.

Can you explain how a hash table works? A hash table stores values under keys. It computes a hash
of each key to choose a bucket, and keeps the entries of a bucket in a short list, so looking up a
key takes constant time on average. When the table grows too full it doubles its size and moves
every entry to its new bucket.

def fibonacci(n: int) -> int:
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()


if __name__ == "__main__":
    print([fibonacci(i) for i in range(10)])
"""


class VocabularyShareError(TokenizerMismatchError):
    """A draft shares too few of its target's tokens to speed it up."""


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode table, inverted: printable character -> the byte it stands for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return {c: b for b, c in chars.items()}


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def spelling(tokenizer) -> str:
    """How a tokenizer writes its tokens: "byte-level" (GPT-2 bytes), "sentencepiece" ('▁' for a
    space, '<0xNN>' bytes) or "plain" (the token is its text). Read from the fast tokenizer's
    decoder; without one, from the vocabulary's look."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        stack, kinds = [json.loads(backend.to_str()).get("decoder") or {}], set()
        while stack:
            spec = stack.pop()
            if isinstance(spec, dict):
                kinds.add(spec.get("type"))
                if spec.get("type") == "Replace" and (spec.get("pattern") or {}).get("String") == "▁":
                    kinds.add("Metaspace")
                stack += spec.get("decoders") or []
        if "ByteLevel" in kinds:
            return "byte-level"
        if kinds & {"Metaspace", "ByteFallback"}:
            return "sentencepiece"
        if kinds - {None}:
            return "plain"
    vocab = tokenizer.get_vocab()
    if sum(t.startswith("Ġ") for t in vocab) > sum(t.startswith("▁") for t in vocab):
        return "byte-level"
    return "sentencepiece" if any(t.startswith("▁") for t in vocab) else "plain"


def token_text(token: str, how: str) -> bytes:
    """The bytes a (regular, not added) vocabulary entry stands for."""
    if how == "byte-level":
        table = _byte_level_decoder()
        if all(c in table for c in token):
            return bytes(table[c] for c in token)
    elif how == "sentencepiece":
        byte = _BYTE_TOKEN.fullmatch(token)
        if byte:
            return bytes([int(byte.group(1), 16)])
        return token.replace("▁", " ").encode("utf-8")
    return token.encode("utf-8")


Key = bytes | tuple[str, str]  # a regular token's text, or ("added", content)


def token_keys(tokenizer) -> dict[int, Key]:
    """Every id of a tokenizer with the key it is matched by (see the module's terms)."""
    how = spelling(tokenizer)
    added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    keys: dict[int, Key] = {}
    for token, i in tokenizer.get_vocab().items():
        keys[i] = ("added", added[i]) if i in added else token_text(token, how)
    return keys


@dataclass
class VocabMap:
    """Which target ids the draft shares (target_ids[k] is draft_ids[k]) and how an unshared target
    token is written for the draft (spell: its draft ids). target_size and draft_size are the two
    models' logit widths (at least their tokenizers' lengths: a padded head is fine)."""
    target_size: int
    draft_size: int
    target_ids: torch.Tensor          # [S] int64, distinct, in [0, target_size)
    draft_ids: torch.Tensor           # [S] int64, distinct, in [0, draft_size)
    spell: Callable[[int], tuple[int, ...]] = lambda target_id: ()
    share: float | None = None        # measured on SAMPLE_TEXT (from_tokenizers), None otherwise
    _forms: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if self.target_size < 1 or self.draft_size < 1:
            raise ValueError(f"vocabulary sizes must be positive, got {self.target_size}, {self.draft_size}")
        self.target_ids = torch.as_tensor(self.target_ids, dtype=torch.int64).flatten()
        self.draft_ids = torch.as_tensor(self.draft_ids, dtype=torch.int64).flatten()
        S = self.target_ids.numel()
        if S == 0 or self.draft_ids.numel() != S:
            raise ValueError(f"a vocabulary map needs as many draft ids as target ids (at least one), got "
                             f"{S} and {self.draft_ids.numel()}")
        for name, ids, size in (("target", self.target_ids, self.target_size), ("draft", self.draft_ids, self.draft_size)):
            if int(ids.min()) < 0 or int(ids.max()) >= size or ids.unique().numel() != S:
                raise ValueError(f"shared {name} ids must be {S} distinct ids in [0, {size})")
        # Dense tables, built once: target id -> draft id (-1: not shared), for the draft's input.
        self.to_draft = torch.full((self.target_size,), -1, dtype=torch.int64)
        self.to_draft[self.target_ids] = self.draft_ids
        self._to_draft_list = self.to_draft.tolist()

    @property
    def num_shared(self) -> int:
        return self.target_ids.numel()

    def draft_form(self, target_id: int) -> tuple[int, ...]:
        """The draft ids fed to the draft for a target token (kept once computed)."""
        form = self._forms.get(target_id)
        if form is None:
            shared = self._to_draft_list[target_id] if 0 <= target_id < self.target_size else -1
            form = (shared,) if shared >= 0 else tuple(self.spell(target_id))
            if any(not 0 <= d < self.draft_size for d in form):
                raise ValueError(f"the draft form of target id {target_id}, {form}, leaves [0, {self.draft_size})")
            self._forms[target_id] = form
        return form

    @classmethod
    def from_tokenizers(cls, target_tok, draft_tok, target_size: int | None = None,
                        draft_size: int | None = None) -> "VocabMap":
        """The map of two tokenizers: shared tokens matched by text, added tokens by content; the
        lowest id wins where one side holds a text twice."""
        target_size, draft_size = target_size or len(target_tok), draft_size or len(draft_tok)
        # Ids past a model's logits (a tokenizer longer than its model's head) are never shared.
        target_keys = {i: k for i, k in token_keys(target_tok).items() if i < target_size}
        draft_keys = {i: k for i, k in token_keys(draft_tok).items() if i < draft_size}
        draft_by_key: dict[Key, int] = {}
        for i in sorted(draft_keys):
            draft_by_key.setdefault(draft_keys[i], i)
        pairs, used = [], set()
        for i in sorted(target_keys):
            d = draft_by_key.get(target_keys[i])
            if d is not None and d not in used:
                used.add(d)
                pairs.append((i, d))
        if not pairs:
            raise VocabularyShareError("the two tokenizers share no token")
        draft_text = {key: i for key, i in draft_by_key.items() if isinstance(key, bytes)}
        longest = max(len(k) for k in draft_text)

        def spell(target_id: int) -> tuple[int, ...]:
            key = target_keys.get(target_id)
            if key is None:  # an id past the tokenizer (a padded head): no text
                return ()
            text = key[1].encode("utf-8") if isinstance(key, tuple) else key
            # The draft tokenizer's own tokenization when it spells exactly these bytes (a
            # SentencePiece tokenizer may add a leading space; a partial UTF-8 character has no
            # text to encode), else the longest draft tokens from left to right.
            try:
                ids = draft_tok.encode(text.decode("utf-8"), add_special_tokens=False)
                if b"".join(draft_keys[d] if isinstance(draft_keys.get(d), bytes) else b"\0" for d in ids) == text:
                    return tuple(ids)
            except UnicodeDecodeError:
                pass
            out, pos = [], 0
            while pos < len(text):
                for n in range(min(longest, len(text) - pos), 0, -1):
                    d = draft_text.get(text[pos:pos + n])
                    if d is not None:
                        out.append(d)
                        pos += n
                        break
                else:
                    pos += 1  # a byte the draft cannot spell: left out of its context
            return tuple(out)

        target_ids, draft_ids = zip(*pairs)
        vmap = cls(target_size, draft_size, list(target_ids), list(draft_ids), spell)
        sample = target_tok.encode(SAMPLE_TEXT, add_special_tokens=False)
        shared = vmap._to_draft_list
        vmap.share = sum(shared[t] >= 0 for t in sample if t < len(shared)) / max(len(sample), 1)
        return vmap

    def check_share(self, target_name, draft_name, minimum: float = MIN_SHARE):
        """Refuse a pair sharing too little (see the module's terms)."""
        if self.share is not None and self.share < minimum:
            raise VocabularyShareError(
                f"the draft {draft_name} shares too few tokens with the target {target_name}: {self.share:.0%} of "
                f"the target's tokens in a sample text (at least {minimum:.0%} needed: a draft proposes shared "
                f"tokens only; {self.num_shared} ids shared). Use a draft with the target's tokenizer, or "
                f"drafter='ngram' or 'suffix'")
