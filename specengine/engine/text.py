"""The text side of requests: prompts that must be UTF-8, and how much of a growing output is final."""
from __future__ import annotations

from collections.abc import Sequence


def utf8_text(text: str | bytes | bytearray) -> str:
    """Text that is valid UTF-8, as a str, or a ValueError saying where it is not."""
    if isinstance(text, (bytes, bytearray)):
        try:
            return text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"prompt is not valid UTF-8: byte {e.start} ({text[e.start:e.start + 1]!r})") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates, e.g. undecodable bytes from argv
        raise ValueError(f"prompt is not valid UTF-8: character {e.start} is {text[e.start]!r}, not text") from None
    return text


def settled_length(text: str, stop: Sequence[str]) -> int:
    """How much of a running request's text is final: all but an unfinished UTF-8 sequence (the
    tokenizer's U+FFFD) and a tail that could still grow into a stop string."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    # The longest tail of text that is a proper prefix of a stop string.
    held = max((k for s in stop for k in range(min(len(s) - 1, end), 0, -1) if text.endswith(s[:k], 0, end)),
               default=0)
    return end - held
