"""Static, preallocated KV cache with one length per row.

Rollback after a rejection is only "set the row's length": entries past it are stale,
masked by attention (a query never sees keys beyond its own position) and overwritten
by the next write at those positions. Nothing is copied, there is no tree.

Rows are the requests in flight, in order: requests that join append rows (add_rows), finished
ones are dropped by moving the others to the front (keep_rows). A growable cache reallocates when
joining rows need more rows or positions than it holds, at least doubling the rows it lacks. A
reallocation or a move copies the rows held: each up to its length where its owner keeps nothing
past it (entries_end_at_lengths), else whole. A fixed cache (the persistent cache of CUDA graphs,
whose addresses a graph keeps) never moves.

A growable cache's memory is not zeroed (zeroing a grown cache is most of the step that grows it;
measured: bench/results/join-stall-2026-12-03.md). Positions a row has never
written hold whatever the allocator gave, NaN bit patterns included, so no query may let them
count: a query sees only positions at or before its own, which its row wrote earlier or its call
writes first. What the attention paths read past those: the C++ op transposes whole blocks of 16
keys but never uses the scores of keys past a query's position; the Triton kernel loads no key
past the last position of its row's queries; the torch reference attends over every row up to the
call's kv_len (scaled_dot_product_attention with a mask, where a masked NaN still makes NaN), so
it attends over copies in which what no query of a row sees is zero (ops.attention.seen_entries).
Two kinds of call see positions nobody wrote, and get zeros: the padding rows of fixed-shape steps
sit at the spill slot, past every key of their rows (a fixed cache is allocated once, zeroed), and
a cost measurement pretends rows hold entries (pretend_filled zeroes them).

Staged rows follow the rows in use: rows of requests whose prompts are still being prefilled
(a chunk a step, engine.runner), which the rounds do not see (lengths, batch_size: the rows in
use only). stage_rows appends them, staged_view is what a prefill writes, promote makes some of
them rows in use and drop_staged forgets some (an aborted prefill). A round over a padded bucket
of fixed-shape steps may take staged rows for its padding rows: their writes go to the spill
slot, but their lengths change, so whoever prefills a staged row sets its length first.

EncoderDecoderKVCache adds each row's cross-attention keys and values (T5): written once, when
the row joins, from its encoder output, and moved, grown and dropped with the row.
"""
from __future__ import annotations

import torch


def unwritten(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Memory for cache entries, as the allocator gives it: never zeroed, whatever it held (see
    above; tests fill it with NaN instead, to check that no query lets it count)."""
    return torch.empty(shape, dtype=dtype, device=device)


class StaticKVCache:
    staged = 0  # see rows_held
    # Whether each row's entries that matter end at its length, as rollback by length has it (its
    # owner says so: engine.runner, for the target's cache and the draft model's staged cache). Then a
    # growing cache copies a row up to its length, and so does a move; otherwise whole rows, since
    # an owner may keep entries past a row's length (the cross-vocabulary drafter keeps its drafts
    # there, setting the lengths itself each round). A fixed cache moves whole rows either way: a
    # round over a padded bucket of fixed-shape steps changes the lengths of staged rows it pads
    # with (see above), and on a GPU copying whole rows costs little.
    entries_end_at_lengths = False

    def __init__(self, num_layers: int, batch_size: int, capacity: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str, growable: bool = True):
        if batch_size < 1 or capacity < 1:
            raise ValueError(f"cache needs batch_size >= 1 and capacity >= 1, got {batch_size}, {capacity}")
        self.growable = growable
        self._allocate(num_layers, batch_size, capacity, num_kv_heads, head_dim, dtype, device)
        self.batch_size = batch_size  # rows in use (<= allocated rows, see keep_rows)
        self.staged = 0  # rows after them held by requests being prefilled

    @property
    def rows_held(self) -> int:
        """Rows in use and staged rows."""
        return self.batch_size + self.staged

    def _allocate(self, num_layers, rows, capacity, num_kv_heads, head_dim, dtype, device):
        self.capacity = capacity
        # One slot past the capacity takes the writes of padding tokens that fall beyond it;
        # no query ever attends to it (queries sit at positions < capacity).
        shape = (num_layers, rows, capacity + 1, num_kv_heads, head_dim)
        self.k = self._memory(shape, dtype, device)
        self.v = self._memory(shape, dtype, device)
        self._lengths = torch.zeros(rows, dtype=torch.int64, device=device)

    def _memory(self, shape, dtype, device) -> torch.Tensor:
        """Entries as allocated: not zeroed in a growable cache, zeroed in a fixed one (see above)."""
        memory = unwritten(shape, dtype, device)
        return memory if self.growable else memory.zero_()

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
        self.batch_size, self.staged = batch_size, 0
        self.lengths.zero_()

    def pretend_filled(self, length: int):
        """Make every row in use hold `length` entries, zeros: what timing a step at that context
        needs (engine.costs.measure_costs)."""
        self.k[:, :self.batch_size, :length].zero_()
        self.v[:, :self.batch_size, :length].zero_()
        self.lengths.fill_(length)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of one layer, [allocated rows, capacity + 1, Hkv, D] each; the rows in use come first."""
        return self.k[layer], self.v[layer]

    def reserve(self, rows: int, capacity: int):
        """Room for `rows` rows of `capacity` positions, keeping the rows held and their entries.
        A growable cache that lacks room reallocates, at least doubling the rows it lacks (rows
        joining one at a time copy it a logarithmic number of times); a fixed one raises."""
        if rows <= self.allocated_rows and capacity <= self.capacity:
            return
        if not self.growable:
            raise ValueError(f"this cache is fixed at {self.allocated_rows} rows of {self.capacity} positions; "
                             f"{rows} rows of {capacity} do not fit")
        L, _, _, H, D = self.k.shape
        new_rows = max(rows, 2 * self.allocated_rows) if rows > self.allocated_rows else self.allocated_rows
        new_capacity = capacity if capacity > self.capacity else self.capacity
        k, v, lengths, kept = self.k, self.v, self._lengths, list(range(self.rows_held))
        positions = self._held(kept)
        self._allocate(L, new_rows, new_capacity, H, D, k.dtype, k.device)
        self._copy_rows(k, v, kept, kept, positions)
        self._lengths[:len(kept)] = lengths[:len(kept)]

    def _held(self, rows: list[int]) -> list[int]:
        """How many positions of each of these rows to copy when it moves or the cache grows (see
        entries_end_at_lengths)."""
        if not (self.growable and self.entries_end_at_lengths):
            return [self.capacity] * len(rows)
        lengths = self._lengths[rows].tolist() if rows else []
        return [min(n, self.capacity) for n in lengths]

    def _copy_rows(self, k: torch.Tensor, v: torch.Tensor, to: list[int], rows: list[int], positions: list[int]):
        """Row to[i] of this cache takes the first positions[i] entries of row rows[i] of k, v
        [layers, rows, positions, Hkv, D] (which may be this cache's own: every row is read before
        any is written). On a CPU each row copies only its own count, one slice copy a row when no
        row is read after it was written (rows kept in order, the cache grown): a slice is a
        contiguous block a layer, faster than an indexed gather and its scatter (measured:
        bench/results/join-stall-moves-2026-12-03.md), and a row leaving while a long prompt is
        staged behind it moves that prompt. Otherwise one
        gather a class of rows with equal counts; on an accelerator every row the largest (one
        gather in all: launches cost more there than the stale entries past a row's length)."""
        if k.device.type == "cpu" and self._in_sequence(k, to, rows):
            for i, r, count in zip(to, rows, positions):
                if count > 0:
                    self.k[:, i, :count].copy_(k[:, r, :count])
                    self.v[:, i, :count].copy_(v[:, r, :count])
            return
        if k.device.type != "cpu" and positions:
            positions = [max(positions)] * len(positions)
        classes: dict[int, tuple[list[int], list[int]]] = {}
        for i, r, count in zip(to, rows, positions):
            if count > 0:
                dest, source = classes.setdefault(count, ([], []))
                dest.append(i)
                source.append(r)
        reads = []
        for count, (dest, source) in classes.items():
            index = torch.tensor(source, device=k.device)
            reads.append((torch.tensor(dest, device=self.k.device), count, k[:, index, :count], v[:, index, :count]))
        for dest_index, count, k_rows, v_rows in reads:
            self.k[:, dest_index, :count] = k_rows
            self.v[:, dest_index, :count] = v_rows

    def _in_sequence(self, k: torch.Tensor, to: list[int], rows: list[int]) -> bool:
        """Whether copying row rows[i] to row to[i] one after another, in order, reads no row
        already written: always from another tensor, else when no source was an earlier destination."""
        if k.data_ptr() != self.k.data_ptr():
            return True
        written: set[int] = set()
        for i, r in zip(to, rows):
            if r in written:
                return False
            written.add(i)
        return True

    def add_rows(self, count: int) -> "StaticKVCache":
        """Append `count` empty rows (reserve room first) and return a cache of just those rows, a
        view sharing this one's storage (to prefill the requests that joined)."""
        if self.staged:
            raise ValueError("rows are staged: promote or drop them before adding rows in use")
        start = self.batch_size
        if start + count > self.allocated_rows:
            raise ValueError(f"{count} more rows do not fit the {self.allocated_rows} allocated "
                             f"({start} in use); reserve room first")
        self.batch_size += count
        self._lengths[start:self.batch_size] = 0
        view = object.__new__(type(self))
        view.growable, view.batch_size = False, count
        self._share_rows(view, start)
        return view

    def _share_rows(self, view: "StaticKVCache", start: int):
        """Make `view` hold this cache's rows from `start` on (the same storage)."""
        view.capacity = self.capacity
        view.k, view.v, view._lengths = self.k[:, start:], self.v[:, start:], self._lengths[start:]

    def clear(self):
        """Forget every row held, staged ones too (nothing on the device is touched: it works
        whatever state a failure left the tensors in)."""
        self.batch_size = self.staged = 0

    def keep_rows(self, rows: list[int]):
        """Move the listed rows in use (in order) to the front and forget the others (finished
        requests); the staged rows follow them."""
        B = self.batch_size
        self._gather(rows + list(range(B, B + self.staged)))
        self.batch_size = len(rows)

    # ---- staged rows: requests being prefilled --------------------------------------------------

    def stage_rows(self, count: int):
        """Append `count` empty staged rows (reserve room first)."""
        start = self.rows_held
        if start + count > self.allocated_rows:
            raise ValueError(f"{count} more rows do not fit the {self.allocated_rows} allocated "
                             f"({start} held); reserve room first")
        self.staged += count
        self._lengths[start:start + count] = 0

    def staged_view(self, first: int, count: int) -> "StaticKVCache":
        """A cache of staged rows first .. first + count - 1 (0: the first staged row), sharing
        this one's storage: what their prefill writes. Valid until the rows move or the cache grows."""
        if not (0 <= first and count >= 1 and first + count <= self.staged):
            raise ValueError(f"staged rows {first}..{first + count - 1} of {self.staged}")
        view = object.__new__(type(self))
        view.growable, view.batch_size, view.staged = False, count, 0
        self._share_rows(view, self.batch_size + first)
        return view

    def promote(self, staged: list[int]):
        """Staged rows (by their place among the staged rows) become rows in use, in this order,
        after those in use; the other staged rows follow them."""
        B, rest = self.batch_size, [i for i in range(self.staged) if i not in staged]
        self._gather(list(range(B)) + [B + i for i in staged] + [B + i for i in rest])
        self.batch_size, self.staged = B + len(staged), len(rest)

    def drop_staged(self, staged: list[int]):
        """Forget these staged rows (by their place among the staged rows)."""
        B, rest = self.batch_size, [i for i in range(self.staged) if i not in staged]
        self._gather(list(range(B)) + [B + i for i in rest])
        self.staged = len(rest)

    def _gather(self, rows: list[int]):
        """Row i becomes what row rows[i] holds (the rows before the first one that moves are
        left alone; see _held for how much of a row is copied)."""
        first = next((i for i, r in enumerate(rows) if r != i), len(rows))
        if first == len(rows):
            return
        moves = [(i, r) for i, r in enumerate(rows) if r != i]
        to, sources = [i for i, _ in moves], [r for _, r in moves]
        self._copy_rows(self.k, self.v, to, sources, self._held(sources))
        index = torch.tensor(rows[first:], dtype=torch.int64, device=self.k.device)
        n = len(rows)
        self._lengths[first:n] = self._lengths[index]
        self._gather_more(first, n, index)

    def _gather_more(self, first: int, n: int, index: torch.Tensor):
        """What a subclass keeps per row besides k, v and lengths, moved as _gather moves them."""


class EncoderDecoderKVCache(StaticKVCache):
    """The decoder's self-attention cache (a StaticKVCache: one length per row, rollback by
    length) plus each row's cross-attention keys and values, computed once from its encoder
    output when the row joins and only read after.

    cross_k, cross_v: [num_layers, allocated rows, source capacity, H, D]; source_lengths [rows]
    int64: the encoder tokens of each row (keys past them are masked). The source capacity grows
    as longer encoder inputs join (reserve_source), like the positions of a growable cache.
    """

    def __init__(self, num_layers: int, batch_size: int, capacity: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, growable: bool = True, source_capacity: int = 1):
        super().__init__(num_layers, batch_size, capacity, num_heads, head_dim, dtype, device, growable)
        self._allocate_cross(batch_size, source_capacity)

    def _allocate_cross(self, rows: int, source_capacity: int):
        L, _, _, H, D = self.k.shape
        self.source_capacity = source_capacity
        shape = (L, rows, source_capacity, H, D)
        # Not zeroed either: a row's cross-attention sees its own source tokens, all written when it
        # joined (the torch reference zeroes the keys past them first, as for self-attention).
        self.cross_k = self._memory(shape, self.k.dtype, self.k.device)
        self.cross_v = self._memory(shape, self.k.dtype, self.k.device)
        self._source_lengths = torch.zeros(rows, dtype=torch.int64, device=self.k.device)

    @property
    def source_lengths(self) -> torch.Tensor:
        """[B] int64, the encoder tokens of each row in use (a view)."""
        return self._source_lengths[: self.batch_size]

    def pretend_filled(self, length: int):
        """Also an encoder input of `length` tokens in every row (zeros)."""
        super().pretend_filled(length)
        self.reserve_source(length)
        self.cross_k[:, :self.batch_size, :length].zero_()
        self.cross_v[:, :self.batch_size, :length].zero_()
        self.source_lengths.fill_(length)

    def cross_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention k, v of one layer, [allocated rows, source capacity, H, D] each."""
        return self.cross_k[layer], self.cross_v[layer]

    def reserve(self, rows: int, capacity: int):
        allocated = self.allocated_rows
        super().reserve(rows, capacity)
        if self.allocated_rows != allocated:
            self._regrow_cross(self.allocated_rows, self.source_capacity)

    def reserve_source(self, source_len: int):
        """Room for encoder inputs of `source_len` tokens in every row (a fixed cache raises)."""
        if source_len <= self.source_capacity:
            return
        if not self.growable:
            raise ValueError(f"this cache holds encoder inputs of at most {self.source_capacity} tokens; "
                             f"{source_len} do not fit")
        self._regrow_cross(self.allocated_rows, max(source_len, 2 * self.source_capacity))

    def _regrow_cross(self, rows: int, source_capacity: int):
        k, v, lengths, n, kept = self.cross_k, self.cross_v, self._source_lengths, self.rows_held, self.source_capacity
        self._allocate_cross(rows, source_capacity)
        self.cross_k[:, :n, :kept] = k[:, :n]
        self.cross_v[:, :n, :kept] = v[:, :n]
        self._source_lengths[:n] = lengths[:n]

    def _share_rows(self, view: "EncoderDecoderKVCache", start: int):
        super()._share_rows(view, start)
        view.source_capacity = self.source_capacity
        view.cross_k, view.cross_v = self.cross_k[:, start:], self.cross_v[:, start:]
        view._source_lengths = self._source_lengths[start:]

    def add_rows(self, count: int) -> "EncoderDecoderKVCache":
        view = super().add_rows(count)
        view.source_lengths.zero_()
        return view

    def stage_rows(self, count: int):
        super().stage_rows(count)
        start = self.rows_held - count
        self._source_lengths[start:start + count] = 0

    def _gather_more(self, first: int, n: int, index: torch.Tensor):
        self.cross_k[:, first:n] = self.cross_k[:, index]
        self.cross_v[:, first:n] = self.cross_v[:, index]
        self._source_lengths[first:n] = self._source_lengths[index]
