"""Feeding ragged token chunks through a model and its static cache (and prompts into new rows),
and moving the loop's small host lists to the device."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..layers.kv_cache import StaticKVCache
from ..ops.product import GEMM_MIN_TOKENS_PER_ROW
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


def append_prompts(model: Model, cache: StaticKVCache, prompts: list[list[int]],
                   sources: list[list[int]] | None = None, prefill: bool = True):
    """Append a row per prompt to the cache (reserved by the caller) holding all but its last token.

    Prompts go in one call per group of consecutive prompts of similar length (sort them first):
    a call pads every row to its longest. A group never mixes prompts below GEMM_MIN_TOKENS_PER_ROW
    tokens with longer ones, which take the blocked GEMMs (see ops.product): so a prompt's entries
    are those it gets when prefilled alone, whatever prompts join with it.
    sources: an encoder-decoder model's encoder inputs, one per row, encoded first (grouped by
    their lengths alike) into the rows' cross-attention caches; prompts are then the decoder's.
    prefill=False appends the rows (encoded, with sources) but feeds none of the prompts.
    """
    if sources is not None:  # grouped by the encoder's lengths (a decoder's prompts are its start token)
        cache.reserve_source(max(len(s) for s in sources))
        groups = _similar_lengths([len(s) for s in sources])
    else:
        groups = _similar_lengths([len(p) - 1 for p in prompts])
    for group in groups:
        rows = cache.add_rows(len(group))
        if sources is not None:
            model.encode(rows, [sources[i] for i in group])
        if prefill:
            feed(model, rows, [prompts[i][:-1] for i in group], cached=[0] * len(group))


def prefill_chunks(model: Model, cache: StaticKVCache, rows: list[int], done: list[int], chunks: list[list[int]],
                   whole: list[int], on_hidden: Callable[[int, torch.Tensor], None] | None = None) -> list[list[int]]:
    """Prefill a chunk of each of some staged rows (cache.staged_view): chunks[i] goes into staged
    row rows[i] (ascending), which holds done[i] tokens of a prompt whose prefill is whole[i]
    tokens in all. Returns the calls made, as lists of indices into rows. on_hidden(i, hidden)
    is called with the hidden states [len(chunks[i]), D] of every chunk's positions (for a
    prompt's log-probabilities): the call computed them anyway.

    A row's entries are those of its whole prompt prefilled in one call (steps of a joining
    request are not its results' business): a call's products take the GEMM path by its tokens
    per row (ops.product), and either path computes each row on its own, as attention computes
    each query on its own over the keys before it. So a chunk of a prompt of GEMM_MIN_TOKENS_PER_ROW
    tokens or more is fed in a call of at least GEMM_MIN_TOKENS_PER_ROW tokens per row (padded),
    with other such chunks of consecutive rows and similar lengths; a shorter prompt whole, with
    other short ones alike.
    Each row's length is set from `done` first: a padded bucket of fixed-shape steps may have
    moved a staged row's length (see layers.kv_cache)."""
    calls: list[list[int]] = []
    longest = real = 0
    for i, (chunk, n) in enumerate(zip(chunks, whole)):
        size = len(chunk)
        if calls:
            last = calls[-1]
            grown = max(longest, size)
            if (rows[i] == rows[last[-1]] + 1
                    and (n >= GEMM_MIN_TOKENS_PER_ROW) == (whole[last[0]] >= GEMM_MIN_TOKENS_PER_ROW)
                    and (len(last) + 1) * grown <= real + size + max((real + size) // 4, 64)):
                last.append(i)
                longest, real = grown, real + size
                continue
        calls.append([i])
        longest = real = size
    for call in calls:
        view = cache.staged_view(rows[call[0]], len(call))
        cached = [done[i] for i in call]
        view.lengths.copy_(to_device(cached, torch.int64, model.device))
        hidden = feed(model, view, [chunks[i] for i in call], cached,
                      min_width=GEMM_MIN_TOKENS_PER_ROW if whole[call[0]] >= GEMM_MIN_TOKENS_PER_ROW else 0,
                      all_positions=on_hidden is not None)
        if on_hidden is not None:
            for row, i in enumerate(call):
                on_hidden(i, hidden[row, :len(chunks[i])])
    return calls


def _similar_lengths(lengths: list[int]) -> list[list[int]]:
    """Consecutive groups of indices: each padded to its longest with at most a quarter (or 64
    tokens) of padding over its real tokens, and all on one side of GEMM_MIN_TOKENS_PER_ROW."""
    groups: list[list[int]] = []
    real = longest = 0
    for i, n in enumerate(lengths):
        grown = max(longest, n)
        if (groups
                and (n >= GEMM_MIN_TOKENS_PER_ROW) == (lengths[groups[-1][0]] >= GEMM_MIN_TOKENS_PER_ROW)
                and (len(groups[-1]) + 1) * grown <= real + n + max((real + n) // 4, 64)):
            groups[-1].append(i)
            real, longest = real + n, grown
        else:
            groups.append([i])
            real = longest = n
    return groups
