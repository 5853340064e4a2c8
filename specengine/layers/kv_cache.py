"""Static, preallocated KV cache with one length per row.

Rollback after a rejection is only "set the row's length": entries past it are stale,
masked by attention (a query never sees keys beyond its own position) and overwritten
by the next write at those positions. Nothing is copied, there is no tree.
"""
from __future__ import annotations

import torch


class StaticKVCache:
    def __init__(self, num_layers: int, batch_size: int, capacity: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        if batch_size < 1 or capacity < 1:
            raise ValueError(f"cache needs batch_size >= 1 and capacity >= 1, got {batch_size}, {capacity}")
        self.capacity = capacity
        # One slot past the capacity takes the writes of padding tokens that fall beyond it;
        # no query ever attends to it (queries sit at positions < capacity).
        shape = (num_layers, batch_size, capacity + 1, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.batch_size = batch_size  # rows in use (<= allocated rows, see keep_rows)

    @property
    def lengths(self) -> torch.Tensor:
        """[B] int64, the valid prefix of each row in use (a view: update it in place)."""
        return self._lengths[: self.batch_size]

    @property
    def allocated_rows(self) -> int:
        return self.k.shape[1]

    def reset(self, batch_size: int):
        """Reuse the cache for a new batch of empty rows (a persistent cache, see engine.graphs)."""
        if not 1 <= batch_size <= self.allocated_rows:
            raise ValueError(f"batch of {batch_size} rows does not fit the {self.allocated_rows} rows allocated")
        self.batch_size = batch_size
        self.lengths.zero_()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of one layer, [allocated rows, capacity + 1, Hkv, D] each; the rows in use come first."""
        return self.k[layer], self.v[layer]

    def keep_rows(self, rows: list[int]):
        """Move the listed rows (in order) to the front and forget the others (finished requests)."""
        if rows == list(range(len(rows))):
            self.batch_size = len(rows)
            return
        index = torch.tensor(rows, dtype=torch.int64, device=self.k.device)
        n = len(rows)
        self.k[:, :n] = self.k[:, index]
        self.v[:, :n] = self.v[:, index]
        self._lengths[:n] = self._lengths[index]
        self.batch_size = n
