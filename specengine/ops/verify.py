"""The verify step's host wrapper: validates, allocates and dispatches to one implementation.

  "cpp"        specengine._C.verify, fused C++ on CPU tensors (OpenMP over rows)
  "triton"     specengine.kernels.verify, fused Triton on CUDA tensors
  "reference"  specengine.sampling.verify.verify_reference, plain torch (the oracle)
  "auto"       cpp on CPU, triton on CUDA

All three share one contract (see verify_reference): given the same uniforms they emit the
same tokens, except where a uniform lies within float rounding of a decision boundary.
"""
from __future__ import annotations

from typing import NoReturn

import torch

from ..sampling.rng import STREAM_ACCEPT, STREAM_SAMPLE, uniforms
from ..sampling.verify import verify_reference

IMPLEMENTATIONS = ("auto", "cpp", "triton", "reference")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _fail(message: str) -> NoReturn:
    raise ValueError(f"verify: {message}")


def verify(
    target_logits: torch.Tensor,        # [B, G+1, V] float32 / bfloat16 / float16, last dim contiguous
    draft_logits: torch.Tensor | None,  # [B, G, V] same dtype, or None for one-hot drafts
    draft_tokens: torch.Tensor,         # [B, G] int64
    num_drafts: torch.Tensor,           # [B] int64 in [0, G]
    temperature: torch.Tensor,          # [B] float32, 0 = greedy
    top_k: torch.Tensor,                # [B] int64, 0 = off
    top_p: torch.Tensor,                # [B] float32, 1 = off
    min_p: torch.Tensor,                # [B] float32, 0 = off
    seeds: torch.Tensor,                # [B] int64, Philox keys
    positions: torch.Tensor,            # [B] int64, absolute position of each row's first token this round
    *,
    u_accept: torch.Tensor | None = None,        # [B, G+1] float32: explicit uniforms instead of Philox
    u_sample: torch.Tensor | None = None,        # [B, G+1] float32
    target_lengths: torch.Tensor | None = None,  # [B] int64, advanced in place by the emitted count
    draft_lengths: torch.Tensor | None = None,   # [B] int64, set in place to min(itself, new target length)
    impl: str = "auto",
    filters: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Emitted tokens [B, G+1] int64 (-1 after each row's end) and their count [B] int64.

    filters=False promises that no row uses top-k, top-p or min-p (SamplingBatch.filters knows
    it from the host's parameters): the Triton kernel then skips their passes, and reads only
    the temperature. The other implementations need no such promise and ignore it."""
    # Every condition is tested before its message is built: formatting the ~50 messages on every
    # call costs more than the C++ step itself (measured: see bench/results/host-overheads-2026-11-29-to-12-03.md).
    if impl not in IMPLEMENTATIONS:
        _fail(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    if target_logits.dim() != 3:
        _fail(f"target_logits must be [B, G+1, V], got {tuple(target_logits.shape)}")
    B, G1, V = target_logits.shape
    G = G1 - 1
    device = target_logits.device
    if not (B >= 1 and G1 >= 1 and V >= 1):
        _fail(f"empty target_logits {tuple(target_logits.shape)}")
    if target_logits.dtype not in _DTYPE_CODES:
        _fail(f"logits dtype {target_logits.dtype} is not supported")
    if target_logits.stride(-1) != 1:
        _fail("target_logits must be contiguous in the vocabulary dimension")
    if draft_logits is not None:
        if draft_logits.shape != (B, G, V):
            _fail(f"draft_logits must be [{B}, {G}, {V}], got {tuple(draft_logits.shape)}")
        if draft_logits.dtype != target_logits.dtype:
            _fail("draft and target logits must share a dtype")
        if draft_logits.stride(-1) != 1:
            _fail("draft_logits must be contiguous in the vocabulary dimension")
    for name, t, shape, dtype in (("draft_tokens", draft_tokens, (B, G), torch.int64),
                                  ("num_drafts", num_drafts, (B,), torch.int64),
                                  ("temperature", temperature, (B,), torch.float32),
                                  ("top_k", top_k, (B,), torch.int64), ("top_p", top_p, (B,), torch.float32),
                                  ("min_p", min_p, (B,), torch.float32), ("seeds", seeds, (B,), torch.int64),
                                  ("positions", positions, (B,), torch.int64),
                                  ("u_accept", u_accept, (B, G1), torch.float32),
                                  ("u_sample", u_sample, (B, G1), torch.float32),
                                  ("target_lengths", target_lengths, (B,), torch.int64),
                                  ("draft_lengths", draft_lengths, (B,), torch.int64)):
        if t is None:
            continue
        if t.shape != shape:
            _fail(f"{name} must be {list(shape)}, got {list(t.shape)}")
        if t.dtype != dtype:
            _fail(f"{name} must be {dtype}, got {t.dtype}")
        if t.device != device:
            _fail(f"{name} is on {t.device} but the logits are on {device}")
        if not t.is_contiguous():
            _fail(f"{name} must be contiguous")
    if (u_accept is None) != (u_sample is None):
        _fail("pass both u_accept and u_sample, or neither")
    if draft_lengths is not None and target_lengths is None:
        _fail("draft_lengths needs target_lengths")

    if impl == "auto":
        impl = "triton" if device.type == "cuda" else "cpp"
    if impl == "cpp":
        if device.type != "cpu":
            _fail(f"the C++ implementation runs on CPU tensors, got {device}")
        return _verify_cpp(target_logits, draft_logits, draft_tokens, num_drafts, temperature, top_k, top_p, min_p,
                           seeds, positions, u_accept, u_sample, target_lengths, draft_lengths)
    if impl == "triton":
        from ..kernels.verify import verify_triton

        return verify_triton(target_logits, draft_logits, draft_tokens, num_drafts, temperature, top_k, top_p,
                             min_p, seeds, positions, u_accept, u_sample, target_lengths, draft_lengths, filters)
    if u_accept is None:
        steps = positions[:, None] + torch.arange(G1, device=device)
        u_accept, u_sample = uniforms(seeds, steps, STREAM_ACCEPT), uniforms(seeds, steps, STREAM_SAMPLE)
    emitted, counts = verify_reference(target_logits, draft_logits, draft_tokens, num_drafts, temperature, top_k,
                                       top_p, min_p, u_accept, u_sample)
    if target_lengths is not None:
        target_lengths.add_(counts)
        if draft_lengths is not None:
            torch.minimum(draft_lengths, target_lengths, out=draft_lengths)
    return emitted, counts


def sample_warped(
    logits: torch.Tensor,       # [B, V] float32 / bfloat16 / float16, last dim contiguous
    temperature: torch.Tensor,  # [B] float32, 0 = greedy
    top_k: torch.Tensor,        # [B] int64, 0 = off
    top_p: torch.Tensor,        # [B] float32, 1 = off
    min_p: torch.Tensor,        # [B] float32, 0 = off
    u: torch.Tensor,            # [B] float32 in [0, 1), the inverse-CDF uniform of each row
    impl: str = "auto",
    filters: bool = True,       # as verify's
) -> torch.Tensor:
    """One token per row [B] int64 from the warped distribution, as
    sample_from_probs(warp_probs(logits, ...), u): a drafter's step.

    It is the verify step of a round without drafts (whose one token is drawn from p with
    u_sample), so it runs on the same fused kernels. Callers build the arguments themselves
    (drafters, each step): only the shapes are checked here.
    """
    if logits.dim() != 2 or u.shape != logits.shape[:1]:
        _fail(f"need logits [B, V] and u [B], got {tuple(logits.shape)} and {tuple(u.shape)}")
    if logits.stride(1) != 1:
        _fail("logits must be contiguous in the vocabulary dimension")
    if logits.dtype not in _DTYPE_CODES:
        _fail(f"logits dtype {logits.dtype} is not supported")
    if impl == "auto":
        impl = "triton" if logits.device.type == "cuda" else "cpp"
    if impl == "cpp":
        return _sample_warped_cpp(logits, temperature, top_k, top_p, min_p, u)
    if impl == "reference":
        from ..sampling.warp import sample_from_probs, warp_probs

        return sample_from_probs(warp_probs(logits, temperature, top_k, top_p, min_p), u)
    B = logits.shape[0]
    no_drafts = torch.zeros(B, 0, dtype=torch.int64, device=logits.device)
    draft_counts = torch.zeros(B, dtype=torch.int64, device=logits.device)
    u = u.to(torch.float32).reshape(B, 1).contiguous()
    emitted, _ = verify(logits[:, None], None, no_drafts, draft_counts, temperature, top_k, top_p, min_p,
                        draft_counts, draft_counts, u_accept=u, u_sample=u, impl=impl, filters=filters)
    return emitted[:, 0]


_HOST_ZEROS = torch.zeros(64, dtype=torch.int64)  # read-only (see _sample_warped_cpp)


def _sample_warped_cpp(logits, temperature, top_k, top_p, min_p, u) -> torch.Tensor:
    """sample_warped on the C++ verify step, called with G = 0 and without building a round's
    tensors: building them would cost several times the kernel's own work (measured: see
    bench/results/host-overheads-2026-11-29-to-12-03.md). The kernel only reads num_drafts, seeds
    and positions (zeros here, shared) and writes nothing but emitted and its count."""
    from .. import _C

    global _HOST_ZEROS
    B, V = logits.shape
    if _HOST_ZEROS.numel() < B:
        _HOST_ZEROS = torch.zeros(B, dtype=torch.int64)
    zeros = _HOST_ZEROS.data_ptr()
    if u.dtype != torch.float32 or not u.is_contiguous():
        u = u.to(torch.float32).contiguous()
    emitted, counts = torch.empty(B, dtype=torch.int64), torch.empty(B, dtype=torch.int64)
    _C.verify(logits.data_ptr(), 0, _DTYPE_CODES[logits.dtype], B, 0, V, logits.stride(0), 0, 0, 0, zeros, zeros,
              temperature.data_ptr(), top_k.data_ptr(), top_p.data_ptr(), min_p.data_ptr(), zeros, zeros,
              u.data_ptr(), u.data_ptr(), emitted.data_ptr(), counts.data_ptr(), 0, 0)
    return emitted


def _verify_cpp(target_logits, draft_logits, draft_tokens, num_drafts, temperature, top_k, top_p, min_p, seeds,
                positions, u_accept, u_sample, target_lengths, draft_lengths):
    from .. import _C

    B, G1, V = target_logits.shape
    emitted = torch.empty(B, G1, dtype=torch.int64)
    counts = torch.empty(B, dtype=torch.int64)
    address = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    d_stride = (draft_logits.stride(0), draft_logits.stride(1)) if draft_logits is not None else (0, 0)
    _C.verify(address(target_logits), address(draft_logits), _DTYPE_CODES[target_logits.dtype], B, G1 - 1, V,
              target_logits.stride(0), target_logits.stride(1), *d_stride, address(draft_tokens),
              address(num_drafts), address(temperature), address(top_k), address(top_p), address(min_p),
              address(seeds), address(positions), address(u_accept), address(u_sample), address(emitted),
              address(counts), address(target_lengths), address(draft_lengths))
    return emitted, counts
