"""Fixed-shape model steps (draft steps, verifications) replayed from CUDA graphs.

A draft step of a small model is a few hundred tiny kernels: on a GPU its time is launch and
host overhead, not arithmetic. A CUDA graph launches them all at once. Graphs need fixed
shapes and addresses, so a step runs on static buffers:
  - the batch is padded up to a bucket (1, 2, 4, 8, ...); padding rows start at the cache's
    spill slot, where they write and no query reads;
  - attention spans the cache's whole capacity (positions past a row's length stay masked),
    instead of the longest row;
  - the cache is one preallocated StaticKVCache that every run reuses.
Each (bucket, tokens per row) is captured on first use, after two warm-up runs on a side
stream (lazy initialisation, Triton autotuning and allocations stay outside the graph).

On a CPU, or when capture fails (the reason goes to the log), the same static-shape path runs
eagerly: the bookkeeping is the same, so it is tested without a GPU.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..layers.kv_cache import StaticKVCache
from ..models.llama import LlamaForCausalLM

log = logging.getLogger("specengine")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def batch_bucket(batch_size: int, max_batch_size: int) -> int:
    """The smallest bucket holding batch_size rows; max_batch_size is a bucket of its own."""
    if not 1 <= batch_size <= max_batch_size:
        raise ValueError(f"batch of {batch_size} rows does not fit the {max_batch_size} rows the cache holds")
    return min([b for b in BATCH_BUCKETS if b >= batch_size] + [max_batch_size])


@dataclass
class _Step:
    tokens: torch.Tensor           # [bucket, T] int64 static input
    start: torch.Tensor            # [bucket] int64 static input
    logits: torch.Tensor | None    # [bucket, T, V] float32 static output (graphs), else None
    graph: "torch.cuda.CUDAGraph | None"


class StepGraphs:
    """A model's persistent cache (max_batch_size rows of `capacity` tokens, reused by every run)
    and its fixed-shape steps: logits [B, T, V] of tokens [B, T] at per-row start positions.

    use_graphs: capture CUDA graphs (default: when the model is on a CUDA device). The graphs
    of one StepGraphs share a memory pool of their own, so the draft's and the target's graphs
    never share memory; every call returns a fresh copy of the static output, so a later
    replay cannot overwrite what a caller kept.
    """

    def __init__(self, model: LlamaForCausalLM, max_batch_size: int, capacity: int, use_graphs: bool | None = None):
        on_cuda = model.device.type == "cuda"
        self.use_graphs = on_cuda if use_graphs is None else use_graphs
        if self.use_graphs and not on_cuda:
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.model = model
        self.cache = model.new_cache(max_batch_size, capacity)
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.fallback_reason: str | None = None
        self.steps: dict[tuple[int, int], _Step] = {}
        self.replays = 0  # calls served by a graph (tests and benchmarks read it)

    def new_batch(self, batch_size: int) -> StaticKVCache:
        """The persistent cache, emptied for a batch of batch_size rows."""
        self.cache.reset(batch_size)
        return self.cache

    def __call__(self, tokens: torch.Tensor, start_pos: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] int64, start_pos [B] int64 (each row's first position, its cache length)."""
        B, T = tokens.shape
        bucket = batch_bucket(B, self.cache.allocated_rows)
        step = self.steps.get((bucket, T)) or self._build(bucket, T)
        step.tokens[:B].copy_(tokens)
        step.start[:B].copy_(start_pos)
        if B < bucket:  # rows a larger batch used before: back to the spill slot
            step.start[B:].fill_(self.cache.capacity)
        if step.graph is None:
            return self._forward(step)[:B]
        step.graph.replay()
        self.replays += 1
        return step.logits[:B].clone()

    def _forward(self, step: _Step) -> torch.Tensor:
        hidden = self.model(step.tokens, step.start, self.cache, kv_len=self.cache.capacity)
        return self.model.logits(hidden)

    def _build(self, bucket: int, T: int) -> _Step:
        device = self.cache.k.device
        # Padding rows (and every warm-up run) start at the spill slot: their writes land where
        # no query reads, so they never touch a live cache entry.
        step = _Step(torch.zeros(bucket, T, dtype=torch.int64, device=device),
                     torch.full((bucket,), self.cache.capacity, dtype=torch.int64, device=device), None, None)
        self.steps[(bucket, T)] = step
        if self.use_graphs:
            try:
                step.logits, step.graph = self._capture(step)
            except Exception as exc:  # noqa: BLE001 (any capture failure means: run eagerly, and say why)
                self.use_graphs = False
                self.fallback_reason = f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graph capture failed (batch bucket %d, %d tokens per row); running eagerly: %s",
                            bucket, T, self.fallback_reason)
                for other in self.steps.values():
                    other.graph = other.logits = None
        return step

    def _capture(self, step: _Step):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(step)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(step)
        return logits, graph
