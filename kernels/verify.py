"""Fused verify step in Triton, spread over (logit row, vocabulary tile).

Same contract as specengine.sampling.verify.verify_reference (its oracle) and the C++ op. A
round's logits are B * (G + 1) target rows and B * G draft rows ("logit rows" r: the target's
(b, i) at r = b * (G + 1) + i, the draft's at B * (G + 1) + b * G + i), each cut into tiles of
TILE entries. The launches, every grid fixed by (B, G, V):

  _stats_kernel       (rows, tiles)  tile max, first argmax and sum of exp((x - max) / t): the
                                     temperature-only warp in one read of every logit; the
                                     first top-k histogram in the same read
  _top_k_kernel       (rows, tiles)  } with top-k, top-p or min-p only: the thresholds by radix
  _top_p_first_kernel (rows, tiles)  } select on the logits' bits, 8 bits per pass, each pass a
  _top_p_kernel       (rows, tiles)  } histogram per tile that the next pass's programs sum
  _floor_kernel       (rows, tiles)  } (a small combine); then the normaliser after the floor
  _decide_kernel      (B, tiles)     the accept tests, from p(x_i) and q(x_i) alone; each tile's
                                     mass of the residual or bonus distribution at the row's
                                     deciding position
  _sample_kernel      (B,)           the tile holding u * total, then one scan inside it

Every threshold is a logit value: the top-k cut is the k-th largest logit (the scaled logits
keep its order) and the top-p floor the probability of the smallest kept logit, so the radix
select runs on an order-preserving key of the float's bits, ahead of knowing the row's max.
Programs that need a row-wide value each recompute it from the per-tile partials in the same
order, so they agree bit for bit. Per-round integers (G, V, strides, the pass) are runtime
arguments: a new round never recompiles.
Host side: specengine.ops.verify validates; verify_triton only allocates and launches.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .philox import _STREAM_ACCEPT, _STREAM_SAMPLE, _philox_uniform

TILE = 4096           # vocabulary entries per tile
NUM_BINS = 256        # radix-select digit: 8 bits of the 32-bit key per pass
TILES_PER_LOAD = 16   # tiles summed per step of a combine
_NEG_INF_KEY = tl.constexpr(0xFF800000)  # the descending key of -inf (the largest non-NaN key)

_RUNTIME = ["B", "G", "V", "T", "level", "stride_tb", "stride_tg", "stride_db", "stride_dg", "filters"]


@triton.jit
def _descending_key(x):
    """int64 in [0, 2^32), decreasing in the float32 x: the bits with the sign flipped for
    x >= 0 and all bits flipped for x < 0, read in reverse. It is its own inverse (_key_value)."""
    u = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    return tl.where(u >= 0x80000000, u, 0x7FFFFFFF - u)


@triton.jit
def _key_value(key):
    """The float32 whose _descending_key is `key` (clipped to -inf: bin ends past it are NaNs)."""
    key = tl.minimum(key, _NEG_INF_KEY)
    u = tl.where(key >= 0x80000000, key, 0x7FFFFFFF - key)
    return u.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _logit_row(r, B, G, V, target_ptr, draft_ptr, stride_tb, stride_tg, stride_db, stride_dg, temperature_ptr,
               top_k_ptr, top_p_ptr, min_p_ptr, filters):
    """(pointer to logit row r, then its batch row's filters as _row_filters gives them)."""
    n_target = B * (G + 1)
    if r < n_target:
        b = r // (G + 1)
        row = target_ptr + b * stride_tb + (r - b * (G + 1)) * stride_tg
    else:
        b = (r - n_target) // G
        row = draft_ptr + b * stride_db + (r - n_target - b * G) * stride_dg
    t, top_k, top_p, min_p, uses_top_k, uses_top_p, uses_min_p = _row_filters(
        b, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, V, filters)
    return row, t, top_k, top_p, min_p, uses_top_k, uses_top_p, uses_min_p


@triton.jit
def _row_filters(b, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, V, filters):
    """(t, top_k, top_p, min_p, uses_top_k, uses_top_p, uses_min_p) of batch row b; greedy rows
    and calls with filters == 0 use none."""
    temperature = tl.load(temperature_ptr + b)
    sampled = (temperature != 0.0) & (filters != 0)
    top_k = tl.load(top_k_ptr + b)
    top_p = tl.load(top_p_ptr + b)
    min_p = tl.load(min_p_ptr + b)
    t = tl.where(temperature == 0.0, 1.0, temperature)
    return (t, top_k, top_p, min_p, sampled & (top_k > 0) & (top_k < V), sampled & (top_p < 1.0),
            sampled & (min_p > 0.0))


# ---- row-wide values from per-tile partials ----------------------------------------------------

@triton.jit
def _row_max(tile_max_ptr, tile_arg_ptr, tile_z_ptr, r, T, t, TILES: tl.constexpr):
    """(max, first argmax, sum of exp((x - max) / t)) of logit row r from its tiles' partials."""
    row_max = -float("inf")
    for t0 in range(0, T, TILES):
        tiles = t0 + tl.arange(0, TILES)
        row_max = tl.maximum(row_max, tl.max(tl.load(tile_max_ptr + r * T + tiles, mask=tiles < T,
                                                     other=-float("inf")), 0))
    argmax = 2**62
    z = 0.0
    for t0 in range(0, T, TILES):
        tiles = t0 + tl.arange(0, TILES)
        ok = tiles < T
        m = tl.load(tile_max_ptr + r * T + tiles, mask=ok, other=-float("inf"))
        arg = tl.load(tile_arg_ptr + r * T + tiles, mask=ok, other=2**62)
        argmax = tl.minimum(argmax, tl.min(tl.where(m == row_max, arg, 2**62), 0))
        zt = tl.load(tile_z_ptr + r * T + tiles, mask=ok, other=0.0)
        z += tl.sum(tl.where(m == -float("inf"), 0.0, zt * tl.exp((m - row_max) / t)), 0)
    return row_max, argmax, z


@triton.jit
def _tile_sum(ptr, r, T, TILES: tl.constexpr):
    """Sum over the tiles of logit row r of a float partial [R, T]."""
    total = 0.0
    for t0 in range(0, T, TILES):
        tiles = t0 + tl.arange(0, TILES)
        total += tl.sum(tl.load(ptr + r * T + tiles, mask=tiles < T, other=0.0), 0)
    return total


@triton.jit
def _bins_sum(hist_ptr, T, TILES: tl.constexpr, NUM_BINS: tl.constexpr):
    """Sum over tiles of one row's histograms [T, NUM_BINS] (hist_ptr at the row's first)."""
    bins = tl.arange(0, NUM_BINS)
    total = tl.zeros([NUM_BINS], dtype=hist_ptr.dtype.element_ty)
    for t0 in range(0, T, TILES):
        tiles = t0 + tl.arange(0, TILES)
        total += tl.sum(tl.load(hist_ptr + tiles[:, None] * NUM_BINS + bins[None, :], mask=(tiles < T)[:, None],
                                other=0), 0)
    return total


@triton.jit
def _row_z1(tile_max_ptr, tile_arg_ptr, tile_z_ptr, tile_zk_ptr, r, T, t, uses_top_k, TILES: tl.constexpr):
    """(max, first argmax, z1): z1 is the sum of exp((x - max) / t) over what top-k keeps."""
    row_max, argmax, z1 = _row_max(tile_max_ptr, tile_arg_ptr, tile_z_ptr, r, T, t, TILES)
    if uses_top_k:
        z1 = _tile_sum(tile_zk_ptr, r, T, TILES)
    return row_max, argmax, z1


# ---- radix select ---------------------------------------------------------------------------------
# Pass `level` (1..LEVELS) resolves digit level - 1 of the selected key from the previous pass's
# histograms; with level < LEVELS it then histograms digit `level` of the keys that share the
# digits found so far. A selection is done early when its bin can end it: top-k when the bin's
# keys are all kept, top-p when the bin holds one key. The threshold is then the bin's largest key
# (its smallest logit): nothing else lies between it and the kept keys.

@triton.jit
def _top_k_state(level, top_k, state_ptr, counts_ptr, r, R, T, LEVELS: tl.constexpr, TILES: tl.constexpr,
                 NUM_BINS: tl.constexpr):
    """(prefix, need, done, key) of row r's top-k select after resolving digit level - 1. The
    state [2, R, 4] and counts [2, R, T, NUM_BINS] alternate between two slots by pass."""
    prev = (level - 1) % 2
    if level == 1:
        prefix = top_k * 0
        need = top_k
        done = top_k * 0
        key = top_k * 0
    else:
        prefix = tl.load(state_ptr + (prev * R + r) * 4 + 0)
        need = tl.load(state_ptr + (prev * R + r) * 4 + 1)
        done = tl.load(state_ptr + (prev * R + r) * 4 + 2)
        key = tl.load(state_ptr + (prev * R + r) * 4 + 3)
    if done == 0:
        counts = _bins_sum(counts_ptr + (prev * R + r) * T * NUM_BINS, T, TILES, NUM_BINS).to(tl.int64)
        bins = tl.arange(0, NUM_BINS)
        through = tl.cumsum(counts, 0)  # keys in bins 0..d (largest logits first)
        digit = tl.min(tl.where(through >= need, bins, NUM_BINS), 0)
        in_bin = tl.sum(tl.where(bins == digit, counts, 0), 0)
        need = need - (tl.sum(tl.where(bins == digit, through, 0), 0) - in_bin)
        prefix = prefix * NUM_BINS + digit
        shift = (32 - 8 * level).to(tl.int64)
        key = (prefix << shift) | ((prefix * 0 + 1 << shift) - 1)
        done = ((in_bin == need) | (level == LEVELS)).to(tl.int64)
    return prefix, need, done, key


@triton.jit
def _top_p_state(level, threshold, state_ptr, before_ptr, counts_ptr, mass_ptr, r, R, T, LEVELS: tl.constexpr,
                 TILES: tl.constexpr, NUM_BINS: tl.constexpr):
    """(prefix, before, done, key) of row r's top-p select after resolving digit level - 1: the
    largest key whose more probable mass (`before`, unnormalised) is < threshold = top_p * z1.
    State [2, R, 3] int64 and before [2, R]; counts and mass [2, R, T, NUM_BINS], by pass."""
    prev = (level - 1) % 2
    if level == 1:
        prefix = r * 0
        done = r * 0
        key = r * 0
        before = threshold * 0.0
    else:
        prefix = tl.load(state_ptr + (prev * R + r) * 3 + 0)
        done = tl.load(state_ptr + (prev * R + r) * 3 + 1)
        key = tl.load(state_ptr + (prev * R + r) * 3 + 2)
        before = tl.load(before_ptr + prev * R + r)
    if done == 0:
        offset = (prev * R + r) * T * NUM_BINS
        counts = _bins_sum(counts_ptr + offset, T, TILES, NUM_BINS)
        mass = _bins_sum(mass_ptr + offset, T, TILES, NUM_BINS)
        bins = tl.arange(0, NUM_BINS)
        # Mass in the bins before each one: exactly `before` at the first non-empty bin, where the
        # scan has added only zeros, so that bin always qualifies.
        ahead = before + (tl.cumsum(mass, 0) - mass)
        qualifies = (counts > 0) & (ahead < threshold)
        digit = tl.max(tl.where(qualifies, bins, -1), 0)
        digit = tl.where(digit < 0, tl.min(tl.where(counts > 0, bins, NUM_BINS), 0), digit)
        in_bin = tl.sum(tl.where(bins == digit, counts, 0), 0)
        before = tl.sum(tl.where(bins == digit, ahead, 0.0), 0)
        prefix = prefix * NUM_BINS + digit
        shift = (32 - 8 * level).to(tl.int64)
        key = (prefix << shift) | ((prefix * 0 + 1 << shift) - 1)
        done = ((in_bin == 1) | (level == LEVELS)).to(tl.int64)
    return prefix, before, done, key


@triton.jit
def _count_digits(row, start0, V, prefix, level, TILE: tl.constexpr, BLOCK: tl.constexpr,
                  NUM_BINS: tl.constexpr):
    """Histogram [NUM_BINS] int32 of digit `level` of the keys in one tile whose earlier digits
    are `prefix`."""
    bins = tl.arange(0, NUM_BINS)
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    left_out = 0
    for start in range(start0, tl.minimum(start0 + TILE, V), BLOCK):
        idx = start + tl.arange(0, BLOCK)
        x = tl.load(row + idx, mask=idx < V, other=0.0).to(tl.float32)
        key = _descending_key(x)
        match = (idx < V) & ((key >> (32 - 8 * level)) == prefix)
        digit = tl.where(match, (key >> (24 - 8 * level)) & (NUM_BINS - 1), 0).to(tl.int32)
        counts += tl.histogram(digit, NUM_BINS)
        left_out += BLOCK - tl.sum(match.to(tl.int32), 0)
    return counts - tl.where(bins == 0, left_out, 0)  # the keys left out were counted in bin 0


@triton.jit
def _weigh_digits(row, start0, V, prefix, level, row_max, t, cut, TILE: tl.constexpr, CHUNK: tl.constexpr,
                  NUM_BINS: tl.constexpr):
    """(counts int32, mass float32) [NUM_BINS] of digit `level` over one tile's keys whose
    earlier digits are `prefix`, weighted by exp((x - max) / t) where that is >= exp(cut) and > 0.
    A one-hot sum, chunk by chunk, skipping chunks with no such key (deterministic, unlike atomics)."""
    bins = tl.arange(0, NUM_BINS)
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    mass = tl.zeros([NUM_BINS], dtype=tl.float32)
    for start in range(start0, tl.minimum(start0 + TILE, V), CHUNK):
        idx = start + tl.arange(0, CHUNK)
        x = tl.load(row + idx, mask=idx < V, other=-float("inf")).to(tl.float32)
        s = (x - row_max) / t
        w = tl.where(s >= cut, tl.exp(s), 0.0)
        key = _descending_key(x)
        match = (w > 0.0) & ((key >> (32 - 8 * level)) == prefix)
        if tl.sum(match.to(tl.int32), 0) > 0:
            digit = (key >> (24 - 8 * level)) & (NUM_BINS - 1)
            one_hot = (digit[:, None] == bins[None, :]) & match[:, None]
            counts += tl.sum(one_hot.to(tl.int32), 0)
            mass += tl.sum(tl.where(one_hot, w[:, None], 0.0), 0)
    return counts, mass


# ---- the kernels -----------------------------------------------------------------------------------

@triton.jit(do_not_specialize=_RUNTIME)
def _stats_kernel(
    target_ptr, draft_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    tile_max_ptr, tile_arg_ptr, tile_z_ptr, counts_ptr,
    B, G, V, T, stride_tb, stride_tg, stride_db, stride_dg, filters,
    TILE: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    row, t, top_k, top_p, min_p, uses_top_k, uses_top_p, uses_min_p = _logit_row(
        r, B, G, V, target_ptr, draft_ptr, stride_tb, stride_tg, stride_db, stride_dg, temperature_ptr, top_k_ptr,
        top_p_ptr, min_p_ptr, filters)
    start0 = tile * TILE
    bins = tl.arange(0, NUM_BINS)
    tile_max = -float("inf")
    tile_arg = start0.to(tl.int64)
    z = 0.0
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    left_out = 0
    for start in range(start0, tl.minimum(start0 + TILE, V), BLOCK):
        idx = start + tl.arange(0, BLOCK)
        x = tl.load(row + idx, mask=idx < V, other=-float("inf")).to(tl.float32)
        block_max = tl.max(x, 0)
        new_max = tl.maximum(tile_max, block_max)
        # Online softmax: rescale the running sum to the new max (nothing to rescale while -inf).
        rescale = tl.where(tile_max == -float("inf"), 0.0, tl.exp((tile_max - new_max) / t))
        z = z * rescale + tl.sum(tl.where(x == -float("inf"), 0.0, tl.exp((x - new_max) / t)), 0)
        tile_arg = tl.where(block_max > tile_max, tl.argmax(x, 0) + start, tile_arg)  # strict: first max wins
        tile_max = new_max
        if uses_top_k:  # the first digit of the top-k select, from the same read
            digit = tl.where(idx < V, _descending_key(x) >> 24, 0).to(tl.int32)
            counts += tl.histogram(digit, NUM_BINS)
            left_out += tl.sum((idx >= V).to(tl.int32), 0)
    tl.store(tile_max_ptr + r * T + tile, tile_max)
    tl.store(tile_arg_ptr + r * T + tile, tile_arg)
    tl.store(tile_z_ptr + r * T + tile, z)
    if uses_top_k:
        tl.store(counts_ptr + (r * T + tile) * NUM_BINS + bins, counts - tl.where(bins == 0, left_out, 0))


@triton.jit(do_not_specialize=_RUNTIME)
def _top_k_kernel(
    target_ptr, draft_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, state_ptr, counts_ptr,
    B, G, V, T, level, stride_tb, stride_tg, stride_db, stride_dg, filters,
    LEVELS: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr, NUM_BINS: tl.constexpr,
):
    """Pass `level` (1..LEVELS-1) of the top-k select."""
    r = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    R = tl.num_programs(0)
    row, t, top_k, top_p, min_p, uses_top_k, uses_top_p, uses_min_p = _logit_row(
        r, B, G, V, target_ptr, draft_ptr, stride_tb, stride_tg, stride_db, stride_dg, temperature_ptr, top_k_ptr,
        top_p_ptr, min_p_ptr, filters)
    if uses_top_k:
        prefix, need, done, key = _top_k_state(level, top_k, state_ptr, counts_ptr, r, R, T, LEVELS, TILES,
                                               NUM_BINS)
        slot = level % 2
        if tile == 0:
            base = state_ptr + (slot * R + r) * 4
            tl.store(base + 0, prefix)
            tl.store(base + 1, need)
            tl.store(base + 2, done)
            tl.store(base + 3, key)
        if done == 0:
            counts = _count_digits(row, tile * TILE, V, prefix, level, TILE, BLOCK, NUM_BINS)
            tl.store(counts_ptr + ((slot * R + r) * T + tile) * NUM_BINS + tl.arange(0, NUM_BINS), counts)


@triton.jit(do_not_specialize=_RUNTIME)
def _top_p_first_kernel(
    target_ptr, draft_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    tile_max_ptr, tile_arg_ptr, tile_z_ptr, tile_zk_ptr, top_k_state_ptr, counts_ptr, mass_ptr, cut_ptr,
    B, G, V, T, stride_tb, stride_tg, stride_db, stride_dg, filters,
    LEVELS: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, TILES: tl.constexpr,
    NUM_BINS: tl.constexpr,
):
    """Ends the top-k select (the cut: the scaled k-th largest logit, -inf without top-k), sums
    each tile's exp over what it keeps, and histograms the first digit of the top-p select."""
    r = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    R = tl.num_programs(0)
    row, t, top_k, top_p, min_p, uses_top_k, uses_top_p, uses_min_p = _logit_row(
        r, B, G, V, target_ptr, draft_ptr, stride_tb, stride_tg, stride_db, stride_dg, temperature_ptr, top_k_ptr,
        top_p_ptr, min_p_ptr, filters)
    row_max, argmax, z = _row_max(tile_max_ptr, tile_arg_ptr, tile_z_ptr, r, T, t, TILES)
    cut = -float("inf")
    if uses_top_k:
        prefix, need, done, key = _top_k_state(T * 0 + LEVELS, top_k, top_k_state_ptr, counts_ptr, r, R, T, LEVELS,
                                               TILES, NUM_BINS)
        cut = (_key_value(key) - row_max) / t
    if tile == 0:
        tl.store(cut_ptr + r, cut)
    start0 = tile * TILE
    if uses_top_k:
        zk = 0.0
        for start in range(start0, tl.minimum(start0 + TILE, V), BLOCK):
            idx = start + tl.arange(0, BLOCK)
            s = (tl.load(row + idx, mask=idx < V, other=-float("inf")).to(tl.float32) - row_max) / t
            zk += tl.sum(tl.where(s >= cut, tl.exp(s), 0.0), 0)
        tl.store(tile_zk_ptr + r * T + tile, zk)
    if uses_top_p:
        # Slot 0 (pass LEVELS of the counts' alternation, LEVELS even), while slot 1 holds the top-k
        # select's last histograms.
        counts, mass = _weigh_digits(row, start0, V, r * 0, T * 0, row_max, t, cut, TILE, CHUNK, NUM_BINS)
        offset = ((0 * R + r) * T + tile) * NUM_BINS + tl.arange(0, NUM_BINS)
        tl.store(counts_ptr + offset, counts)
        tl.store(mass_ptr + offset, mass)


@triton.jit(do_not_specialize=_RUNTIME)
def _top_p_kernel(
    target_ptr, draft_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    tile_max_ptr, tile_arg_ptr, tile_z_ptr, tile_zk_ptr, cut_ptr, state_ptr, before_ptr, counts_ptr, mass_ptr,
    B, G, V, T, level, stride_tb, stride_tg, stride_db, stride_dg, filters,
    LEVELS: tl.constexpr, TILE: tl.constexpr, CHUNK: tl.constexpr, TILES: tl.constexpr, NUM_BINS: tl.constexpr,
):
    """Pass `level` (1..LEVELS-1) of the top-p select. It shares the counts' two slots with the
    top-k select, whose passes came first: pass LEVELS + level has the slot of pass level since
    LEVELS is even."""
    r = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    R = tl.num_programs(0)
    row, t, top_k, top_p, min_p, uses_top_k, uses_top_p, uses_min_p = _logit_row(
        r, B, G, V, target_ptr, draft_ptr, stride_tb, stride_tg, stride_db, stride_dg, temperature_ptr, top_k_ptr,
        top_p_ptr, min_p_ptr, filters)
    if uses_top_p:
        row_max, argmax, z1 = _row_z1(tile_max_ptr, tile_arg_ptr, tile_z_ptr, tile_zk_ptr, r, T, t, uses_top_k,
                                      TILES)
        cut = tl.load(cut_ptr + r)
        prefix, before, done, key = _top_p_state(level, top_p * z1, state_ptr, before_ptr, counts_ptr, mass_ptr, r,
                                                 R, T, LEVELS, TILES, NUM_BINS)
        slot = level % 2
        if tile == 0:
            tl.store(state_ptr + (slot * R + r) * 3 + 0, prefix)
            tl.store(state_ptr + (slot * R + r) * 3 + 1, done)
            tl.store(state_ptr + (slot * R + r) * 3 + 2, key)
            tl.store(before_ptr + slot * R + r, before)
        if done == 0:
            counts, mass = _weigh_digits(row, tile * TILE, V, prefix, level, row_max, t, cut, TILE, CHUNK, NUM_BINS)
            offset = (((level % 2) * R + r) * T + tile) * NUM_BINS + tl.arange(0, NUM_BINS)
            tl.store(counts_ptr + offset, counts)
            tl.store(mass_ptr + offset, mass)


@triton.jit(do_not_specialize=_RUNTIME)
def _floor_kernel(
    target_ptr, draft_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    tile_max_ptr, tile_arg_ptr, tile_z_ptr, tile_zk_ptr, cut_ptr, top_p_state_ptr, before_ptr, counts_ptr, mass_ptr,
    floor_ptr, tile_z2_ptr,
    B, G, V, T, stride_tb, stride_tg, stride_db, stride_dg, filters,
    LEVELS: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr, NUM_BINS: tl.constexpr,
):
    """Ends the top-p select: the floor (the smallest kept probability, raised to min_p times the
    largest), and each tile's mass of the probabilities at or above it (the final normaliser)."""
    r = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    R = tl.num_programs(0)
    row, t, top_k, top_p, min_p, uses_top_k, uses_top_p, uses_min_p = _logit_row(
        r, B, G, V, target_ptr, draft_ptr, stride_tb, stride_tg, stride_db, stride_dg, temperature_ptr, top_k_ptr,
        top_p_ptr, min_p_ptr, filters)
    floor = 0.0
    if uses_top_p | uses_min_p:
        row_max, argmax, z1 = _row_z1(tile_max_ptr, tile_arg_ptr, tile_z_ptr, tile_zk_ptr, r, T, t, uses_top_k,
                                      TILES)
        cut = tl.load(cut_ptr + r)
        if uses_top_p:
            prefix, before, done, key = _top_p_state(T * 0 + LEVELS, top_p * z1, top_p_state_ptr, before_ptr,
                                                     counts_ptr, mass_ptr, r, R, T, LEVELS, TILES, NUM_BINS)
            # The floor is computed exactly as a probability is (see _prob), so it keeps its logit.
            floor = tl.exp((_key_value(key) - row_max) / t) / z1
        if uses_min_p:
            floor = tl.maximum(floor, min_p * (1.0 / z1))
        z2 = 0.0
        start0 = tile * TILE
        for start in range(start0, tl.minimum(start0 + TILE, V), BLOCK):
            idx = start + tl.arange(0, BLOCK)
            s = (tl.load(row + idx, mask=idx < V, other=-float("inf")).to(tl.float32) - row_max) / t
            p = tl.where(s >= cut, tl.exp(s) / z1, 0.0)
            z2 += tl.sum(tl.where((p >= floor) & (p > 0.0), p, 0.0), 0)
        tl.store(tile_z2_ptr + r * T + tile, z2)
    if tile == 0:
        tl.store(floor_ptr + r, floor)


@triton.jit
def _row_warp(r, greedy, t, uses_top_k, tile_max_ptr, tile_arg_ptr, tile_z_ptr, tile_zk_ptr, cut_ptr, floor_ptr,
              tile_z2_ptr, T, filters, TILES: tl.constexpr):
    """(max, argmax, cut, exp_sum, floor, floor_mass): everything _prob needs of logit row r."""
    row_max, argmax, exp_sum = _row_z1(tile_max_ptr, tile_arg_ptr, tile_z_ptr, tile_zk_ptr, r, T, t, uses_top_k, TILES)
    cut = -float("inf")
    floor = 0.0
    floor_mass = 1.0
    if (filters != 0) & (greedy == 0):
        cut = tl.load(cut_ptr + r)
        floor = tl.load(floor_ptr + r)
        if floor > 0.0:
            floor_mass = _tile_sum(tile_z2_ptr, r, T, TILES)
    return row_max, argmax, cut, exp_sum, floor, floor_mass


@triton.jit
def _prob(x, index, greedy, t, warp):
    """Warped probability of logits x at vocabulary indices `index` (blocks or scalars); warp is
    the row's _row_warp."""
    row_max, argmax, cut, exp_sum, floor, floor_mass = warp
    s = (x - row_max) / t
    p = tl.where(s >= cut, tl.exp(s) / exp_sum, 0.0)
    p = tl.where((p >= floor) & (p > 0.0), p / floor_mass, 0.0)
    return tl.where(greedy, tl.where(index == argmax, 1.0, 0.0), p)


@triton.jit
def _final_masses(p_row, q_row, idx, V, rejected, one_hot_token, greedy, t, p_warp, q_warp,
                  HAS_DRAFT: tl.constexpr):
    """(p, mass of the final distribution) on vocabulary indices idx at a row's deciding position:
    max(0, p - q) after a rejection, else p (0 outside the vocabulary)."""
    valid = idx < V
    p = _prob(tl.load(p_row + idx, mask=valid, other=-float("inf")).to(tl.float32), idx, greedy, t, p_warp)
    p = tl.where(valid, p, 0.0)
    if HAS_DRAFT:
        q = _prob(tl.load(q_row + idx, mask=valid & rejected, other=-float("inf")).to(tl.float32), idx, greedy, t,
                  q_warp)
    else:
        q = tl.where(idx == one_hot_token, 1.0, 0.0)
    residual = tl.where(valid & rejected, tl.maximum(p - q, 0.0), 0.0)
    return p, residual


@triton.jit
def _deciding_position(b, n, drafts, B, G, target_ptr, draft_ptr, tokens_ptr, greedy, t, uses_top_k,
                       tile_max_ptr, tile_arg_ptr, tile_z_ptr, tile_zk_ptr, cut_ptr, floor_ptr, tile_z2_ptr,
                       stride_tb, stride_tg, stride_db, stride_dg, T, filters, HAS_DRAFT: tl.constexpr,
                       TILES: tl.constexpr):
    """(p row, q row, rejected, one-hot draft token, p's warp, q's warp) at row b's position n."""
    rejected = n < drafts
    p_row = target_ptr + b * stride_tb + n * stride_tg
    p_warp = _row_warp(b * (G + 1) + n, greedy, t, uses_top_k, tile_max_ptr, tile_arg_ptr, tile_z_ptr, tile_zk_ptr,
                   cut_ptr, floor_ptr, tile_z2_ptr, T, filters, TILES)
    q_row = draft_ptr + b * stride_db + tl.minimum(n, G - 1) * stride_dg
    q_warp = p_warp
    if HAS_DRAFT:
        if rejected:
            q_warp = _row_warp(B * (G + 1) + b * G + n, greedy, t, uses_top_k, tile_max_ptr, tile_arg_ptr, tile_z_ptr,
                           tile_zk_ptr, cut_ptr, floor_ptr, tile_z2_ptr, T, filters, TILES)
    token = tl.load(tokens_ptr + b * G + tl.minimum(n, G - 1), mask=rejected, other=-1)
    return p_row, q_row, rejected, token, p_warp, q_warp


@triton.jit(do_not_specialize=_RUNTIME)
def _decide_kernel(
    target_ptr, draft_ptr, tokens_ptr, num_drafts_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    seeds_ptr, positions_ptr, u_accept_ptr,
    tile_max_ptr, tile_arg_ptr, tile_z_ptr, tile_zk_ptr, cut_ptr, floor_ptr, tile_z2_ptr,
    decided_ptr, tile_mass_ptr, emitted_ptr, count_ptr, target_len_ptr, draft_len_ptr,
    B, G, V, T, stride_tb, stride_tg, stride_db, stride_dg, filters,
    HAS_DRAFT: tl.constexpr, HAS_UNIFORMS: tl.constexpr, HAS_TARGET_LEN: tl.constexpr,
    HAS_DRAFT_LEN: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr,
):
    """Every tile's program runs row b's accept tests (scalars: p(x_i), q(x_i)); tile 0 writes
    the accepted drafts, the count and the lengths; each writes its tile's masses of p and of the
    residual at the deciding position into tile_mass [2, B, T]."""
    b = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    G1 = G + 1
    drafts = tl.load(num_drafts_ptr + b)
    greedy = tl.load(temperature_ptr + b) == 0.0
    t, top_k, top_p, min_p, uses_top_k, uses_top_p, uses_min_p = _row_filters(
        b, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, V, filters)
    seed = tl.load(seeds_ptr + b)
    position = tl.load(positions_ptr + b)

    # Accept drafts while u * q(x) < p(x).
    n = drafts * 0
    going = drafts > 0
    while going:
        x_tok = tl.load(tokens_ptr + b * G + n)
        p_warp = _row_warp(b * G1 + n, greedy, t, uses_top_k, tile_max_ptr, tile_arg_ptr, tile_z_ptr, tile_zk_ptr,
                           cut_ptr, floor_ptr, tile_z2_ptr, T, filters, TILES)
        p_row = target_ptr + b * stride_tb + n * stride_tg
        p_x = _prob(tl.load(p_row + x_tok).to(tl.float32), x_tok, greedy, t, p_warp)
        q_x = 1.0
        if HAS_DRAFT:
            q_warp = _row_warp(B * G1 + b * G + n, greedy, t, uses_top_k, tile_max_ptr, tile_arg_ptr, tile_z_ptr,
                               tile_zk_ptr, cut_ptr, floor_ptr, tile_z2_ptr, T, filters, TILES)
            q_row = draft_ptr + b * stride_db + n * stride_dg
            q_x = _prob(tl.load(q_row + x_tok).to(tl.float32), x_tok, greedy, t, q_warp)
        if HAS_UNIFORMS:
            u = tl.load(u_accept_ptr + b * G1 + n)
        else:
            u = _philox_uniform(seed, position + n, _STREAM_ACCEPT)
        accepted = u * q_x < p_x
        if accepted:
            if tile == 0:
                tl.store(emitted_ptr + b * G1 + n, x_tok)
            n += 1
        going = accepted & (n < drafts)

    p_row, q_row, rejected, token, p_warp, q_warp = _deciding_position(
        b, n, drafts, B, G, target_ptr, draft_ptr, tokens_ptr, greedy, t, uses_top_k, tile_max_ptr, tile_arg_ptr,
        tile_z_ptr, tile_zk_ptr, cut_ptr, floor_ptr, tile_z2_ptr, stride_tb, stride_tg, stride_db, stride_dg, T,
        filters, HAS_DRAFT, TILES)
    p_mass = 0.0
    residual_mass = 0.0
    start0 = tile * TILE
    for start in range(start0, tl.minimum(start0 + TILE, V), BLOCK):
        p, residual = _final_masses(p_row, q_row, start + tl.arange(0, BLOCK), V, rejected, token, greedy, t,
                                    p_warp, q_warp, HAS_DRAFT)
        p_mass += tl.sum(p, 0)
        residual_mass += tl.sum(residual, 0)
    tl.store(tile_mass_ptr + b * T + tile, p_mass)
    tl.store(tile_mass_ptr + (B + b) * T + tile, residual_mass)
    if tile == 0:
        tl.store(decided_ptr + b, n.to(tl.int64))
        for i in range(n + 1, G1):
            tl.store(emitted_ptr + b * G1 + i, -1)
        tl.store(count_ptr + b, (n + 1).to(tl.int64))
        if HAS_TARGET_LEN:
            new_len = tl.load(target_len_ptr + b) + n + 1
            tl.store(target_len_ptr + b, new_len)
            if HAS_DRAFT_LEN:
                tl.store(draft_len_ptr + b, tl.minimum(tl.load(draft_len_ptr + b), new_len))


@triton.jit(do_not_specialize=_RUNTIME)
def _sample_kernel(
    target_ptr, draft_ptr, tokens_ptr, num_drafts_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    seeds_ptr, positions_ptr, u_sample_ptr,
    tile_max_ptr, tile_arg_ptr, tile_z_ptr, tile_zk_ptr, cut_ptr, floor_ptr, tile_z2_ptr,
    decided_ptr, tile_mass_ptr, emitted_ptr,
    B, G, V, T, stride_tb, stride_tg, stride_db, stride_dg, filters,
    HAS_DRAFT: tl.constexpr, HAS_UNIFORMS: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr,
    TILES: tl.constexpr,
):
    """The residual (falling back to p if rounding emptied it) or bonus sample of row b: the
    first index whose cumulative mass exceeds u * total, found tile first, then inside the tile."""
    b = tl.program_id(0).to(tl.int64)
    G1 = G + 1
    n = tl.load(decided_ptr + b)
    drafts = tl.load(num_drafts_ptr + b)
    greedy = tl.load(temperature_ptr + b) == 0.0
    t, top_k, top_p, min_p, uses_top_k, uses_top_p, uses_min_p = _row_filters(
        b, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, V, filters)
    if HAS_UNIFORMS:
        u = tl.load(u_sample_ptr + b * G1 + n)
    else:
        u = _philox_uniform(tl.load(seeds_ptr + b), tl.load(positions_ptr + b) + n, _STREAM_SAMPLE)

    rejected = n < drafts
    residual_total = _tile_sum(tile_mass_ptr + B * T, b, T, TILES)
    use_residual = rejected & (residual_total > 0.0)
    masses = tile_mass_ptr + tl.where(use_residual, B * T, 0)
    threshold = u * tl.where(use_residual, residual_total, _tile_sum(tile_mass_ptr, b, T, TILES))
    # The first tile whose cumulative mass exceeds the threshold, with the mass before it. If
    # rounding leaves none, the last tile with mass (whose scan then falls back to its last token).
    running = 0.0
    chosen_tile = T
    before = 0.0
    last_tile = 0
    for t0 in range(0, T, TILES):
        tiles = t0 + tl.arange(0, TILES)
        m = tl.load(masses + b * T + tiles, mask=tiles < T, other=0.0)
        cdf = running + tl.cumsum(m, 0)
        crossing = (cdf > threshold) & (m > 0.0) & (tiles < T)
        first = tl.min(tl.where(crossing, tiles, T), 0)
        if (chosen_tile == T) & (first < T):
            chosen_tile = first
            before = tl.sum(tl.where(tiles == first, cdf - m, 0.0), 0)
        last_tile = tl.maximum(last_tile, tl.max(tl.where(m > 0.0, tiles, 0), 0))
        running += tl.sum(m, 0)
    if chosen_tile == T:
        chosen_tile = last_tile
        before = running

    p_row, q_row, rejected, token, p_warp, q_warp = _deciding_position(
        b, n, drafts, B, G, target_ptr, draft_ptr, tokens_ptr, greedy, t, uses_top_k, tile_max_ptr, tile_arg_ptr,
        tile_z_ptr, tile_zk_ptr, cut_ptr, floor_ptr, tile_z2_ptr, stride_tb, stride_tg, stride_db, stride_dg, T,
        filters, HAS_DRAFT, TILES)
    running = before
    chosen = V
    last_positive = -1
    start0 = chosen_tile * TILE
    for start in range(start0, tl.minimum(start0 + TILE, V), BLOCK):
        idx = start + tl.arange(0, BLOCK)
        p, residual = _final_masses(p_row, q_row, idx, V, rejected, token, greedy, t, p_warp, q_warp, HAS_DRAFT)
        mass = tl.where(use_residual, residual, p)
        cdf = running + tl.cumsum(mass, 0)
        chosen = tl.minimum(chosen, tl.min(tl.where((cdf > threshold) & (mass > 0.0), idx, V), 0))
        last_positive = tl.maximum(last_positive, tl.max(tl.where(mass > 0.0, idx, -1), 0))
        running += tl.sum(mass, 0)
    sampled = tl.where(chosen < V, chosen, last_positive)
    tl.store(emitted_ptr + b * G1 + n, sampled.to(tl.int64))


def _levels(dtype: torch.dtype) -> int:
    """Radix passes a key needs: bfloat16 logits fill only the upper 16 bits of a float32, float16
    the upper 19. Even, so that the top-p select's passes alternate the slots as the top-k's."""
    return 2 if dtype == torch.bfloat16 else 4


def verify_triton(target_logits, draft_logits, draft_tokens, num_drafts, temperature, top_k, top_p, min_p, seeds,
                  positions, u_accept, u_sample, target_lengths, draft_lengths, filters: bool = True):
    """Allocates the outputs and the partials and launches the passes (arguments validated by
    specengine.ops.verify). filters=False: no row uses top-k, top-p or min-p (the caller knows),
    and their passes are not launched."""
    B, G1, V = target_logits.shape
    G = G1 - 1
    device = target_logits.device
    R = B * G1 + (B * G if draft_logits is not None else 0)
    # One tile size for every vocabulary (loops stop at V): a kernel compiles once per dtype and
    # flags, not per vocabulary size.
    T = triton.cdiv(V, TILE)
    # A tile's loops step by `block` entries and the one-hot histogram by `chunk`: small on a GPU
    # (registers); in the interpreter, whose cost is per operation rather than per element, a whole
    # tile a step.
    block, chunk = (1024, 32) if device.type == "cuda" else (TILE, 512)
    levels = _levels(target_logits.dtype)

    f32 = dict(dtype=torch.float32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    emitted = torch.empty(B, G1, **i64)
    counts = torch.empty(B, **i64)
    tile_max, tile_z = torch.empty(R, T, **f32), torch.empty(R, T, **f32)
    tile_arg = torch.empty(R, T, **i64)
    decided = torch.empty(B, **i64)
    tile_mass = torch.empty(2, B, T, **f32)
    dummy = counts  # stands in for absent optional pointers (never dereferenced)
    if filters:
        hist_counts = torch.empty(2, R, T, NUM_BINS, dtype=torch.int32, device=device)
        hist_mass = torch.empty(2, R, T, NUM_BINS, **f32)
        top_k_state, top_p_state = torch.empty(2, R, 4, **i64), torch.empty(2, R, 3, **i64)
        before = torch.empty(2, R, **f32)
        cut, floor = torch.empty(R, **f32), torch.empty(R, **f32)
        tile_zk, tile_z2 = torch.empty(R, T, **f32), torch.empty(R, T, **f32)
    else:  # never dereferenced
        hist_counts = torch.empty(1, dtype=torch.int32, device=device)
        top_k_state = top_p_state = decided
        hist_mass = before = cut = floor = tile_zk = tile_z2 = tile_z

    draft = draft_logits if draft_logits is not None else target_logits
    rows = (target_logits, draft)
    params = (temperature, top_k, top_p, min_p)
    shape = (B, G, V, T)
    strides = (target_logits.stride(0), target_logits.stride(1), draft.stride(0), draft.stride(1), int(filters))
    stats = (tile_max, tile_arg, tile_z, tile_zk)
    sizes = dict(TILE=TILE, TILES=TILES_PER_LOAD, NUM_BINS=NUM_BINS)
    _stats_kernel[(R, T)](*rows, *params, tile_max, tile_arg, tile_z, hist_counts, *shape, *strides,
                          TILE=TILE, BLOCK=block, NUM_BINS=NUM_BINS)
    if filters:
        for level in range(1, levels):
            _top_k_kernel[(R, T)](*rows, *params, top_k_state, hist_counts, *shape, level, *strides, LEVELS=levels,
                                  BLOCK=block, **sizes)
        _top_p_first_kernel[(R, T)](*rows, *params, *stats, top_k_state, hist_counts, hist_mass, cut, *shape,
                                    *strides, LEVELS=levels, BLOCK=block, CHUNK=chunk, **sizes)
        for level in range(1, levels):
            _top_p_kernel[(R, T)](*rows, *params, *stats, cut, top_p_state, before, hist_counts, hist_mass, *shape,
                                  level, *strides, LEVELS=levels, CHUNK=chunk, **sizes)
        _floor_kernel[(R, T)](*rows, *params, *stats, cut, top_p_state, before, hist_counts, hist_mass, floor,
                              tile_z2, *shape, *strides, LEVELS=levels, BLOCK=block, **sizes)
    warp = (*stats, cut, floor, tile_z2)
    tokens = draft_tokens if draft_tokens.numel() else dummy
    flags = dict(HAS_DRAFT=draft_logits is not None, HAS_UNIFORMS=u_accept is not None)
    _decide_kernel[(B, T)](
        *rows, tokens, num_drafts, *params, seeds, positions, u_accept if u_accept is not None else dummy, *warp,
        decided, tile_mass, emitted, counts, target_lengths if target_lengths is not None else dummy,
        draft_lengths if draft_lengths is not None else dummy, *shape, *strides, **flags,
        HAS_TARGET_LEN=target_lengths is not None, HAS_DRAFT_LEN=draft_lengths is not None, TILE=TILE, BLOCK=block,
        TILES=TILES_PER_LOAD)
    _sample_kernel[(B,)](
        *rows, tokens, num_drafts, *params, seeds, positions, u_sample if u_sample is not None else dummy, *warp,
        decided, tile_mass, emitted, *shape, *strides, **flags, TILE=TILE, BLOCK=block, TILES=TILES_PER_LOAD)
    return emitted, counts
