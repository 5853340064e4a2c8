"""Feeding ragged token chunks through a model and its static cache, and moving the loop's small
host lists to the device."""
from __future__ import annotations

import torch

from ..layers.kv_cache import StaticKVCache
from ..models.llama import LlamaForCausalLM


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`. On CUDA it goes through pinned memory with an
    asynchronous copy: a copy from pageable memory would first wait for the whole stream, one
    more synchronisation per round."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def feed(model: LlamaForCausalLM, cache: StaticKVCache, chunks: list[list[int]],
         cached: list[int] | None = None) -> torch.Tensor | None:
    """Append chunks[b] to row b of the cache (chunks may differ in length, even be empty).

    Rows are right-padded: the padding writes K/V past the row's length, where it stays
    masked until real tokens overwrite it. Advances cache.lengths by the chunk lengths.
    cached: the cache's lengths as the caller knows them on the host (saves reading them back
    from the device). Returns the hidden state of each row's last chunk token [B, D], or None
    when all are empty.
    """
    lengths = [len(c) for c in chunks]
    T = max(lengths, default=0)
    if T == 0:
        return None
    device = model.device
    padded = [chunk + [0] * (T - len(chunk)) for chunk in chunks]
    start = cache.lengths.clone()
    longest = max(cached) if cached is not None else int(start.max())
    hidden = model(to_device(padded, torch.int64, device), start, cache, kv_len=longest + T)
    chunk_lengths = to_device(lengths, torch.int64, device)
    cache.lengths.add_(chunk_lengths)
    rows = torch.arange(len(chunks), device=device)
    return hidden[rows, (chunk_lengths - 1).clamp(min=0)]
