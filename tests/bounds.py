"""Tolerances derived from float32's error bounds, not from one machine's measured differences.

A tolerance here bounds |float32 result - exact result| for any evaluation order, any vector
width and with or without fused multiply-adds, so it holds on every CPU and instruction-set
path (and for transformers' float32, whatever BLAS it runs on), and it scales with the
computation's own magnitudes. Two float32 computations of one quantity are each within the
bound of the exact value, so within twice the bound of each other. Products and single
operations get worst-case bounds; whole models a probabilistic one (below), since a worst-case
bound through a network is vacuous.

Notation: u = 2^-24, the unit roundoff of float32 (round to nearest); gamma(n) = n u / (1 - n u).

Products (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1, (3.5)):
a dot product of K terms evaluated in float32 in ANY order, each product rounded or fused,
satisfies |fl(x . w) - x . w| <= gamma(K) |x| . |w|: every term passes through at most K
roundings (its product and at most K - 1 additions), each a factor (1 + d) with |d| <= u, and
prod (1 + d_i) - 1 <= gamma(K). So out = x @ W^T computed in float32 is within
gamma(K) * (|x| @ |W|^T) of the exact product, elementwise. A bias is one more term of the sum
(its product with 1 is exact): gamma(K + 1), and |bias| joins the magnitude. A product whose
x is split into three bfloat16 terms (the AMX path, csrc/gemm.cpp: x = x1 + x2 + x3 + r, each
split exact in float32, |r| <= 2^-24 |x|, every bfloat16 product exact in float32) sums 3K
exact terms of total magnitude <= (1 + 2^-7) |x| . |w| and drops r: gamma(3K) (1 + 2^-7) + u <=
gamma(3K + 1) (1 + 2^-7). Weights are exact inputs here: dequantized GGUF blocks and widened
bfloat16 give every implementation the same float32 weights. Underflow (or a flush to zero)
adds at most 2^-126 a rounding: n 2^-126 more, absolute.

Single operations (tracked_rope, tracked_attention, attention_error_bound, warp_error_bound): a
first-order running error analysis (Wilkinson; Higham section 3.3). Alongside each float64 value v it
carries e >= |float32 computation - v|, elementwise: what the operation does to its inputs'
errors (the derivative's absolute value times e) plus its own rounding, bounded as products
are (gamma of the number of roundings a term passes through, times the terms' magnitude); each
rule is derived in its function. Library functions (exp, sqrt, rsqrt, the sigmoid of SiLU)
are taken to be within C_F = 8 u of exact (4 ulps; glibc, SLEEF's u10 functions and
csrc/vector_math.h's exp are within 1 or 2); rotary tables' cos and sin within
C_ROPE u (1 + position) (inv_freq's float32 pow of theta, whose exponent's rounding alone gives
~log(theta) u, times the position, then cos or sin). First order: the neglected terms are
O((n u)^2) relative, under 1e-3 of the bound while n u < 1e-3.

Whole models (Float64Llama): worst-case propagation is useless through a network: a product's
|W| e_x loses the signs' cancellation, so the bound grows ~sqrt(K) times a product (measured
here: 1e4 times the logits after two layers). So the errors are propagated by the model itself:
the forward runs in float64 on the same weights (the exact result, to 2^-29 of float32's
rounding), and again RUNS times with every operation's result moved by its own rounding's scale
times an independent random sign per element (Monte Carlo arithmetic, Parker 1997, under the
probabilistic model of rounding errors as independent and mean-zero, Higham and Mary, SIAM J.
Sci. Comput. 41 (2019) A2815: n roundings accumulate to about sqrt(n) u where gamma(n) ~ n u is
the worst case). An operation's scale is sqrt(n) u times the magnitude its worst-case bound
uses, n its roundings counted as above: a sum's error sum_k d_k S_k over its partial sums S_k,
|d_k| <= u, has a standard deviation of at most u sqrt(n) max |S_k| <= that scale. The forward
carries each perturbation through every later layer with the model's own gains (attention,
norms, SiLU), which no closed formula in depth and K can. The bound on each logit is
LAMBDA = 8 times the root-mean-square deviation of the RUNS = 16 runs: under the model, even
with every rounding a full u, a float32 result falls outside it with probability 5.5e-7
(Student's t with 16 degrees of freedom, for the deviation estimated from 16 runs); round to
nearest errs by u / sqrt(3) on average, and blocked sums have shorter partial sums, so real
errors stay far inside: against every instruction-set path here, transformers' float32
included, the largest was 3.6% of the bound (SmolLM2's 30 layers and the tiny test models
alike). The bound is a property of the computation, not of a machine. The float64 reference
takes its rotary tables from the model (float32 tables, as transformers and this engine both
build them), so it carries the tables' error itself: their term is counted twice. Float64T5 does
the same for T5 encoder-decoders (its relative-position biases are table lookups, exact inputs).

Tokens across different arithmetic: a greedy token is certain where the exact top logit less
its bound exceeds every other logit plus its bound; every float32 computation within the bound
takes that argmax. At the first position where it is not certain, two correct computations may
take either and from then on go different ways, so a comparison stops there
(assert_greedy_tokens_agree). Seeded tokens likewise up to the first difference, which must be
where a uniform lies within the bound's reach of its threshold (seeded_step_is_fragile).
"""
from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

U = 2.0 ** -24           # float32's unit roundoff
C_F = 8                  # library functions (exp, sqrt, rsqrt, sigmoid): within 8 u of exact
C_ROPE = 24              # rotary tables: |cos - exact| <= C_ROPE u (1 + position), likewise sin
UNDERFLOW = 2.0 ** -126  # at most this much absolute error a rounding from underflow or flush to zero
AMX_TERMS = 3            # bfloat16 terms of x on the AMX path


@contextmanager
def _one_thread():
    """Small float64 products run on one thread: on a shared 2-core machine two threads' waits
    made a 14 x 64 x 64 product take 16 ms instead of 0.02."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def gamma(n: float) -> float:
    """gamma(n) = n u / (1 - n u): the relative error of n float32 roundings in sequence."""
    assert n * U < 0.5, "too many roundings for a float32 bound"
    return n * U / (1 - n * U)


def product_roundings(K: int, bias: bool = False, terms: int = 1) -> float:
    """n with |fl(x @ W^T + b) - exact| <= gamma(n) (|x| @ |W|^T + |b|) (module docstring): K,
    plus one for a bias; 3K + 1 (and 1 + 2^-7 of magnitude, folded in here) for x split in three
    bfloat16 terms."""
    if terms == 1:
        return K + (1 if bias else 0)
    n = terms * K + 1 + (1 if bias else 0)
    return n * (1 + 2.0 ** -7)


def exact_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T (+ bias [N]) in float64, on the CPU: exact to float64's rounding,
    which is 2^-29 of float32's."""
    out = x.detach().cpu().double() @ w.detach().cpu().double().t()
    return out if bias is None else out + bias.detach().cpu().double()


def product_error_bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                        terms: int = 1) -> torch.Tensor:
    """Elementwise bound [..., N] (float64) on |float32 x @ w^T + bias - exact|, for any
    summation order: gamma(K [+1]) (|x| @ |w|^T + |bias|), plus underflow's share."""
    x64, w64 = x.detach().cpu().double(), w.detach().cpu().double()
    magnitude = x64.abs() @ w64.abs().t()
    if bias is not None:
        magnitude = magnitude + bias.detach().cpu().double().abs()
    n = product_roundings(x.shape[-1], bias is not None, terms)
    return gamma(n) * magnitude + n * UNDERFLOW


def product_difference_bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                             terms: int = 1) -> torch.Tensor:
    """Bound on the difference of two float32 computations of x @ w^T + bias (ours against
    torch's, say): each is within product_error_bound of the exact product."""
    return 2 * product_error_bound(x, w, bias, terms)


def excess(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> tuple[float, str]:
    """(the largest |got - want| / bound, where) over all elements, in float64. NaN counts as
    past every bound; equal infinities (masked logits) as within."""
    if got.numel() == 0:
        return 0.0, "no elements"
    got64, want64 = got.detach().cpu().double(), want.detach().cpu().double().reshape(got.shape)
    bound = bound.detach().cpu().double().expand(got.shape)
    same = got64 == want64  # equal infinities too
    error = torch.where(same, 0.0, (got64 - want64).abs()).nan_to_num(float("inf"))
    ratio = torch.where(error == 0, 0.0, error / bound)
    worst = int(ratio.flatten().argmax())
    at = [int(i) for i in torch.unravel_index(torch.tensor(worst), got.shape)] if got.dim() else []
    flat = lambda t: t.flatten()[worst].item()  # noqa: E731
    where = f"at {at}: got {flat(got64)!r}, want {flat(want64)!r}, bound {flat(bound):.3g}"
    return float(ratio.flatten()[worst]), where


def within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> bool:
    """Whether |got - want| <= bound everywhere."""
    return excess(got, want, bound)[0] <= 1.0


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, msg: str = ""):
    """|got - want| <= bound everywhere, else an AssertionError naming the worst element."""
    assert got.shape == want.shape, f"{msg} shapes {tuple(got.shape)} != {tuple(want.shape)}"
    ratio, where = excess(got, want, bound)
    assert ratio <= 1.0, f"{msg} error {ratio:.3g}x the float32 bound {where}".strip()


def within_product_bound(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                         terms: int = 1) -> bool:
    """Whether float32 `got` is within product_error_bound of the exact x @ w^T + bias."""
    return within(got, exact_product(x, w, bias), product_error_bound(x, w, bias, terms))


def assert_within_product_bound(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                                bias: torch.Tensor | None = None, terms: int = 1):
    """got (any leading shape, any device) within product_error_bound of the exact product."""
    x2 = x.reshape(-1, x.shape[-1])
    assert_within(got.reshape(x2.shape[0], -1), exact_product(x2, w, bias), product_error_bound(x2, w, bias, terms))


def rms_norm_error_bound(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the exact g x / sqrt(mean(x^2) + eps) over the last dimension, float64 [..., n]; the
    elementwise bound on a float32 computation's error in it): mean(x^2) + eps sums n + 1 terms of
    one sign through at most n + 2 roundings (squares, sum, 1/n, eps), gamma(n + 2) relative to its
    value whatever the order; the square root halves that and adds C_F u; 1/r, x * (1/r) and * g
    add u each. Relative to |y|, first order (as _rms_norm's, worst case instead of a walk)."""
    x64, w64 = x.detach().cpu().double(), weight.detach().cpu().double()
    y = w64 * x64 / (x64.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return y, (0.5 * gamma(x.shape[-1] + 2) + (C_F + 3) * U) * y.abs() + UNDERFLOW


# ---- attention -------------------------------------------------------------------------------

def rope_error(positions: torch.Tensor, reference_tables_too: bool = True) -> torch.Tensor:
    """Bound [..., 1] on a float32 rotary table entry's error at these positions (C_ROPE u (1 + p)),
    twice over when the reference's tables are float32 ones too (module docstring)."""
    return (2 if reference_tables_too else 1) * C_ROPE * U * (1 + positions.double().abs())[..., None]


@dataclass
class Tracked:
    """A float64 value and an elementwise bound on a float32 computation's error in it."""
    v: torch.Tensor
    e: torch.Tensor = field(default=None)

    def __post_init__(self):
        if self.e is None:
            self.e = torch.zeros_like(self.v)


def _rotate_half(t: torch.Tensor, sign: bool = True) -> torch.Tensor:
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:] if sign else t[..., half:], t[..., :half]), dim=-1)


def tracked_rope(x: Tracked, cos: torch.Tensor, sin: torch.Tensor, table_error: torch.Tensor) -> Tracked:
    """y = x cos + rotate_half(x) sin (x [..., T, heads, D]; cos, sin [..., T, 1, D] float64 of the
    float32 tables; table_error [..., T, 1, 1] bounds their entries' errors). Propagated:
    |cos| e + |sin| rotate_half(e); the tables' error: (|x| + |rotate_half(x)|) table_error. Own
    rounding: two products and a sum, gamma(2) (|x cos| + |rotate_half(x) sin|)."""
    rotated = _rotate_half(x.v)
    y = x.v * cos + rotated * sin
    propagated = cos.abs() * x.e + sin.abs() * _rotate_half(x.e, sign=False)
    tables = (x.v.abs() + rotated.abs()) * table_error
    own = gamma(2) * ((x.v * cos).abs() + (rotated * sin).abs())
    return Tracked(y, propagated + tables + own)


def tracked_attention(q: Tracked, k: Tracked, v: Tracked, visible: torch.Tensor, scale: float,
                      score_bias: torch.Tensor | None = None) -> Tracked:
    """Softmax attention, q [Tq, H, D], k and v [Tk, Hkv, D] (query head h reads kv head
    h // (H / Hkv)), visible [Tq, Tk] bool; out [Tq, H, D]. A query that sees no key gets 0, e 0.

    Scores s_j = scale (q . k_j) (+ bias_j): propagated scale (e_q . |k_j| + |q| . e_k_j); own
    rounding gamma(D + 2) scale |q| . |k_j| (the dot product, the scale's own rounding and its
    multiply), and u |s_j| for adding a bias. Softmax-weighted values o = sum_j p_j v_j,
    p = softmax(s): a change ds in the scores moves o by sum_j p_j (v_j - o) ds_j (the max
    subtracted cancels), so |do| <= sum_j p_j |v_j - o| e_s_j, where e_s_j also takes u |s_j - m|
    for the subtraction of the max m; and by sum_j p_j e_v_j from the values. Own rounding over n
    visible keys: each weight exp(s_j - m) within C_F u, and at most n further roundings if an
    online softmax rescales it block by block: relative (C_F + n) u each, which moves o by at most
    (C_F + n) u sum_j p_j |v_j - o|; the numerator sum_j e_j v_j (n products and sums, and up to n
    rescalings of the partial sums) within gamma(2n + 2) sum_j p_j |v_j| relative to the total;
    the total within gamma(2n), and the final division or reciprocal and multiply 2 u: (gamma(2n)
    + 2u) |o|."""
    Tq, H, D = q.v.shape
    group = H // k.v.shape[1]
    kv = lambda t: t.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, Tk, D]
    qv, qe = q.v.transpose(0, 1), q.e.transpose(0, 1)  # [H, Tq, D]
    kv_v, kv_e, vv, ve = kv(k.v), kv(k.e), kv(v.v), kv(v.e)
    s = scale * qv @ kv_v.transpose(1, 2)  # [H, Tq, Tk]
    e_s = scale * (qe @ kv_v.abs().transpose(1, 2) + qv.abs() @ kv_e.transpose(1, 2))
    e_s = e_s + gamma(D + 2) * scale * (qv.abs() @ kv_v.abs().transpose(1, 2))
    if score_bias is not None:
        s = s + score_bias
        e_s = e_s + U * s.abs()
    s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(-1, keepdim=True)
    sees = torch.isfinite(m)
    shifted = torch.where(visible, s - torch.where(sees, m, 0.0), 0.0)
    e_s = torch.where(visible, e_s + U * shifted.abs(), 0.0)
    p = torch.softmax(torch.where(sees, s, 0.0), dim=-1) * visible  # rows without keys: all 0
    o = p @ vv  # [H, Tq, D]
    spread = (vv[:, None, :, :] - o[:, :, None, :]).abs()  # [H, Tq, Tk, D]: |v_j - o|
    n = visible.sum(-1).double()[None, :, None]  # [1, Tq, 1] keys a query sees
    err = ((p * e_s)[..., None] * spread).sum(2) + p @ ve
    err = err + (C_F + n) * U * (p[..., None] * spread).sum(2)
    err = err + (2 * n + 2) * U / (1 - (2 * n + 2) * U) * (p @ vv.abs())
    err = err + ((2 * n) * U / (1 - 2 * n * U) + 2 * U) * o.abs()
    return Tracked(o.transpose(0, 1), err.transpose(0, 1))


def attention_error_bound(q, k, v, cos, sin, positions, kv_len, window=None, scale=None, cache_k=None,
                          cache_v=None, table_error=False):
    """(exact output [B, T, H * D], bound on a float32 computation's error) of ops.attention's
    cached attention (rotate q and k, write k and v at positions, attend to keys j <= p,
    j < kv_len, j > p - window) on float32 inputs, exact in float64. cos and sin are the given
    tables, exact inputs (table_error: bound their errors as well)."""
    with _one_thread():
        return _attention_error_bound(q, k, v, cos, sin, positions, kv_len, window, scale, cache_k, cache_v,
                                      table_error)


def _attention_error_bound(q, k, v, cos, sin, positions, kv_len, window, scale, cache_k, cache_v, table_error):
    B, T, H, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    outs, errs = [], []
    for b in range(B):
        pos = positions[b]
        c64, s64 = cos[b].double()[:, None], sin[b].double()[:, None]
        t_err = rope_error(pos, False)[..., None] if table_error else torch.zeros(T, 1, 1, dtype=torch.float64)
        qr = tracked_rope(Tracked(q[b].double()), c64, s64, t_err)
        kr = tracked_rope(Tracked(k[b].double()), c64, s64, t_err)
        keys_v, keys_e = cache_k[b, :kv_len].double().clone(), torch.zeros(kv_len, *k.shape[2:], dtype=torch.float64)
        vals_v = cache_v[b, :kv_len].double().clone()
        inside = pos < kv_len
        keys_v[pos[inside]], keys_e[pos[inside]] = kr.v[inside], kr.e[inside]
        vals_v[pos[inside]] = v[b].double()[inside]
        key_pos = torch.arange(kv_len)
        visible = key_pos <= pos[:, None]
        if window is not None:
            visible &= key_pos > pos[:, None] - window
        out = tracked_attention(qr, Tracked(keys_v, keys_e), Tracked(vals_v), visible, scale)
        outs.append(out.v.reshape(T, H * D))
        errs.append(out.e.reshape(T, H * D))
    return torch.stack(outs), torch.stack(errs)


def relative_attention_error_bound(q, k, v, positions, cache_k, cache_v, kv_len, bias_table=None):
    """(exact output [B, T, H * D], bound on a float32 computation's error) of ops.attention's
    relative_attention (T5: k and v, when given, written at positions (clamped to the spill slot);
    query at p attends to keys j <= p, j < kv_len, scores q . k_j + bias_table[p - j], unscaled)
    on float32 inputs, exact in float64; the bias table's entries are exact inputs."""
    B, T, H, D = q.shape
    outs, errs = [], []
    with _one_thread():
        for b in range(B):
            pos = positions[b]
            keys, values = cache_k[b].double().clone(), cache_v[b].double().clone()
            if k is not None:
                slots = pos.clamp(max=keys.shape[0] - 1)
                keys[slots], values[slots] = k[b].double(), v[b].double()
            key_pos = torch.arange(kv_len)
            visible = key_pos <= pos[:, None]  # [T, kv_len]
            bias = None
            if bias_table is not None:
                distance = (pos[:, None] - key_pos).clamp(min=0)
                bias = bias_table.double()[distance].permute(2, 0, 1)  # [H, T, kv_len]
            out = tracked_attention(Tracked(q[b].double()), Tracked(keys[:kv_len]), Tracked(values[:kv_len]),
                                    visible, 1.0, bias)
            outs.append(out.v.reshape(T, H * D))
            errs.append(out.e.reshape(T, H * D))
    return torch.stack(outs), torch.stack(errs)


# ---- whole Llama-family models: a float64 forward with simulated float32 roundings -----------------

RUNS = 16     # perturbed float64 forwards a bound is estimated from
LAMBDA = 8.0  # the bound: LAMBDA times their root-mean-square deviation (module docstring)


class _Roundings:
    """Simulated float32 roundings for a float64 forward: with a seed, each call adds to an
    operation's result the scale of its own rounding error (walk) times an independent random
    sign per element; without, nothing (the exact forward)."""

    def __init__(self, seed: int | None):
        self.g = None if seed is None else torch.Generator().manual_seed(seed)

    def __call__(self, value: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
        if self.g is None:
            return value
        signs = torch.randint(0, 2, value.shape, generator=self.g).double() * 2 - 1
        return value + signs * bound


def walk(n: float) -> float:
    """sqrt(n) u: the scale of n roundings' accumulated error under the probabilistic model (the
    module docstring), where gamma(n) ~ n u is its worst case."""
    return n ** 0.5 * U


def _linear(x, w, bias, terms, r: _Roundings):
    """x @ w^T + bias: its product_roundings(K) (module docstring), over |x| @ |w|^T + |bias|."""
    y = x @ w.t()
    magnitude = x.abs() @ w.abs().t()
    if bias is not None:
        y, magnitude = y + bias, magnitude + bias.abs()
    return r(y, walk(product_roundings(w.shape[1], bias is not None, terms)) * magnitude)


def _rms_norm(x, weight, eps, r: _Roundings):
    """y = g x / r, r = sqrt(mean(x^2) + eps) over the last dimension (n entries). mean(x^2) + eps
    sums n + 1 terms of one sign through n + 2 roundings (squares, sum, 1/n, eps), relative to its
    value; the square root halves that and adds C_F u; 1/r, x * (1/r) and * g add u each (a
    division instead of the reciprocal: fewer). Relative to |y|."""
    y = weight * x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return r(y, (0.5 * walk(x.shape[-1] + 2) + (C_F + 3) * U) * y.abs())


def _rope(x, cos, sin, table_error, r: _Roundings):
    """x cos + rotate_half(x) sin: two products and a sum, and the tables' own error (as tracked_rope)."""
    rotated = _rotate_half(x)
    y = x * cos + rotated * sin
    return r(y, walk(2) * ((x * cos).abs() + (rotated * sin).abs()) + (x.abs() + rotated.abs()) * table_error)


def _attention(q, k, v, visible, scale, r: _Roundings, score_bias=None):
    """q [Tq, H, D], k and v [Tk, Hkv, D], visible [Tq, Tk], score_bias [H, Tq, Tk] or None: out
    [Tq, H * D], the roundings of tracked_attention simulated: on the scores (D + 2 roundings,
    and one more for adding a bias), on s - max, on each weight
    exp(s - max) (the function's C_F u, and the online softmax's up to n rescalings: sqrt(n) u),
    on the weighted sum (2n + 2 roundings) and on the total (2n) and the division (2)."""
    Tq, H, D = q.shape
    group = H // k.shape[1]
    kk, vv = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))  # [H, Tk, D]
    qq = q.transpose(0, 1)
    s = scale * qq @ kk.transpose(1, 2)
    s_error = walk(D + 2) * scale * (qq.abs() @ kk.abs().transpose(1, 2))
    if score_bias is not None:
        s = s + score_bias
        s_error = s_error + U * s.abs()
    s = r(s, s_error)
    z = torch.where(visible, s - s.masked_fill(~visible, float("-inf")).amax(-1, keepdim=True), 0.0)
    z = r(z, U * z.abs())
    n = visible.sum(-1).double()[None, :, None]  # [1, Tq, 1]
    w = z.exp()
    w = r(w, (C_F * U + walk(n)) * w) * visible
    total = w.sum(-1, keepdim=True)
    total = torch.where(total > 0, total, 1.0)  # a query that sees no key: 0
    o = (w @ vv) / total
    o = r(o, walk(2 * n + 2) * ((w @ vv.abs()) / total) + (walk(2 * n) + 2 * U) * o.abs())
    return o.transpose(0, 1).reshape(Tq, H * D)


def _add(a, b, r: _Roundings):
    """One rounding of the sum."""
    y = a + b
    return r(y, U * y.abs())


def _silu_mul(gate, up, r: _Roundings):
    """silu(gate) * up, silu(g) = g / (1 + exp(-g)): the exp's C_F u (kept relative by the sum with
    1), the sum, the division or the reciprocal and product: (C_F + 3) u |silu(g)|; then one
    rounding of the product with up."""
    a = gate * torch.sigmoid(gate)
    a = r(a, (C_F + 3) * U * a.abs())
    y = a * up
    return r(y, U * y.abs())


def _relu(x, r: _Roundings):
    """max(x, 0): exact."""
    return x.clamp(min=0)


def _gelu_tanh(x, r: _Roundings):
    """transformers' gelu_new, g = x/2 (1 + tanh(z)), z = c (x + a x^3): z's few roundings
    (its float32 constants, the cube, the sum and the product) within 4 u |c| (|x| + a |x|^3),
    moving tanh by at most (1 - t^2) times that; tanh within C_F u; 1 + t one rounding; x/2 times
    it one more, and one for the product: absolute, |x|/2 ((C_F + 1) u + (1 - t^2) 4 u |z|) + 2 u |g|."""
    c, a = (2 / torch.pi) ** 0.5, 0.044715
    z = c * (x + a * x.pow(3))
    t = torch.tanh(z)
    g = 0.5 * x * (1 + t)
    z_error = 4 * U * c * (x.abs() + a * x.abs().pow(3))
    return r(g, 0.5 * x.abs() * ((C_F + 1) * U + (1 - t * t) * z_error) + 2 * U * g.abs())


def _mul(a, b, r: _Roundings):
    """One rounding of the product."""
    y = a * b
    return r(y, U * y.abs())


@dataclass
class _Layer:
    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    window: int | None = None


def _f64(t):
    return None if t is None else t.detach().cpu().double()


def _split(t, sizes):
    return (None,) * len(sizes) if t is None else t.split(sizes)


@dataclass
class Logits:
    """Exact (float64) logits [..., V] and the bound [..., V] a float32 computation's error in
    them keeps to (a shared index takes both)."""
    exact: torch.Tensor
    bound: torch.Tensor

    def __getitem__(self, index) -> "Logits":
        return Logits(self.exact[index], self.bound[index])

    def check(self, got: torch.Tensor, msg: str = ""):
        """float32 logits of these positions within the bound of the exact ones."""
        assert_within(got.detach().cpu().double().reshape(self.exact.shape), self.exact, self.bound, msg)


def _estimate(run) -> tuple[torch.Tensor, ...]:
    """(exact results, their bounds) from run(roundings) -> tuple of tensors: each bound LAMBDA
    times the root-mean-square deviation of RUNS perturbed runs."""
    with _one_thread(), torch.no_grad():
        exact = run(_Roundings(None))
        squares = [torch.zeros_like(t) for t in exact]
        for seed in range(1, RUNS + 1):
            for acc, got, want in zip(squares, run(_Roundings(seed)), exact):
                acc += (got - want).pow(2)
    return exact, tuple(LAMBDA * (acc / RUNS).sqrt() for acc in squares)


class Float64Llama:
    """A Llama-family model (Llama, Mistral, Qwen2, Qwen3) evaluated in float64 on the weights of
    the model under test, with bounds on a float32 computation's error (module docstring).
    From transformers' model (`from_transformers`, checked against transformers' own float64
    forward of the same weights) or from this engine's model with dense matrices (`from_specengine`)."""

    def __init__(self, embed, layers, norm, lm_head, heads, kv_heads, head_dim, eps, rope_tables, cross_check=None):
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.rope_tables = rope_tables  # positions [T] -> the model's float32 (cos, sin) [T, D]
        self.cross_check = cross_check  # tokens -> float64 logits of the source's own forward, or None
        self._cache = {}

    @classmethod
    def from_transformers(cls, hf, cross_check: bool = True) -> "Float64Llama":
        config, body = hf.config, hf.model
        assert getattr(config, "hidden_act", "silu") == "silu", config.hidden_act
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        layers = []
        for layer in body.layers:
            a, mlp = layer.self_attn, layer.mlp
            q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
            layers.append(_Layer(
                _f64(layer.input_layernorm.weight), _f64(a.q_proj.weight), _f64(a.k_proj.weight),
                _f64(a.v_proj.weight), _f64(a.o_proj.weight), _f64(layer.post_attention_layernorm.weight),
                _f64(mlp.gate_proj.weight), _f64(mlp.up_proj.weight), _f64(mlp.down_proj.weight),
                _f64(a.q_proj.bias), _f64(a.k_proj.bias), _f64(a.v_proj.bias), _f64(a.o_proj.bias),
                _f64(mlp.gate_proj.bias), _f64(mlp.up_proj.bias), _f64(mlp.down_proj.bias),
                _f64(q_norm.weight) if q_norm is not None else None,
                _f64(k_norm.weight) if k_norm is not None else None,
                getattr(a, "sliding_window", getattr(config, "sliding_window", None))))

        def tables(positions):
            with torch.no_grad():
                cos, sin = body.rotary_emb(torch.zeros(1, dtype=torch.float32), positions[None])
            return cos[0], sin[0]

        def transformers_float64(tokens):
            hf64 = copy.deepcopy(hf).to(torch.float64)
            for module in hf64.modules():  # transformers' RMSNorm computes in float32 whatever the dtype
                if type(module).__name__.endswith("RMSNorm"):
                    module.forward = lambda h, m=module: m.weight * h * torch.rsqrt(
                        h.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)
            with torch.no_grad(), _one_thread():
                return hf64(torch.tensor([tokens])).logits[0]

        return cls(_f64(body.embed_tokens.weight), layers, _f64(body.norm.weight), _f64(hf.lm_head.weight),
                   heads, kv_heads, head_dim, config.rms_norm_eps, tables,
                   transformers_float64 if cross_check else None)

    @classmethod
    def from_specengine(cls, model) -> "Float64Llama":
        """This engine's LlamaForCausalLM with dense matrices (float32 or bfloat16), one process."""
        c = model.config
        assert model.tp is None and not model.stored_matrices and c.output_vocab_size is None
        sizes = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim)
        layers = []
        for layer in model.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            gate, up = _f64(mlp.gate_up_proj.weight).chunk(2)
            gate_bias, up_bias = _split(_f64(mlp.gate_up_proj.bias), (c.intermediate_size,) * 2)
            layers.append(_Layer(
                _f64(layer.input_layernorm.weight), *_f64(a.qkv_proj.weight).split(sizes), _f64(a.o_proj.weight),
                _f64(layer.post_attention_layernorm.weight), gate, up, _f64(mlp.down_proj.weight),
                *_split(_f64(a.qkv_proj.bias), sizes), _f64(a.o_proj.bias), gate_bias, up_bias,
                _f64(mlp.down_proj.bias), _f64(a.q_norm.weight) if a.q_norm is not None else None,
                _f64(a.k_norm.weight) if a.k_norm is not None else None, c.sliding_window))

        def tables(positions):
            cos, sin = model.rope_at(positions[None], int(positions.max()) + 1)
            return cos[0], sin[0]

        return cls(_f64(model.model.embed_tokens.weight), layers, _f64(model.model.norm.weight),
                   _f64(model.lm_head.weight), c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, tables)

    @classmethod
    def from_layer_weights(cls, w, heads: int, kv_heads: int, head_dim: int, eps: float,
                           window: int | None = None) -> "Float64Llama":
        """One layer (index 0, for `layer`) from ops.decoder_layer's DecoderLayerWeights with every
        matrix a dense tensor (a BlockMatrix dequantized first): no embedding, norm or head."""
        sizes = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        gate, up = _f64(w.gate_up).chunk(2)
        gate_bias, up_bias = _split(_f64(w.gate_up_bias), (w.gate_up.shape[0] // 2,) * 2)
        layer = _Layer(_f64(w.input_norm), *_f64(w.qkv).split(sizes), _f64(w.o), _f64(w.post_norm), gate, up,
                       _f64(w.down), *_split(_f64(w.qkv_bias), sizes), _f64(w.o_bias), gate_bias, up_bias,
                       _f64(w.down_bias), _f64(w.q_norm), _f64(w.k_norm), window)
        return cls(None, [layer], None, None, heads, kv_heads, head_dim, eps, None)

    def _layer(self, i, x, positions, cos, sin, table_error, keys, values, kv_len, terms, r):
        """Layer i on x [T, hidden] at positions [T]: k and v written into keys and values
        [>= kv_len, Hkv, D] (float64 copies of a cache row; positions past them not written),
        queries attending to keys j <= p, j < kv_len (and the window). Returns the new x."""
        L, T, D = self.layers[i], x.shape[0], self.head_dim
        h = _rms_norm(x, L.input_norm, self.eps, r)
        q, k, v = (_linear(h, w, b, terms, r).view(T, -1, D)
                   for w, b in ((L.q, L.q_bias), (L.k, L.k_bias), (L.v, L.v_bias)))
        if L.q_norm is not None:
            q, k = _rms_norm(q, L.q_norm, self.eps, r), _rms_norm(k, L.k_norm, self.eps, r)
        q, k = _rope(q, cos, sin, table_error, r), _rope(k, cos, sin, table_error, r)
        held = positions < keys.shape[0]
        keys[positions[held]], values[positions[held]] = k[held], v[held]
        key_pos = torch.arange(kv_len)
        visible = key_pos <= positions[:, None]
        if L.window is not None:
            visible &= key_pos > positions[:, None] - L.window
        o = _linear(_attention(q, keys[:kv_len], values[:kv_len], visible, D ** -0.5, r), L.o, L.o_bias, terms, r)
        x = _add(x, o, r)
        h = _rms_norm(x, L.post_norm, self.eps, r)
        gate, up = _linear(h, L.gate, L.gate_bias, terms, r), _linear(h, L.up, L.up_bias, terms, r)
        return _add(x, _linear(_silu_mul(gate, up, r), L.down, L.down_bias, terms, r), r)

    def _forward(self, tokens: list[int], terms: int, r: _Roundings, capture: tuple[int, ...] = ()):
        """The logits [T, V]; with capture, (the states entering the layers in capture side by side
        [T, len(capture) * hidden] (id num_layers: the last layer's output before the final norm),
        the final normed hidden [T, hidden], the logits)."""
        T = len(tokens)
        positions = torch.arange(T)
        cos32, sin32 = self.rope_tables(positions)
        cos, sin = cos32.double()[:, None, :], sin32.double()[:, None, :]  # [T, 1, D]
        table_error = rope_error(positions)[..., None]  # [T, 1, 1]: ours and the reference's tables
        x = self.embed[torch.tensor(tokens)]
        entering = {}
        for i in range(len(self.layers)):
            entering[i] = x
            keys = torch.zeros(T, self.kv_heads, self.head_dim, dtype=torch.float64)
            x = self._layer(i, x, positions, cos, sin, table_error, keys, torch.zeros_like(keys), T, terms, r)
        entering[len(self.layers)] = x
        final = _rms_norm(x, self.norm, self.eps, r)
        logits = _linear(final, self.lm_head, None, terms, r)
        if not capture:
            return logits
        return torch.cat([entering[i] for i in capture], -1), final, logits

    def states(self, tokens: list[int], capture: tuple[int, ...], terms: int = 1) -> tuple[Logits, Logits, Logits]:
        """Exact values and bounds of a forward's states (as capture_features captures them: the
        residual stream entering each layer id in capture, side by side [T, len(capture) *
        hidden]), of its final normed hidden [T, hidden] and of its logits [T, V]."""
        exact, spread = _estimate(lambda r: self._forward(list(tokens), terms, r, tuple(capture)))
        return tuple(Logits(e, b) for e, b in zip(exact, spread))

    def logits(self, tokens: list[int], terms: int = 1) -> Logits:
        """Exact logits [T, V] of the token sequence (positions 0..T-1) and the bound on a
        float32 forward's error in them (terms=3: products with x split in three bfloat16 terms,
        the AMX path). Cached."""
        key = (tuple(tokens), terms)
        if key not in self._cache:
            (exact,), (spread,) = _estimate(lambda r: (self._forward(list(tokens), terms, r),))
            if self.cross_check is not None:
                # This float64 forward is the model's: transformers' own float64 forward of the same
                # weights agrees to float64 rounding, far inside the bound (checked once a model).
                assert within(exact, self.cross_check(list(tokens)), 1e-3 * spread), \
                    "the float64 reference is not transformers' model"
                self.cross_check = None
            self._cache[key] = Logits(exact, spread)
        return self._cache[key]

    def layer(self, i: int, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              cache_k: torch.Tensor, cache_v: torch.Tensor, kv_len: int, terms: int = 1):
        """Layer i's exact results and bounds for rows x [B, T, hidden] at positions [B, T] over a
        cache (cache_k, cache_v [>= B, slots, Hkv, D], rows b < B written), the given float32 cos
        and sin [B, T, D] taken as exact inputs: ((out, cache_k, cache_v), (their bounds))."""
        def run(r):
            outs, ks, vs = [], cache_k.double().clone(), cache_v.double().clone()
            for b in range(x.shape[0]):
                c, s = cos[b].double()[:, None], sin[b].double()[:, None]
                outs.append(self._layer(i, x[b].double(), positions[b], c, s, 0.0, ks[b], vs[b], kv_len, terms, r))
            return torch.stack(outs), ks, vs
        return _estimate(run)

    def continuation_logits(self, prompt: list[int], continuation: list[int]) -> Logits:
        """Logits [len(continuation), V] of the positions that predict each token of the
        continuation of prompt (the token before it fed)."""
        start = len(prompt) - 1
        return self.logits(prompt + list(continuation[:-1]))[start:start + len(continuation)]


# ---- EAGLE-3 draft heads: the same, for one head's chain of drafts ------------------------------

class Float64Eagle3:
    """An EAGLE-3 head evaluated in float64 on the weights of its published layout (the
    computation specengine.models.eagle3's docstring describes, written here again from the
    format), with bounds on a float32 computation's error as Float64Llama's: the pairs (fc of the
    target's states at position p, the token after p) at positions p = 0..P-1, then a chain of
    draft steps, each pairing the head's output of the step before (before its final norm) with
    the token drafted there, at the next position, every query seeing every key at or before it."""

    def __init__(self, tensors: dict[str, torch.Tensor], embedding: torch.Tensor, heads: int, kv_heads: int,
                 head_dim: int, eps: float, inv_freq: torch.Tensor, prefix: str = "midlayer.",
                 norm_before_residual: bool = False):
        """tensors: the published names (the layer's under `prefix`: EAGLE's midlayer. or vLLM's
        layers.0.); embedding [V, H]: the one the head uses; inv_freq [head_dim / 2]: the rotary
        frequencies (float32, as the models take them); norm_before_residual: the layer's residual
        is the normed hidden (vLLM's option), else the hidden itself."""
        self.t = {k: _f64(v) for k, v in tensors.items() if v.is_floating_point()}
        self.embed = _f64(embedding)
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.inv_freq = inv_freq.float()
        self.prefix, self.norm_before_residual = prefix, norm_before_residual

    def _chain(self, features: torch.Tensor, tokens: list[int], chain: list[int], terms: int, r: _Roundings):
        t, L = self.t, lambda name: self.t[self.prefix + name]  # noqa: E731
        P, D = len(tokens), self.head_dim
        n = P + len(chain)
        positions = torch.arange(n)
        freqs = positions.float()[:, None] * self.inv_freq
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos().double()[:, None], emb.sin().double()[:, None]  # [n, 1, D]: float32 tables
        table_error = rope_error(positions)[..., None]
        fused = _linear(_f64(features), t["fc.weight"], None, terms, r)  # [P, H]
        keys = torch.zeros(n, self.kv_heads, D, dtype=torch.float64)
        values = torch.zeros_like(keys)
        outs, all_tokens = [], list(tokens) + list(chain)
        for p in range(n):  # one position a call: a chain step's hidden is the output before it
            hidden = fused[p:p + 1] if p < P else outs[-1]
            normed = _rms_norm(hidden, L("hidden_norm.weight"), self.eps, r)
            e = _rms_norm(self.embed[all_tokens[p]][None], L("input_layernorm.weight"), self.eps, r)
            x = torch.cat([e, normed], -1)
            q, k, v = (_linear(x, L(f"self_attn.{w}_proj.weight"), None, terms, r).view(1, -1, D) for w in "qkv")
            c, s_, te = cos[p:p + 1], sin[p:p + 1], table_error[p:p + 1]
            q, k = _rope(q, c, s_, te, r), _rope(k, c, s_, te, r)
            keys[p], values[p] = k[0], v[0]
            visible = torch.ones(1, p + 1, dtype=torch.bool)
            a = _linear(_attention(q, keys[:p + 1], values[:p + 1], visible, D ** -0.5, r),
                        L("self_attn.o_proj.weight"), None, terms, r)
            y = _add(normed if self.norm_before_residual else hidden, a, r)
            m = _rms_norm(y, L("post_attention_layernorm.weight"), self.eps, r)
            gate = _linear(m, L("mlp.gate_proj.weight"), None, terms, r)
            up = _linear(m, L("mlp.up_proj.weight"), None, terms, r)
            outs.append(_add(y, _linear(_silu_mul(gate, up, r), L("mlp.down_proj.weight"), None, terms, r), r))
        out = torch.cat(outs)  # every pair's, then each chain step's
        return out, _linear(_rms_norm(out, t["norm.weight"], self.eps, r), t["lm_head.weight"], None, terms, r)

    def chain_logits(self, features: torch.Tensor, tokens: list[int], chain: list[int], terms: int = 1) -> Logits:
        """Exact draft-vocabulary logits [1 + len(chain), Vd] and their bounds: the last pair's
        (features [P, F] float32 with tokens [P]) and each chain step's (chain: the tokens fed back)."""
        return self.outputs(features, tokens, chain, terms)[1][len(tokens) - 1:]

    def outputs(self, features: torch.Tensor, tokens: list[int], chain: list[int],
                terms: int = 1) -> tuple[Logits, Logits]:
        """Every position's output before the final norm [P + len(chain), H] and draft-vocabulary
        logits [P + len(chain), Vd], exact with their bounds (Logits of each)."""
        (out, logits), (out_spread, spread) = _estimate(lambda r: self._chain(features, tokens, chain, terms, r))
        return Logits(out, out_spread), Logits(logits, spread)


# ---- T5 encoder-decoder models: the same, for original T5 and v1.1 ------------------------------

@dataclass
class _T5Attention:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    norm: torch.Tensor


@dataclass
class _T5Block:
    self_attn: _T5Attention
    ff_norm: torch.Tensor
    wi: tuple[torch.Tensor, ...]  # (wi,) or gated (wi_0, wi_1)
    wo: torch.Tensor
    cross_attn: _T5Attention | None = None  # decoder blocks


class Float64T5:
    """A T5 encoder-decoder (original T5, v1.1 / Flan-T5) evaluated in float64 on transformers'
    weights, with bounds on a float32 computation's error as Float64Llama's (module docstring):
    the encoder, the decoder and the head carry every operation's simulated rounding, and the
    relative-position biases are exact inputs (a table lookup). Checked once against
    transformers' own float64 forward of the same weights."""

    def __init__(self, hf, cross_check: bool = True):
        from transformers.models.t5.modeling_t5 import T5Attention

        c = hf.config
        assert c.dense_act_fn in ("relu", "gelu_new"), c.dense_act_fn
        self.config, self.bucket = c, T5Attention._relative_position_bucket
        self.heads, self.d_kv, self.eps = c.num_heads, c.d_kv, c.layer_norm_epsilon
        self.gated, self.activation = c.is_gated_act, _relu if c.dense_act_fn == "relu" else _gelu_tanh
        self.scale_output = c.d_model ** -0.5 if c.scale_decoder_outputs else None
        self.start = c.decoder_start_token_id

        def attention(layer, attn):
            return _T5Attention(_f64(attn.q.weight), _f64(attn.k.weight), _f64(attn.v.weight), _f64(attn.o.weight),
                                _f64(layer.layer_norm.weight))

        def block(b):
            ff = b.layer[-1]
            dense = ff.DenseReluDense
            wi = (_f64(dense.wi_0.weight), _f64(dense.wi_1.weight)) if self.gated else (_f64(dense.wi.weight),)
            cross = attention(b.layer[1], b.layer[1].EncDecAttention) if len(b.layer) == 3 else None
            return _T5Block(attention(b.layer[0], b.layer[0].SelfAttention), _f64(ff.layer_norm.weight), wi,
                            _f64(dense.wo.weight), cross)

        self.embed, self.lm_head = _f64(hf.shared.weight), _f64(hf.lm_head.weight)
        self.encoder_blocks, self.decoder_blocks = [block(b) for b in hf.encoder.block], [block(b) for b in
                                                                                          hf.decoder.block]
        self.encoder_norm = _f64(hf.encoder.final_layer_norm.weight)
        self.decoder_norm = _f64(hf.decoder.final_layer_norm.weight)
        self.encoder_bias_table = _f64(hf.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight)
        self.decoder_bias_table = _f64(hf.decoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight)
        self.hf = hf if cross_check else None
        self._cache = {}

    def _position_bias(self, table, queries: int, keys: int, bidirectional: bool) -> torch.Tensor:
        """[H, queries, keys]: the bias of key j for query i, by the bucket of j - i."""
        offsets = torch.arange(keys)[None, :] - torch.arange(queries)[:, None]
        buckets = self.bucket(offsets, bidirectional, self.config.relative_attention_num_buckets,
                              self.config.relative_attention_max_distance)
        return table[buckets].permute(2, 0, 1)

    def _attend(self, a: _T5Attention, x, memory, visible, bias, terms, r):
        """x + o(attention(q(norm x), k and v of memory (norm x itself when None)))."""
        h = _rms_norm(x, a.norm, self.eps, r)
        source = h if memory is None else memory
        q = _linear(h, a.q, None, terms, r).view(len(h), self.heads, self.d_kv)
        k, v = (_linear(source, w, None, terms, r).view(len(source), self.heads, self.d_kv) for w in (a.k, a.v))
        return _add(x, _linear(_attention(q, k, v, visible, 1.0, r, bias), a.o, None, terms, r), r)

    def _feed_forward(self, b: _T5Block, x, terms, r):
        h = _rms_norm(x, b.ff_norm, self.eps, r)
        if self.gated:
            h = _mul(self.activation(_linear(h, b.wi[0], None, terms, r), r), _linear(h, b.wi[1], None, terms, r), r)
        else:
            h = self.activation(_linear(h, b.wi[0], None, terms, r), r)
        return _add(x, _linear(h, b.wo, None, terms, r), r)

    def _encode(self, source: list[int], terms: int, r: _Roundings) -> torch.Tensor:
        """The encoder's output [S, d_model] (after its final norm)."""
        S = len(source)
        x = self.embed[torch.tensor(source)]
        everything = torch.ones(S, S, dtype=torch.bool)
        bias = self._position_bias(self.encoder_bias_table, S, S, True)
        for b in self.encoder_blocks:
            x = self._feed_forward(b, self._attend(b.self_attn, x, None, everything, bias, terms, r), terms, r)
        return _rms_norm(x, self.encoder_norm, self.eps, r)

    def _forward(self, source: list[int], decoder: list[int], terms: int, r: _Roundings) -> torch.Tensor:
        S, T = len(source), len(decoder)
        memory = self._encode(source, terms, r)
        y = self.embed[torch.tensor(decoder)]
        causal = torch.arange(T)[None, :] <= torch.arange(T)[:, None]
        bias = self._position_bias(self.decoder_bias_table, T, T, False)
        sees_source = torch.ones(T, S, dtype=torch.bool)
        for b in self.decoder_blocks:
            y = self._attend(b.self_attn, y, None, causal, bias, terms, r)
            y = self._feed_forward(b, self._attend(b.cross_attn, y, memory, sees_source, None, terms, r), terms, r)
        y = _rms_norm(y, self.decoder_norm, self.eps, r)
        if self.scale_output is not None:
            y = y * self.scale_output
            y = r(y, U * y.abs())
        return _linear(y, self.lm_head, None, terms, r)

    def _transformers_float64(self, source: list[int], decoder: list[int]) -> torch.Tensor:
        hf64 = copy.deepcopy(self.hf).to(torch.float64)
        for module in hf64.modules():  # T5LayerNorm takes its mean of squares in float32 whatever the dtype
            if type(module).__name__ == "T5LayerNorm":
                module.forward = lambda h, m=module: m.weight * h * torch.rsqrt(
                    h.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)
        with torch.no_grad(), _one_thread():
            return hf64(input_ids=torch.tensor([source]), decoder_input_ids=torch.tensor([decoder])).logits[0]

    def encoded(self, source: list[int], terms: int = 1) -> Logits:
        """The encoder's exact output [len(source), d_model] and the bound on a float32 forward's
        error in it (terms as in logits)."""
        (exact,), (spread,) = _estimate(lambda r: (self._encode(list(source), terms, r),))
        return Logits(exact, spread)

    def logits(self, source: list[int], decoder: list[int], terms: int = 1) -> Logits:
        """Exact logits [len(decoder), V] of the decoder tokens (the start token first) given the
        encoder's source tokens, and the bound on a float32 forward's error in them (terms=3:
        products with x split in three bfloat16 terms, the AMX path). Cached."""
        key = (tuple(source), tuple(decoder), terms)
        if key not in self._cache:
            (exact,), (spread,) = _estimate(lambda r: (self._forward(list(source), list(decoder), terms, r),))
            if self.hf is not None:
                # transformers' float64 forward agrees to float64 rounding, far inside the bound
                assert within(exact, self._transformers_float64(list(source), list(decoder)), 1e-3 * spread), \
                    "the float64 reference is not transformers' T5"
                self.hf = None
            self._cache[key] = Logits(exact, spread)
        return self._cache[key]

    def continuation_logits(self, prompt: list[int], continuation: list[int]) -> Logits:
        """Logits [len(continuation), V] of the decoder positions that predict each token of a
        continuation of the encoder's prompt (the decoder fed the start token, then the
        continuation's tokens before it)."""
        return self.logits(prompt, [self.start] + list(continuation[:-1]))[:len(continuation)]


def t5_block_bounds(x, w, heads: int, head_dim: int, activation: str, gated: bool, eps: float, positions,
                    cache_k, cache_v, kv_len: int, bias_table, source_last, cross_k, cross_v, terms: int = 1):
    """ops.decoder_layer's t5_decoder_block on rows x [B, T, hidden] at positions [B, T], its weights
    w (T5BlockWeights, bfloat16 or float32 matrices) exact inputs, as are the caches' entries, the
    bias table and the encoder's keys and values: ((out, cache_k, cache_v), (their bounds)) as
    Float64T5's (module docstring). Self-attention: k and v written at positions (clamped to the
    spill slot), keys j <= p, j < kv_len, scores + bias_table[p - j]; cross-attention: encoder keys
    0..source_last; all unscaled."""
    act = {"relu": _relu, "gelu_new": _gelu_tanh}[activation]
    HD = heads * head_dim
    wq, wk, wv = _f64(w.qkv).split(HD)
    wi = _f64(w.wi).chunk(2) if gated else (_f64(w.wi),)
    norms = [_f64(t) for t in (w.self_norm, w.cross_norm, w.ff_norm)]
    self_o, cross_q, cross_o, wo, table = (_f64(t) for t in (w.self_o, w.cross_q, w.cross_o, w.wo, bias_table))
    B, T, _ = x.shape

    def run(r):
        outs, ks, vs = [], cache_k.double().clone(), cache_v.double().clone()
        for b in range(B):
            pos, y = positions[b], x[b].double()
            h = _rms_norm(y, norms[0], eps, r)
            q, k, v = (_linear(h, m, None, terms, r).view(T, heads, head_dim) for m in (wq, wk, wv))
            slots = pos.clamp(max=ks.shape[1] - 1)
            ks[b, slots], vs[b, slots] = k, v
            key_pos = torch.arange(kv_len)
            bias = table[(pos[:, None] - key_pos).clamp(min=0)].permute(2, 0, 1)  # [H, T, kv_len]
            attended = _attention(q, ks[b, :kv_len], vs[b, :kv_len], key_pos <= pos[:, None], 1.0, r, bias)
            y = _add(y, _linear(attended, self_o, None, terms, r), r)
            h = _rms_norm(y, norms[1], eps, r)
            cq = _linear(h, cross_q, None, terms, r).view(T, heads, head_dim)
            S = int(source_last[b].max()) + 1  # encoder entries past every query's last are never read
            seen = torch.arange(S) <= source_last[b][:, None]
            attended = _attention(cq, _f64(cross_k[b, :S]), _f64(cross_v[b, :S]), seen, 1.0, r)
            y = _add(y, _linear(attended, cross_o, None, terms, r), r)
            h = _rms_norm(y, norms[2], eps, r)
            if gated:
                h = _mul(act(_linear(h, wi[0], None, terms, r), r), _linear(h, wi[1], None, terms, r), r)
            else:
                h = act(_linear(h, wi[0], None, terms, r), r)
            outs.append(_add(y, _linear(h, wo, None, terms, r), r))
        return torch.stack(outs), ks, vs
    return _estimate(run)


# ---- warped probabilities --------------------------------------------------------------------

def warp_error_bound(logits: torch.Tensor, temperature: float, probs: torch.Tensor) -> torch.Tensor:
    """Bound [V] (float64) on |sampling.warp.warp_probs's float32 probabilities - exact| for one
    row: logits [V] float32 (exact inputs), temperature the exact value (the engine is given it
    rounded to float32), probs [V] the exact warped probabilities (float64; zero where the filters
    drop a token). It bounds the values where the float32 filters keep the same tokens as the
    exact ones; a filter's decision within rounding of its threshold differs by a whole
    probability, which no bound on the values covers. A greedy row (temperature 0) is an exact
    one-hot: bound 0.

    The float32 operations, for the exact z = (x - max x) / T, w = exp(z), q = w / sum_kept w:
    z's shift by the row max and its division by T are one rounding each, and T itself is
    rounded to float32: z within gamma(3) |z|. The softmax's own max subtraction is exact (the
    row max of z is 0). exp adds C_F u, and moves by exp(z) dz with z's error: w_i within
    a_i = C_F u + gamma(3) |z_i| of exact, relative. The softmax divides by the total S of its
    terms (a division, or a reciprocal and a product: 2 u), S one number for the row whatever its
    own rounding; the filters only zero entries; the renormalisation divides again by P, the sum
    of the kept p_j (up to V terms in any order: gamma(V - 1)), then one division (u). S cancels
    between the two divisions, so, first order (as the module's single operations),
        |q32_i - q_i| <= q_i (a_i + sum_j q_j a_j + 2 u + 2 u + gamma(V - 1) + u).
    Underflow adds at most 2^-126 to w_i (then divided by sum_kept w >= 1: the top token's
    w is exp(0) = 1), to p_i and to each of P's terms (P >= the top token's 1 / S >= 1 / V, so
    each counts up to V times, and P's relative error times q_i <= 1), and to q_i: at most
    (V + 1)^2 2^-126 in all, absolute.
    """
    V = logits.shape[-1]
    if temperature == 0:
        return torch.zeros(V, dtype=torch.float64)
    x = logits.detach().cpu().double()
    q = probs.detach().cpu().double()
    z = (x - x.amax()) / temperature
    a = C_F * U + gamma(3) * torch.where(q > 0, z.abs(), 0.0)  # dropped tokens: -inf, and 0 either way
    relative = a + (q * a).sum() + 5 * U + gamma(max(V - 1, 0))
    return q * relative + (V + 1) ** 2 * UNDERFLOW


# ---- tokens across different arithmetic ------------------------------------------------------

def certain_argmax(logits: Logits) -> torch.Tensor:
    """[T] bool: whether every float32 computation within the bound takes the exact argmax at each
    position (the top exact logit less its bound above every other logit plus its bound)."""
    top = logits.exact.argmax(-1, keepdim=True)
    low = (logits.exact - logits.bound).gather(-1, top)
    others = (logits.exact + logits.bound).scatter(-1, top, float("-inf"))
    return (low > others.amax(-1, keepdim=True))[:, 0]


def assert_greedy_tokens_agree(got: list[int], want: list[int], reference: Float64Llama | Float64T5,
                               prompt: list[int], min_certain: int = 1) -> int:
    """Greedy continuations of `prompt` by two float32 computations (ours and another's) take the
    exact argmax wherever it is certain (certain_argmax), and are equal up to their first
    difference, which may only come where it is not: there the top exact logits lie within the
    bounds of each other, either computation may rightly take any of them (each token must be
    one that can reach the top), and from then on the two go different ways. The first
    min_certain positions must be certain ones (a property of the exact logits, the same on
    every machine), so the check is never empty. Returns how many tokens were compared."""
    n = min(len(got), len(want))
    logits = reference.continuation_logits(prompt, want[:n])
    certain = certain_argmax(logits)
    leading = int(certain.long().cumprod(0).sum())
    assert leading >= min(min_certain, n), (f"a near tie of the exact logits at token {leading}: fewer than "
                                             f"{min_certain} tokens can be compared on every machine")
    for t in range(n):
        best = int(logits.exact[t].argmax())
        if got[t] != want[t]:
            reach = logits.exact[t] + logits.bound[t] >= logits.exact[t, best] - logits.bound[t, best]
            assert not certain[t], (f"token {t} of {n}: {got[t]} against {want[t]}, where the exact argmax {best} "
                                    f"is certain under the float32 bound (got {got}, want {want})")
            assert reach[got[t]] and reach[want[t]], (f"token {t}: {got[t]} and {want[t]} at a near tie, "
                                                     f"not both among its candidates {reach.nonzero()[:, 0].tolist()}")
            return t
        assert not certain[t] or got[t] == best, (f"token {t} of {n}: both {got[t]}, where the exact argmax {best} "
                                                  f"is certain under the float32 bound")
    assert len(got) == len(want), f"{len(got)} tokens against {len(want)}: {got} != {want}"
    return n


# Seeded sampling: the decisions at a position (speculative sampling, Leviathan et al.; the
# engine's sampling/verify.py and drafters/model.py) use the uniforms of (seed, position, stream);
# each compares a uniform with a function of the warped probabilities. A logit moved by at most
# its bound B_j moves log p_j by d_j - sum_i p_i d_i, |d_j| <= B_j / T (first order), so each
# such function moves by at most the envelopes below: a decision can differ between two
# computations within the bound only if its uniform lies within that of its threshold
# ("fragile"). The engine's float32 sums over V probabilities add up to gamma(V) more.

def _warp(logits: torch.Tensor, params) -> torch.Tensor:
    """The warped probabilities [V] (float64) of float64 logits, as sampling/warp.py defines them."""
    from specengine.sampling.warp import warp_probs

    one = lambda v, dtype: torch.tensor([v], dtype=dtype)  # noqa: E731
    return warp_probs(logits[None].float(), one(params.temperature, torch.float32), one(params.top_k, torch.int64),
                      one(params.top_p, torch.float32), one(params.min_p, torch.float32))[0].double()


def _moves(p: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Bound [V] on |d p_j| for probabilities p whose logits move by up to eps (in units of T)."""
    return p * (eps + (p * eps).sum())


def _cdf_moves(p: torch.Tensor, moves: torch.Tensor) -> torch.Tensor:
    """Bound [V] on how far each partial sum of p / sum(p) moves when each p_j moves by up to
    moves_j: (1 - c_k) sum_{j <= k} moves_j + c_k sum_{j > k} moves_j, over sum(p)."""
    total = p.sum()
    c = p.cumsum(0) / total
    left = moves.cumsum(0)
    return ((1 - c) * left + c * (moves.sum() - left)) / total


def _sample_is_fragile(p: torch.Tensor, moves: torch.Tensor, u: float) -> bool:
    """Whether inverse-CDF sampling of p (unnormalised, >= 0) with u can change when each p_j
    moves by up to moves_j (and the float32 partial sums by gamma(V))."""
    c = p.cumsum(0) / p.sum()
    return bool(((c - u).abs() <= _cdf_moves(p, moves) + gamma(len(p))).any())


def _warp_is_fragile(logits: Logits, params) -> bool:
    """Whether a filter (top_k, top_p, min_p) can keep other tokens for logits within the bound."""
    T = params.temperature
    scaled, eps = logits.exact / T, logits.bound / T
    ordered = scaled.argsort(descending=True)
    k = params.top_k
    if 0 < k < len(scaled):
        kth, next_ = ordered[k - 1], ordered[k]
        if scaled[kth] - eps[kth] <= scaled[next_] + eps[next_]:
            return True
    kept = scaled.masked_fill(scaled < scaled[ordered[k - 1]], float("-inf")) if 0 < k < len(scaled) else scaled
    probs = kept.softmax(0)
    moves = _moves(probs, eps)
    if params.top_p < 1:
        order = probs.argsort(descending=True)
        sorted_probs, sorted_moves = probs[order], moves[order]
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        reach = _cdf_moves(sorted_probs, sorted_moves) + sorted_moves + gamma(len(probs))
        if ((mass_before - params.top_p).abs() <= reach).any():
            return True
    if params.min_p > 0:
        top = int(probs.argmax())
        threshold = params.min_p * probs[top]
        reach = moves + params.min_p * moves[top] + gamma(len(probs)) * probs
        if (((probs - threshold).abs() <= reach) & (probs > 0)).any():
            return True
    return False


def seeded_step_is_fragile(prefix: list[int], params, seed: int, target: Float64Llama,
                           draft: Float64Llama | None) -> bool:
    """Whether the token at position len(prefix) of a seeded request may rightly differ between two
    float32 computations within the bound: a warp's filter, the target's own sample
    (STREAM_SAMPLE: target-only decoding or a bonus token), or with a draft model its sample
    (STREAM_DRAFT), the acceptance test of that draft (STREAM_ACCEPT) or the residual sample after
    a rejection, lies within the bound's reach of its threshold."""
    from specengine.sampling.rng import STREAM_ACCEPT, STREAM_DRAFT, STREAM_SAMPLE, uniforms_reference

    def uniform(stream):
        return float(uniforms_reference(torch.tensor([seed]), torch.tensor([[len(prefix)]]), stream)[0, 0])

    p_logits = target.logits(prefix)[len(prefix) - 1]
    p = _warp(p_logits.exact, params)
    p_moves = _moves(p, p_logits.bound / params.temperature)
    if _warp_is_fragile(p_logits, params) or _sample_is_fragile(p, p_moves, uniform(STREAM_SAMPLE)):
        return True
    if draft is None:
        return False
    q_logits = draft.logits(prefix)[len(prefix) - 1]
    q = _warp(q_logits.exact, params)
    q_moves = _moves(q, q_logits.bound / params.temperature)
    u_draft = uniform(STREAM_DRAFT)
    if _warp_is_fragile(q_logits, params) or _sample_is_fragile(q, q_moves, u_draft):
        return True
    x = int((q.cumsum(0) <= u_draft * q.sum()).sum().clamp(max=len(q) - 1))  # the draft token
    u_accept, slack = uniform(STREAM_ACCEPT), gamma(len(p))
    if abs(u_accept * q[x] - p[x]) <= p_moves[x] + u_accept * q_moves[x] + slack * (p[x] + q[x]):
        return True
    residual = (p - q).clamp(min=0)
    r_moves = p_moves + q_moves + slack * (p + q)
    return bool(residual.sum() <= r_moves.sum()) or _sample_is_fragile(residual, r_moves, uniform(STREAM_SAMPLE))


def assert_tokens_agree(got: list[int], want: list[int], prompt: list[int], params, target: Float64Llama,
                        draft: Float64Llama | None = None, seed: int | None = None, min_compared: int = 1) -> int:
    """Two float32 computations' tokens for one request (SamplingParams `params`): greedy ones by
    assert_greedy_tokens_agree; seeded ones token for token up to the first difference, which
    must fall where the decision is fragile (seeded_step_is_fragile), after which the two may
    rightly go different ways. Returns how many tokens were compared."""
    if params.temperature == 0:
        return assert_greedy_tokens_agree(got, want, target, prompt, min_compared)
    seed = params.seed if seed is None else seed
    for t, (a, b) in enumerate(zip(got, want)):
        if a != b:
            assert seeded_step_is_fragile(prompt + want[:t], params, seed, target, draft), (
                f"token {t}: {a} against {b}, where no seeded decision is within the float32 bound of its "
                f"threshold (got {got}, want {want})")
            assert t >= min(min_compared, len(want)), f"only {t} tokens could be compared"
            return t
    assert len(got) == len(want), f"{len(got)} tokens against {len(want)}: {got} != {want}"
    return len(want)
