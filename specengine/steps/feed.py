"""Feeding ragged token chunks through a model and its static cache (and prompts into new rows),
and moving the loop's small host lists to the device."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..layers.kv_cache import StaticKVCache
from ..ops.product import GEMM_MIN_TOKENS_PER_ROW, gemm_sized
from ..models.llama import PartialForward
from ..models.loader import Model


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`. On CUDA it goes through pinned memory with an
    asynchronous copy: a copy from pageable memory would first wait for the whole stream, one
    more synchronisation per round."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def feed(model: Model, cache: StaticKVCache, chunks: list[list[int]],
         cached: list[int] | None = None, min_width: int = 0, all_positions: bool = False) -> torch.Tensor | None:
    """Append chunks[b] to row b of the cache (chunks may differ in length, even be empty).

    Rows are right-padded: the padding writes K/V past the row's length, where it stays
    masked until real tokens overwrite it. Advances cache.lengths by the chunk lengths.
    cached: the cache's lengths as the caller knows them on the host (saves reading them back
    from the device). min_width: pad the call to at least this many tokens per row (a chunk of a
    long prompt takes the GEMM path its whole prefill takes, see prefill_chunks). Returns the
    hidden state of each row's last chunk token [B, D], or None when all are empty;
    all_positions: every position's instead, [B, T, D] (right-padded like the call).
    """
    lengths = [len(c) for c in chunks]
    T = max(lengths, default=0)
    if T == 0:
        return None
    T = max(T, min_width)
    device = model.device
    padded = [chunk + [0] * (T - len(chunk)) for chunk in chunks]
    start = cache.lengths.clone()
    longest = max(cached) if cached is not None else int(start.max())
    hidden = model(to_device(padded, torch.int64, device), start, cache, kv_len=longest + T)
    chunk_lengths = to_device(lengths, torch.int64, device)
    cache.lengths.add_(chunk_lengths)
    if all_positions:
        return hidden
    rows = torch.arange(len(chunks), device=device)
    return hidden[rows, (chunk_lengths - 1).clamp(min=0)]


@dataclass(eq=False)
class PrefillCall:
    """One forward of a prefill: the chunks of consecutive staged rows, padded to one width. It
    may run a few layers at a time (PartialForward), a step's share of a long prompt's chunk."""
    chunks: list[int]        # indices into the step's chunks, one per row
    first_row: int           # the first of its rows (cache.staged_view)
    lengths: list[int]       # real tokens of each row's chunk
    run: PartialForward


def prefill_chunks(model: Model, cache: StaticKVCache, rows: list[int], done: list[int], chunks: list[list[int]],
                   whole: list[int], on_hidden: Callable[[int, torch.Tensor], None] | None = None) -> list[list[int]]:
    """Prefill a chunk of each of some staged rows (cache.staged_view), all layers at once:
    start_prefill then continue_prefill. Returns the calls made, as lists of indices into rows."""
    calls = start_prefill(model, cache, rows, done, chunks, whole)
    continue_prefill(model, cache, calls, on_hidden=on_hidden)
    return [call.chunks for call in calls]


def start_prefill(model: Model, cache: StaticKVCache, rows: list[int], done: list[int], chunks: list[list[int]],
                  whole: list[int]) -> list[PrefillCall]:
    """The calls that prefill a chunk of each of some staged rows: chunks[i] goes into staged row
    rows[i] (ascending), which holds done[i] tokens of a prompt whose prefill is whole[i] tokens
    in all. No layer has run yet (continue_prefill runs them), but each row's length already
    counts its chunk: a cache that grows or moves its rows between the calls' layers copies a
    row's entries up to its length (layers.kv_cache), so the layers run so far are kept.

    A row's entries are those of its whole prompt prefilled in one call (steps of a prefilling
    request are not its results' business): a call's products take the GEMM path by its tokens
    per row (ops.product), and either path computes each row on its own, as attention computes
    each query on its own over the keys before it. So a chunk of a prompt of
    GEMM_MIN_TOKENS_PER_ROW tokens or more is fed in a call of at least that many tokens per row
    (padded), with other such chunks of consecutive rows and similar lengths; a shorter prompt
    whole, with other short ones alike.
    Each row's length is set from `done`: a padded bucket of fixed-shape steps may have moved a
    staged row's length (see layers.kv_cache)."""
    groups: list[list[int]] = []
    longest = real = 0
    for i, (chunk, n) in enumerate(zip(chunks, whole)):
        size = len(chunk)
        if groups:
            last = groups[-1]
            grown = max(longest, size)
            if (rows[i] == rows[last[-1]] + 1
                    and gemm_sized(n) == gemm_sized(whole[last[0]])
                    and (len(last) + 1) * grown <= real + size + max((real + size) // 4, 64)):
                last.append(i)
                longest, real = grown, real + size
                continue
        groups.append([i])
        longest = real = size
    calls = []
    for group in groups:
        lengths = [len(chunks[i]) for i in group]
        gemm = gemm_sized(whole[group[0]])
        width = max(max(lengths), GEMM_MIN_TOKENS_PER_ROW if gemm else 0)
        # Right-padded: the padding writes entries past the row's length, masked until real
        # tokens overwrite them.
        tokens = to_device([chunks[i] + [0] * (width - len(chunks[i])) for i in group], torch.int64, model.device)
        start = to_device([done[i] for i in group], torch.int64, model.device)
        cache.staged_view(rows[group[0]], len(group)).lengths.copy_(
            start + to_device(lengths, torch.int64, model.device))
        run = model.start_forward(tokens, start, kv_len=max(done[i] for i in group) + width)
        calls.append(PrefillCall(group, rows[group[0]], lengths, run))
    return calls


def continue_prefill(model: Model, cache: StaticKVCache, calls: list[PrefillCall], layers: int | None = None,
                     on_hidden: Callable[[int, torch.Tensor], None] | None = None) -> bool:
    """Run the next `layers` decoder layers of each call (None: all it has left); whether every
    call has now run its last. on_hidden(i, hidden) is then called with the hidden states
    [len(chunks[i]), D] of every position of chunk i (for a prompt's log-probabilities): the
    call computed them anyway."""
    finished = True
    for call in calls:
        hidden = model.forward_layers(call.run, cache.staged_view(call.first_row, len(call.chunks)), layers)
        if hidden is None:
            finished = False
        elif on_hidden is not None:
            for row, (i, n) in enumerate(zip(call.chunks, call.lengths)):
                on_hidden(i, hidden[row, :n])
    return finished
