"""Static, preallocated KV cache with one length per row.

Rollback after a rejection is only "set the row's length": entries past it are stale,
masked by attention (a query never sees keys beyond its own position) and overwritten
by the next write at those positions. Nothing is copied, there is no tree.

Rows are the requests in flight, in order: requests that join append rows (add_rows), finished
ones are dropped by moving the others to the front (keep_rows). A growable cache reallocates,
copying the rows in use, when joining rows need more rows or positions than it holds; a fixed
one (the persistent cache of CUDA graphs, whose addresses a graph keeps) never moves.
"""
from __future__ import annotations

import torch


class StaticKVCache:
    def __init__(self, num_layers: int, batch_size: int, capacity: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str, growable: bool = True):
        if batch_size < 1 or capacity < 1:
            raise ValueError(f"cache needs batch_size >= 1 and capacity >= 1, got {batch_size}, {capacity}")
        self.growable = growable
        self._allocate(num_layers, batch_size, capacity, num_kv_heads, head_dim, dtype, device)
        self.batch_size = batch_size  # rows in use (<= allocated rows, see keep_rows)

    def _allocate(self, num_layers, rows, capacity, num_kv_heads, head_dim, dtype, device):
        self.capacity = capacity
        # One slot past the capacity takes the writes of padding tokens that fall beyond it;
        # no query ever attends to it (queries sit at positions < capacity).
        shape = (num_layers, rows, capacity + 1, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._lengths = torch.zeros(rows, dtype=torch.int64, device=device)

    @property
    def lengths(self) -> torch.Tensor:
        """[B] int64, the valid prefix of each row in use (a view: update it in place)."""
        return self._lengths[: self.batch_size]

    def row_lengths(self, rows: int) -> torch.Tensor:
        """[rows] int64, the lengths of the first `rows` allocated rows, in use or not (a view): a
        fixed-shape step over a padded bucket advances its padding rows' lengths too."""
        return self._lengths[:rows]

    @property
    def allocated_rows(self) -> int:
        return self.k.shape[1]

    def reset(self, batch_size: int):
        """Reuse the cache for a new batch of empty rows (0: none in use yet)."""
        if not 0 <= batch_size <= self.allocated_rows:
            raise ValueError(f"batch of {batch_size} rows does not fit the {self.allocated_rows} rows allocated")
        self.batch_size = batch_size
        self.lengths.zero_()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of one layer, [allocated rows, capacity + 1, Hkv, D] each; the rows in use come first."""
        return self.k[layer], self.v[layer]

    def reserve(self, rows: int, capacity: int):
        """Room for `rows` rows of `capacity` positions, keeping the rows in use and their entries.
        A growable cache that lacks room reallocates, at least doubling what it lacks (rows joining
        one at a time copy it a logarithmic number of times); a fixed one raises."""
        if rows <= self.allocated_rows and capacity <= self.capacity:
            return
        if not self.growable:
            raise ValueError(f"this cache is fixed at {self.allocated_rows} rows of {self.capacity} positions; "
                             f"{rows} rows of {capacity} do not fit")
        L, _, _, H, D = self.k.shape
        new_rows = max(rows, 2 * self.allocated_rows) if rows > self.allocated_rows else self.allocated_rows
        new_capacity = capacity if capacity > self.capacity else self.capacity
        k, v, lengths, n, kept = self.k, self.v, self._lengths, self.batch_size, self.capacity
        self._allocate(L, new_rows, new_capacity, H, D, k.dtype, k.device)
        self.k[:, :n, :kept] = k[:, :n, :kept]
        self.v[:, :n, :kept] = v[:, :n, :kept]
        self._lengths[:n] = lengths[:n]

    def add_rows(self, count: int) -> "StaticKVCache":
        """Append `count` empty rows (reserve room first) and return a cache of just those rows, a
        view sharing this one's storage (to prefill the requests that joined)."""
        start = self.batch_size
        if start + count > self.allocated_rows:
            raise ValueError(f"{count} more rows do not fit the {self.allocated_rows} allocated "
                             f"({start} in use); reserve room first")
        self.batch_size += count
        self._lengths[start:self.batch_size] = 0
        view = object.__new__(StaticKVCache)
        view.growable, view.capacity, view.batch_size = False, self.capacity, count
        view.k, view.v, view._lengths = self.k[:, start:], self.v[:, start:], self._lengths[start:]
        return view

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
