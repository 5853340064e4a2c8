"""Tensor parallelism over torch.distributed (NCCL on GPUs, gloo on CPUs), Megatron-style.

A target split over N ranks holds on each rank: its share of the attention heads (q/k/v rows,
o_proj columns) and of the MLP's intermediate columns (gate/up rows, down_proj columns), one
all-reduce after o_proj and one after down_proj; a contiguous range of the vocabulary in the
embedding (looked up where the id falls in it, zeros elsewhere, then all-reduced) and in the head
(its logits all-gathered, so every rank sees the whole row). Norms are replicated. Collectives
return the same bits on every rank, so every rank computes the same logits and, from the same
Philox keys, emits the same tokens.
"""
from __future__ import annotations

import atexit
import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class TensorParallelError(ValueError):
    """A model cannot be split over the requested number of ranks, or the ranks disagree."""


@dataclass
class TensorParallel:
    """This process's place in a tensor-parallel group."""

    rank: int
    world_size: int
    device: torch.device = torch.device("cpu")  # where this backend's collectives take tensors
    group: dist.ProcessGroup | None = field(default=None, repr=False)  # None: the default group

    def __post_init__(self):
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise TensorParallelError(f"rank {self.rank} is not in a group of {self.world_size}")

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` units that must divide evenly (heads, intermediate columns)."""
        if total % self.world_size:
            raise TensorParallelError(f"{what} ({total}) is not divisible by tensor_parallel={self.world_size}")
        return total // self.world_size

    def vocab_range(self, vocab_size: int) -> tuple[int, int, int]:
        """(first id, ids held, rows per rank): ranks hold ceil(V / N) rows each, the last ones
        fewer real ids (its other rows stay zero and their logits are dropped after the gather)."""
        rows = -(-vocab_size // self.world_size)
        start = min(self.rank * rows, vocab_size)
        return start, min(rows, vocab_size - start), rows

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[..., rows] per rank -> [..., vocab_size] (rank order), the same on every rank."""
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., :vocab_size]

    def broadcast_int(self, value: int) -> int:
        """Rank 0's value on every rank: for choices made from timings, which differ by rank."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0, group=self.group)
        return int(t)

    def check_same(self, x: torch.Tensor, what: str):
        """Raise TensorParallelError unless x is bit-identical on every rank (a debug check)."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        differing = [r for r, part in enumerate(parts) if not torch.equal(part, parts[0])]
        if differing:
            raise TensorParallelError(f"{what} differ between ranks: rank 0 has {parts[0].tolist()}, "
                                      f"rank {differing[0]} has {parts[differing[0]].tolist()}")


def _close_process_group():
    """At exit, after every rank is done, take down the group this module set up. Left to the
    interpreter's teardown, a gloo rank whose peer had already exited was sometimes aborted
    ("terminate called without an active exception") after its output was complete."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "gloo":  # a barrier that gives up (NCCL's would wait for a dead peer forever)
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
        except RuntimeError:  # a rank that failed: nothing to wait for
            pass
    dist.destroy_process_group()


def init_tensor_parallel(world_size: int, device: str | torch.device) -> tuple[TensorParallel, torch.device]:
    """The tensor-parallel group of this process and its device. Inside an initialised process
    group that group is used (its size must be world_size); otherwise one is initialised from
    torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), NCCL for CUDA and gloo
    for CPU. On CUDA each rank takes the GPU of its LOCAL_RANK."""
    if world_size < 1:
        raise TensorParallelError(f"tensor_parallel must be >= 1, got {world_size}")
    device = torch.device(device)
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise TensorParallelError(
                f"tensor_parallel={world_size} needs an initialised torch.distributed process group or "
                f"torchrun's environment (missing {', '.join(missing)}): run under "
                f"`torchrun --nproc-per-node {world_size} ...`")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        atexit.register(_close_process_group)
    if dist.get_world_size() != world_size:
        raise TensorParallelError(f"tensor_parallel={world_size} but the process group has "
                                  f"{dist.get_world_size()} ranks")
    rank = dist.get_rank()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count()))))
        torch.cuda.set_device(device)
    return TensorParallel(rank, world_size, device), device
