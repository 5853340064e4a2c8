"""The previous Triton verify kernel, kept as the baseline bench_verify.py measures against (the
package's kernel is specengine.kernels.verify): one program per row, logits read in blocks,
nothing materialised. Measured on an H200 (2026-11-29): 434 us at B=1, G=1, V=32000.

Same contract as specengine.sampling.verify.verify_reference (its oracle) and the C++ op.
Warps are thresholds found without sorting: the top-k cut by bisection on the bit pattern
of the scaled logits, the top-p floor by bisection on the probability; probabilities are
then recomputed on the fly from (max, thresholds, normalisers). Per-step integers (G, V,
strides) are runtime arguments, so a new round never recompiles.
Called directly with arguments specengine.ops.verify would accept; it validates nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specengine.kernels.philox import _STREAM_ACCEPT, _STREAM_SAMPLE, _philox_uniform

@triton.jit
def _warp_stats(row_ptr, V, temperature, top_k, top_p, min_p, BLOCK: tl.constexpr):
    """(max, argmax, kth, z1, floor, z2) of one logit row: see Warp in csrc/verify.cpp."""
    offs = tl.arange(0, BLOCK)
    row_max = -float("inf")
    row_argmax = 0
    for start in range(0, V, BLOCK):
        x = tl.load(row_ptr + start + offs, mask=start + offs < V, other=-float("inf")).to(tl.float32)
        block_max = tl.max(x, 0)
        block_arg = tl.argmax(x, 0) + start
        take = block_max > row_max  # strict: the first maximum wins
        row_argmax = tl.where(take, block_arg, row_argmax)
        row_max = tl.where(take, block_max, row_max)
    t = tl.where(temperature == 0.0, 1.0, temperature)

    # top-k: the k-th largest scaled logit, as the k-th smallest key = -(scaled) >= 0, found by
    # bisection on the key's bit pattern (monotone for non-negative floats).
    kth_key_bits = 0x7F800000  # +inf: keep everything
    if (top_k > 0) & (top_k < V):
        lo = 0
        hi = 0x7F800000
        while lo < hi:
            mid = lo + (hi - lo) // 2
            bound = mid.to(tl.float32, bitcast=True)
            count = 0
            for start in range(0, V, BLOCK):
                x = tl.load(row_ptr + start + offs, mask=start + offs < V, other=-float("inf")).to(tl.float32)
                key = -((x - row_max) / t)
                count += tl.sum((key <= bound).to(tl.int32), 0)
            if count >= top_k:
                hi = mid
            else:
                lo = mid + 1
        kth_key_bits = lo
    kth_key = kth_key_bits.to(tl.float32, bitcast=True)

    z1 = 0.0
    for start in range(0, V, BLOCK):
        x = tl.load(row_ptr + start + offs, mask=start + offs < V, other=-float("inf")).to(tl.float32)
        s = (x - row_max) / t
        z1 += tl.sum(tl.where(-s <= kth_key, tl.exp(s), 0.0), 0)

    # top-p: the smallest probability v whose strictly-larger mass is < top_p, by bisection on v's bits.
    floor = 0.0
    if top_p < 1.0:
        lo = 0
        hi = 0x3F800000  # 1.0: nothing is more probable than 1
        while lo < hi:
            mid = lo + (hi - lo) // 2
            v = mid.to(tl.float32, bitcast=True)
            mass = 0.0
            for start in range(0, V, BLOCK):
                x = tl.load(row_ptr + start + offs, mask=start + offs < V, other=-float("inf")).to(tl.float32)
                s = (x - row_max) / t
                p = tl.where(-s <= kth_key, tl.exp(s) / z1, 0.0)
                mass += tl.sum(tl.where(p > v, p, 0.0), 0)
            if mass < top_p:
                hi = mid
            else:
                lo = mid + 1
        floor = lo.to(tl.float32, bitcast=True)
    floor = tl.maximum(floor, min_p * (1.0 / z1))

    z2 = 0.0
    for start in range(0, V, BLOCK):
        x = tl.load(row_ptr + start + offs, mask=start + offs < V, other=-float("inf")).to(tl.float32)
        s = (x - row_max) / t
        p = tl.where(-s <= kth_key, tl.exp(s) / z1, 0.0)
        z2 += tl.sum(tl.where((p >= floor) & (p > 0.0), p, 0.0), 0)
    return row_max, row_argmax, kth_key, z1, floor, z2


@triton.jit
def _prob(x, index, greedy, row_max, row_argmax, t, kth_key, z1, floor, z2):
    """Warped probability of logits x at vocabulary indices `index` (blocks or scalars)."""
    s = (x - row_max) / t
    p = tl.where(-s <= kth_key, tl.exp(s) / z1, 0.0)
    p = tl.where((p >= floor) & (p > 0.0), p / z2, 0.0)
    return tl.where(greedy, tl.where(index == row_argmax, 1.0, 0.0), p)


@triton.jit
def _final_pq(p_row, q_row, idx, valid, need_q, x_tok, greedy, t, pm, pa, pk, pz1, pf, pz2, qm, qa, qk, qz1, qf, qz2,
              HAS_DRAFT: tl.constexpr):
    """p and q of one block at the deciding position (0 outside the vocabulary; q only if need_q)."""
    p = _prob(tl.load(p_row + idx, mask=valid, other=-float("inf")).to(tl.float32), idx, greedy,
              pm, pa, t, pk, pz1, pf, pz2)
    if HAS_DRAFT:
        q = _prob(tl.load(q_row + idx, mask=valid & need_q, other=-float("inf")).to(tl.float32), idx, greedy,
                  qm, qa, t, qk, qz1, qf, qz2)
    else:
        q = tl.where(idx == x_tok, 1.0, 0.0)
    return tl.where(valid, p, 0.0), tl.where(valid & need_q, q, 0.0)


# Round sizes and strides change every step: never specialise on their values (e.g. == 1 or
# divisibility by 16), so a new round reuses the compiled kernel.
@triton.jit(do_not_specialize=["G", "V", "stride_tb", "stride_tg", "stride_db", "stride_dg"])
def _verify_kernel(
    target_ptr, draft_ptr, tokens_ptr, num_drafts_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    seeds_ptr, positions_ptr, u_accept_ptr, u_sample_ptr, emitted_ptr, count_ptr, target_len_ptr, draft_len_ptr,
    G, V, stride_tb, stride_tg, stride_db, stride_dg,
    HAS_DRAFT: tl.constexpr, HAS_UNIFORMS: tl.constexpr, HAS_TARGET_LEN: tl.constexpr,
    HAS_DRAFT_LEN: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    G1 = G + 1
    offs = tl.arange(0, BLOCK)
    drafts = tl.load(num_drafts_ptr + b)
    temperature = tl.load(temperature_ptr + b)
    greedy = temperature == 0.0
    t = tl.where(greedy, 1.0, temperature)
    top_k = tl.load(top_k_ptr + b)
    top_p = tl.load(top_p_ptr + b)
    min_p = tl.load(min_p_ptr + b)
    seed = tl.load(seeds_ptr + b)
    position = tl.load(positions_ptr + b)

    # Accept drafts while u * q(x) < p(x).
    n = 0
    going = drafts > 0
    while going:
        x_tok = tl.load(tokens_ptr + b * G + n)
        p_row = target_ptr + b * stride_tb + n * stride_tg
        pm, pa, pk, pz1, pf, pz2 = _warp_stats(p_row, V, temperature, top_k, top_p, min_p, BLOCK)
        p_x = _prob(tl.load(p_row + x_tok).to(tl.float32), x_tok, greedy, pm, pa, t, pk, pz1, pf, pz2)
        q_x = 1.0
        if HAS_DRAFT:
            q_row = draft_ptr + b * stride_db + n * stride_dg
            qm, qa, qk, qz1, qf, qz2 = _warp_stats(q_row, V, temperature, top_k, top_p, min_p, BLOCK)
            q_x = _prob(tl.load(q_row + x_tok).to(tl.float32), x_tok, greedy, qm, qa, t, qk, qz1, qf, qz2)
        if HAS_UNIFORMS:
            u = tl.load(u_accept_ptr + b * G1 + n)
        else:
            u = _philox_uniform(seed, position + n, _STREAM_ACCEPT)
        accepted = u * q_x < p_x
        if accepted:
            tl.store(emitted_ptr + b * G1 + n, x_tok)
            n += 1
        going = accepted & (n < drafts)

    if HAS_UNIFORMS:
        u = tl.load(u_sample_ptr + b * G1 + n)
    else:
        u = _philox_uniform(seed, position + n, _STREAM_SAMPLE)
    rejected = n < drafts
    p_row = target_ptr + b * stride_tb + n * stride_tg
    pm, pa, pk, pz1, pf, pz2 = _warp_stats(p_row, V, temperature, top_k, top_p, min_p, BLOCK)
    x_tok = tl.load(tokens_ptr + b * G + tl.minimum(n, G - 1), mask=rejected, other=-1)
    qm, qa, qk, qz1, qf, qz2 = pm, pa, pk, pz1, pf, pz2
    if HAS_DRAFT:
        if rejected:
            q_row = draft_ptr + b * stride_db + n * stride_dg
            qm, qa, qk, qz1, qf, qz2 = _warp_stats(q_row, V, temperature, top_k, top_p, min_p, BLOCK)

    # The residual norm(max(0, p - q)) after a rejection (falling back to p if rounding emptied
    # it), else p itself; then the first index whose cumulative mass exceeds u * total.
    q_ptr = draft_ptr + b * stride_db + n * stride_dg
    residual_total = 0.0
    p_total = 0.0
    for start in range(0, V, BLOCK):
        idx = start + offs
        p, q = _final_pq(p_row, q_ptr, idx, idx < V, rejected, x_tok, greedy, t, pm, pa, pk, pz1, pf, pz2,
                         qm, qa, qk, qz1, qf, qz2, HAS_DRAFT)
        p_total += tl.sum(p, 0)
        residual_total += tl.sum(tl.where(rejected, tl.maximum(p - q, 0.0), 0.0), 0)
    use_residual = rejected & (residual_total > 0.0)
    threshold = u * tl.where(use_residual, residual_total, p_total)
    running = 0.0
    chosen = V
    last_positive = 0
    for start in range(0, V, BLOCK):
        idx = start + offs
        valid = idx < V
        p, q = _final_pq(p_row, q_ptr, idx, valid, use_residual, x_tok, greedy, t, pm, pa, pk, pz1, pf, pz2,
                         qm, qa, qk, qz1, qf, qz2, HAS_DRAFT)
        mass = tl.where(use_residual, tl.maximum(p - q, 0.0), p)
        cdf = running + tl.cumsum(mass, 0)
        crossing = tl.min(tl.where((cdf > threshold) & valid, idx, V), 0)
        chosen = tl.minimum(chosen, crossing)
        last_positive = tl.maximum(last_positive, tl.max(tl.where(mass > 0.0, idx, 0), 0))
        running += tl.sum(mass, 0)
    token = tl.minimum(chosen, last_positive)
    tl.store(emitted_ptr + b * G1 + n, token.to(tl.int64))
    for i in range(n + 1, G1):
        tl.store(emitted_ptr + b * G1 + i, -1)
    tl.store(count_ptr + b, (n + 1).to(tl.int64))
    if HAS_TARGET_LEN:
        new_len = tl.load(target_len_ptr + b) + n + 1
        tl.store(target_len_ptr + b, new_len)
        if HAS_DRAFT_LEN:
            tl.store(draft_len_ptr + b, tl.minimum(tl.load(draft_len_ptr + b), new_len))


def verify_triton(target_logits, draft_logits, draft_tokens, num_drafts, temperature, top_k, top_p, min_p, seeds,
                  positions, u_accept, u_sample, target_lengths, draft_lengths):
    """Allocates outputs and launches one program per row (arguments validated by specengine.ops.verify)."""
    B, G1, V = target_logits.shape
    device = target_logits.device
    emitted = torch.empty(B, G1, dtype=torch.int64, device=device)
    counts = torch.empty(B, dtype=torch.int64, device=device)
    dummy = counts  # stands in for absent optional pointers (never dereferenced)
    draft = draft_logits if draft_logits is not None else target_logits
    _verify_kernel[(B,)](
        target_logits, draft, draft_tokens if draft_tokens.numel() else dummy, num_drafts, temperature, top_k,
        top_p, min_p, seeds, positions,
        u_accept if u_accept is not None else dummy, u_sample if u_sample is not None else dummy,
        emitted, counts, target_lengths if target_lengths is not None else dummy,
        draft_lengths if draft_lengths is not None else dummy,
        G1 - 1, V, target_logits.stride(0), target_logits.stride(1), draft.stride(0), draft.stride(1),
        HAS_DRAFT=draft_logits is not None, HAS_UNIFORMS=u_accept is not None,
        HAS_TARGET_LEN=target_lengths is not None, HAS_DRAFT_LEN=draft_lengths is not None,
        BLOCK=min(1024, triton.next_power_of_2(V)),
    )
    return emitted, counts
