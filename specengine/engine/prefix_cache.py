"""Prompt prefixes' keys and values, kept for the requests that start the same way.

A chat history, a system prompt, a few-shot preamble or an agent's growing transcript starts
each request with tokens an earlier request prefilled. The cache keeps, per block of BLOCK prompt
tokens, a copy of what each model's KV cache held for them (the target's, and the draft
model's; with a feature drafter, also the target's features there, drafters.eagle3), keyed by a hash chained over the whole prefix up to the block's end: a block matches
only where every token before it matches too. An admitted request looks its prompt's full blocks
up from the first when the scheduler admits it (engine.scheduler); the model runner copies the
blocks found into its staged rows (engine.runner), and only the
rest of its prompt is prefilled.

Exact: a block holds what the prefill computed, and a prefill's entries at a position depend only
on the tokens up to it (steps.feed.prefill_chunks: chunks, and the prompts beside them, do not
change them), so a request given cached blocks gets the entries its own prefill would have
written, bit for bit. Only prefills write blocks: the entries of generated tokens came from
decoding steps, whose products take another path, and are never cached.

Memory: blocks are copies, so running requests share nothing with the cache. It holds at most
`budget` bytes; the least recently used blocks go first. A lookup or an insertion marks a
prefix's blocks used from its last block back to its first, so a prefix loses its tail before
its head (a block whose head is gone can no longer match, and only waits to be evicted).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .prefill_budget import CHUNK

# Tokens per block: a multiple of the prefill's chunk (which is the GEMM threshold,
# ops.product.GEMM_MIN_TOKENS_PER_ROW), so that a request given cached blocks starts its own
# prefill on a chunk edge, as chunked prompts do, its products on the path its whole prefill
# would take; large enough that hashing and copying a block's entries cost little beside
# computing them.
BLOCK = 2 * CHUNK


def block_keys(tokens: list[int]) -> list[bytes]:
    """The chained content hash of each full block of `tokens` (a prefix's first len // BLOCK blocks)."""
    keys, parent = [], b""
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(array("q", tokens[start:start + BLOCK]).tobytes())
        parent = digest.digest()
        keys.append(parent)
    return keys


@dataclass(eq=False)
class Block:
    tokens: tuple[int, ...]                          # its BLOCK tokens (checked on a match)
    kv: list[tuple[torch.Tensor, torch.Tensor]]      # per cache: k, v [layers, BLOCK, kv heads, head_dim]
    nbytes: int
    features: torch.Tensor | None = None  # [BLOCK, F] the target's features, for a feature drafter


class PrefixCache:
    """Blocks of prompt KV by chained content hash, within a byte budget, least recently used out first."""

    def __init__(self, budget: int):
        if budget < 1:
            raise ValueError(f"a prefix cache needs a budget of at least 1 byte, got {budget}")
        self.budget = budget
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self.bytes = 0
        # Counters: prompt tokens looked up and found, blocks stored and evicted.
        self.queried_tokens = self.hit_tokens = self.stored_blocks = self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def match(self, keys: list[bytes], tokens: list[int]) -> list[Block]:
        """The cached blocks of the longest prefix of these blocks (keys from block_keys(tokens)),
        marked used."""
        found = []
        for i, key in enumerate(keys):
            block = self.blocks.get(key)
            if block is None or block.tokens != tuple(tokens[i * BLOCK:(i + 1) * BLOCK]):
                break
            found.append(block)
        self.queried_tokens += len(keys) * BLOCK
        self.hit_tokens += len(found) * BLOCK
        self.touch(keys[:len(found)])
        return found

    def store(self, keys: list[bytes], tokens: list[int], first: int,
              kv: list[tuple[torch.Tensor, torch.Tensor]], features: torch.Tensor | None = None):
        """Keep blocks first, first + 1, ... of a prompt (keys from block_keys(tokens)): kv holds,
        per cache, k and v [layers, n * BLOCK, kv heads, head_dim] of their positions (copied here);
        features [n * BLOCK, F], the target's features there, when a feature drafter reads them
        (drafters.eagle3: kept so that a row starting from the blocks drafts as its prefill would).
        Room is made by evicting other prefixes' blocks, never this one's: what does not fit is
        its tail, which is not kept."""
        n = kv[0][0].shape[1] // BLOCK
        chain = set(keys[:first + n])
        for i in range(n):
            key = keys[first + i]
            if key in self.blocks:
                continue
            parts = [(k[:, i * BLOCK:(i + 1) * BLOCK].clone(), v[:, i * BLOCK:(i + 1) * BLOCK].clone()) for k, v in kv]
            part = features[i * BLOCK:(i + 1) * BLOCK].clone() if features is not None else None
            nbytes = sum(k.nbytes + v.nbytes for k, v in parts) + (part.nbytes if part is not None else 0)
            if not self._evict(self.budget - nbytes, keep=chain):
                break
            self.blocks[key] = Block(tuple(tokens[(first + i) * BLOCK:(first + i + 1) * BLOCK]), parts, nbytes, part)
            self.bytes += nbytes
            self.stored_blocks += 1
        self.touch(keys[:first + n])

    def touch(self, keys: list[bytes]):
        """Mark a prefix's blocks used, its first block last (most recently)."""
        for key in reversed(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def _evict(self, limit: int, keep: set[bytes] = frozenset()) -> bool:
        """Evict the least recently used blocks not in `keep` until at most `limit` bytes are held;
        whether that was possible."""
        while self.bytes > limit:
            key = next((k for k in self.blocks if k not in keep), None)
            if key is None:
                return False
            self.bytes -= self.blocks.pop(key).nbytes
            self.evicted_blocks += 1
        return True

    def clear(self):
        self._evict(0)

    def stats(self) -> dict:
        return dict(blocks=len(self.blocks), bytes=self.bytes, budget=self.budget, block_tokens=BLOCK,
                    queried_tokens=self.queried_tokens, hit_tokens=self.hit_tokens,
                    stored_blocks=self.stored_blocks, evicted_blocks=self.evicted_blocks)


def default_budget(device: torch.device) -> int:
    """The prefix cache's bytes when not given: 512 MiB on a CPU (a tenth of a small server's
    memory; ~11,000 tokens of the default pair), a tenth of a GPU's memory."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 10
    return 512 << 20
