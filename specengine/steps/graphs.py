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
stream (lazy initialisation, Triton compilation and allocations stay outside the graph).
CapturedCalls is the general form: any function of static buffers, captured per key (the
drafter captures its whole draft phase this way).

On a CPU, or when capture fails (the reason goes to the log), the same static-shape path runs
eagerly: the bookkeeping is the same, so it is tested without a GPU.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..layers.kv_cache import StaticKVCache
from ..models.eagle3 import Eagle3Head
from ..models.llama import LlamaForCausalLM

log = logging.getLogger("specengine")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def batch_bucket(batch_size: int, max_batch_size: int) -> int:
    """The smallest bucket holding batch_size rows; max_batch_size is a bucket of its own."""
    if not 1 <= batch_size <= max_batch_size:
        raise ValueError(f"batch of {batch_size} rows does not fit the {max_batch_size} rows the cache holds")
    return min([b for b in BATCH_BUCKETS if b >= batch_size] + [max_batch_size])


@dataclass
class _Entry:
    buffers: dict[str, torch.Tensor]               # static inputs, filled by the caller before each run
    outputs: tuple[torch.Tensor, ...] | None = None  # static outputs of the captured graph
    graph: "torch.cuda.CUDAGraph | None" = None


class CapturedCalls:
    """Functions of static input buffers, each captured as a CUDA graph on its first run (per key)
    and replayed after. A key fixes the buffers' shapes; the caller fills them in place, then runs.

    The graphs of one CapturedCalls share a memory pool of their own (runs never overlap), apart
    from every other model's. Each replay returns copies of the static outputs, so a later replay
    cannot overwrite what a caller kept. With use_graphs off, or after a capture failed (the reason
    is logged and kept in fallback_reason), the functions run eagerly on the same buffers.
    """

    def __init__(self, use_graphs: bool):
        self.use_graphs = use_graphs
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.fallback_reason: str | None = None
        self.entries: dict[object, _Entry] = {}
        # Runs served by a replayed graph: part of what a CapturedCalls reports, as fallback_reason
        # is, so that a caller (a test, a benchmark) can tell its graphs really ran.
        self.replays = 0

    def buffers(self, key, make: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """key's static input buffers, made by make() on first use."""
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = _Entry(make())
        return entry.buffers

    def run(self, key, fn: Callable[..., tuple[torch.Tensor, ...]],
            state: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
        """fn(**key's buffers): the tensors it returns (copies when replayed from a graph).

        state: for a fn that updates its own buffers (and these tensors) in place, so that running
        it twice is not running it once (a round that writes the next round's inputs): the capture's
        warm-up runs are then undone, buffers and state restored, before the graph is captured."""
        entry = self.entries[key]
        if self.use_graphs and entry.graph is None:
            try:
                entry.outputs, entry.graph = self._capture(fn, entry.buffers, state)
            except Exception as exc:  # noqa: BLE001 (any capture failure means: run eagerly, and say why)
                self.use_graphs = False
                self.fallback_reason = f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graph capture failed (%s); running eagerly: %s", key, self.fallback_reason)
                for other in self.entries.values():
                    other.graph = other.outputs = None
        if entry.graph is None:
            return fn(**entry.buffers)
        entry.graph.replay()
        self.replays += 1
        return tuple(t.clone() for t in entry.outputs)

    @staticmethod
    def _warm_up(fn, buffers, state):
        """Two runs on the caller's inputs (any state they write, cache entries, is what the next
        run writes again); a stateful fn's buffers and state are then put back as they were
        (cache entries written past a row's length stay unread)."""
        saved = None if state is None else [(t, t.clone()) for t in (*buffers.values(), *state)]
        for _ in range(2):
            fn(**buffers)
        for tensor, copy in saved or ():
            tensor.copy_(copy)

    def _capture(self, fn, buffers, state):
        # The warm-ups run on a side stream: lazy initialisation, Triton compilation and
        # allocations stay out of the graph.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._warm_up(fn, buffers, state)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn(**buffers)
        return outputs, graph


class FixedShapeSteps:
    """A model's persistent cache (max_batch_size rows of `capacity` tokens, reused by every run)
    and its fixed-shape steps: logits [B, T, V] of tokens [B, T] at per-row start positions.

    use_graphs: capture CUDA graphs (default: when the model is on a CUDA device); `graphs` holds
    them, keyed (bucket, tokens per row). Other fixed-shape work on this model and cache (the
    drafter's whole draft phase) is captured in `graphs` too, under keys of its own.
    """

    def __init__(self, model: "LlamaForCausalLM | Eagle3Head", max_batch_size: int, capacity: int,
                 use_graphs: bool | None = None):
        on_cuda = model.device.type == "cuda"
        use_graphs = on_cuda if use_graphs is None else use_graphs
        if use_graphs and not on_cuda:
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.model = model
        self.cache = model.new_cache(max_batch_size, capacity, growable=False)  # graphs keep its addresses
        self.graphs = CapturedCalls(use_graphs)

    @property
    def use_graphs(self) -> bool:
        return self.graphs.use_graphs

    @property
    def fallback_reason(self) -> str | None:
        return self.graphs.fallback_reason

    @property
    def replays(self) -> int:
        return self.graphs.replays

    def new_batch(self, batch_size: int) -> StaticKVCache:
        """The persistent cache, emptied for a batch of batch_size rows (0: rows are added later)."""
        self.cache.reset(batch_size)
        return self.cache

    def bucket(self, batch_size: int) -> int:
        return batch_bucket(batch_size, self.cache.allocated_rows)

    def __call__(self, tokens: torch.Tensor, start_pos: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] int64, start_pos [B] int64 (each row's first position, its cache length).
        A model that captures features (LlamaForCausalLM.capture_features) has this call's in its
        `features` afterwards ([B, T, F]), replayed or not."""
        B, T = tokens.shape
        bucket, capacity, device = self.bucket(B), self.cache.capacity, tokens.device
        # A graph captured while the model captured no features returns none: one per capture set
        # (an engine measuring its costs may run before its runner sets the capture again).
        layers = getattr(self.model, "feature_layers", ())
        key = (bucket, T) + ((layers,) if layers else ())
        # Padding rows start at the spill slot: their writes land where no query reads, so they
        # never touch a live cache entry.
        buffers = self.graphs.buffers(key, lambda: dict(
            tokens=torch.zeros(bucket, T, dtype=torch.int64, device=device),
            start=torch.full((bucket,), capacity, dtype=torch.int64, device=device)))
        buffers["tokens"][:B].copy_(tokens)
        buffers["start"][:B].copy_(start_pos)
        if B < bucket:  # rows a larger batch used before: back to the spill slot
            buffers["start"][B:].fill_(capacity)
        logits, *features = self.graphs.run(key, self.forward)
        if features:  # a replay runs no Python: the model's attribute still names the capture's tensor
            self.model.features = features[0][:B]
        return logits[:B]

    def forward(self, tokens: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Logits [bucket, T, V] of a full bucket on the persistent cache (attention spans its
        capacity), and the features it captured [bucket, T, F] when the model captures some."""
        hidden = self.model(tokens, start, self.cache, kv_len=self.cache.capacity)
        features = (self.model.features,) if getattr(self.model, "feature_layers", ()) else ()
        return (self.model.logits(hidden), *features)
