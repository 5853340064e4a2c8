"""What each step does, decided before anything runs: the queue, admission into the running
batch's rows, each step's prefill chunks, the rounds' gamma and how many rounds may run before a
read (a StepPlan, which the model runner carries out: engine.runner); and how requests leave
(finished, aborted, failed), each leaving alone.

Requests wait in arrival order and take rows at a step's start while rows are free
(max_batch_size counts the rows of requests still being prefilled), with what the prefix cache
holds of their prompts. Their prompts are then prefilled a chunk a step, within the step's budget
(engine.prefill_budget), and they join the rounds once prefilled: the plan says which rows its
prefill completes, so the step's gamma and rounds are chosen for the rows that will decode. A
request that ends holds no row from then on; its last output is reported by the next step (those
of requests that ended outside a step: aborts, failed prefills, failed rounds). The scheduler
decides which rows are freed (a RowRelease); moving the other rows to the front is device work,
the model runner's (ModelRunner.release): should it fail, no row is in a known state, so the
running requests end with the reason rather than decode from a broken cache (rows_broken). A
failed prefill ends the requests being prefilled; the rows decoding stay as they were.

The scheduler runs no forward: the step costs gamma="auto" prices are measured before it plans
(the engine covers rows_to_hold's batch size first).
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .batch import PrefillChunk, Prefilling, RunningBatch
from .gamma import GammaController
from .prefill_budget import CHUNK, PrefillBudget
from .prefix_cache import BLOCK, Block, PrefixCache, block_keys
from .request import Request
from .rounds import RoundResult, rooms, rounds_that_fit


@dataclass(frozen=True)
class Admission:
    """A request that takes a staged row this step."""
    row: Prefilling      # its staged row's state (done: what the prefix cache gives it)
    blocks: list[Block]  # the prefix cache's blocks of its prompt, copied into its rows

    def __post_init__(self):
        if self.blocks and self.row.done != len(self.blocks) * BLOCK:
            raise ValueError(f"an admitted row starts with the prefix cache's {len(self.blocks)} blocks done, "
                             f"not {self.row.done} units")


@dataclass(frozen=True)
class StepPlan:
    """One step, as the scheduler decided it (Scheduler.schedule) for the model runner to carry out
    (engine.runner.ModelRunner.run)."""
    admitted: list[Admission]    # requests taking staged rows, in row order (after those staged before)
    chunks: list[PrefillChunk]   # the prefill's chunks, in staged-row order (pending ones again until their last layer)
    layers: int | None           # of the chunks' target layers, how many run this step (None: all left)
    joins: list[Prefilling]      # staged rows this step's prefill completes, in row order: they decode from its rounds
    decoding: list[Request]      # the rows the rounds run: those decoding before, then those of joins
    gamma: int                   # drafts per row and round at most (0: no drafts)
    # The most rounds before the one read of their results (0: no rounds, nothing decodes). The
    # runner may run fewer (one, a host round) when its drafter cannot draft from device state now.
    rounds_per_read: int

    def __post_init__(self):
        if self.gamma < 0 or self.rounds_per_read < 0 or (self.rounds_per_read == 0) != (not self.decoding):
            raise ValueError(f"a plan needs gamma >= 0 and rounds_per_read >= 1 exactly when rows decode, got gamma "
                             f"{self.gamma}, rounds_per_read {self.rounds_per_read} for {len(self.decoding)} rows")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"a step runs at least one layer of its chunks, got layers={self.layers}")
        rows = [c.row for c in self.chunks]
        if len(set(map(id, rows))) != len(rows):
            raise ValueError("a plan gives a row one chunk at most")
        if [r.request for r in self.joins] != self.decoding[len(self.decoding) - len(self.joins):]:
            raise ValueError("the rows that join decode last, in their order")


@dataclass(frozen=True)
class RowRelease:
    """Rows to free, as the scheduler decided (Scheduler.release, abort, fail, rows_broken), for the
    model runner to drop (engine.runner.ModelRunner.release)."""
    prefilling: tuple[Prefilling, ...] = ()  # staged rows whose requests ended
    keep: tuple[int, ...] | None = None      # the decoding rows kept, in order (None: every one)
    all_prefilling: bool = False             # every staged row (their prefill failed)
    all_rows: bool = False                   # every row, staged ones too (the rows are in no known state)


@dataclass
class PrefillDone:
    """What a step's prefill did."""
    tokens: int      # of the step's budget, what its chunks count (prompt tokens)
    share: float     # of those chunks' target layers, the share it ran (1.0: whole chunks)
    seconds: float   # its wall time, draft model included


@dataclass
class StepOutcome:
    """What carrying out a plan did."""
    prefill: PrefillDone | None      # None: nothing was prefilled (no rows admitted or staged)
    results: list[RoundResult]       # one per row of plan.decoding (none: no rounds ran)
    gamma: int                       # the drafts a round made per row at most (fewer than the plan's near the rows' limits)
    rounds_s: float = 0.0            # the rounds' wall time

    def __post_init__(self):
        if len({r.rounds for r in self.results}) > 1:
            raise ValueError("the rows of a step run the same rounds")

    @property
    def rounds(self) -> int:
        return self.results[0].rounds if self.results else 0


class Scheduler:
    def __init__(self, batch: RunningBatch, max_batch_size: int | None, prefill_budget: PrefillBudget,
                 prefix_cache: PrefixCache | None, staged_row: Callable[[Request], Prefilling],
                 chunk_layers: int | None, features_needed: bool, max_seq_len: int, rounds_per_read: int, gamma: int,
                 gamma_controller: Callable[[], GammaController | None], tp=None):
        """staged_row: a request's Prefilling as the model runner sees its prefill (its units).
        chunk_layers: the target layers a chunk's forward may be spread over (None: it cannot be).
        features_needed: whether the drafter needs the target's features of every position (a
        feature drafter: only the prefix cache's blocks that kept them count). gamma: the fixed
        gamma, or with gamma="auto" the most a round may draft, chosen each step by the controller
        that gamma_controller() gives (None: no auto gamma). tp: a split target's group (every
        rank takes rank 0's gamma)."""
        self.batch = batch
        self.max_batch_size = max_batch_size
        self.prefill_budget, self.prefix_cache = prefill_budget, prefix_cache
        self._staged_row, self._features_needed = staged_row, features_needed
        self.chunk_layers = chunk_layers
        self.max_seq_len, self.rounds_per_read, self.gamma = max_seq_len, rounds_per_read, gamma
        self._gamma_controller, self._tp = gamma_controller, tp
        self.unfinished: dict[str, Request] = {}  # by id, until they end
        self.waiting: deque[Request] = deque()
        self.ended: list[Request] = []  # ended outside a step's report: the next step reports them
        self._previous_gamma = 0  # the last round's drafts (before the first: none, and the draft model unfed)

    @property
    def decoding(self) -> list[Request]:
        return self.batch.requests

    @property
    def prefilling(self) -> list[Request]:
        """Requests holding a row whose prompt is still being prefilled, oldest first."""
        return [j.request for j in self.batch.prefilling]

    def add(self, requests: list[Request]):
        now = time.perf_counter()
        for r in requests:
            r.added_at = now
            self.unfinished[r.request_id] = r
            self.waiting.append(r)

    # ---- the plan -------------------------------------------------------------------------------

    def _admissible(self) -> int:
        """How many waiting requests the next step admits: as many as rows are free."""
        free = len(self.waiting) if self.max_batch_size is None else self.max_batch_size - self.batch.rows_held
        return max(0, min(free, len(self.waiting)))

    def rows_to_hold(self) -> int | None:
        """The rows the next step's plan holds once it has admitted, when it prefills (then it
        prices batches up to this many rows: their step costs must be measured before it plans);
        None when it prefills nothing."""
        admitted = self._admissible()
        if not (admitted or self.batch.prefilling):
            return None
        return self.batch.rows_held + admitted

    def schedule(self) -> StepPlan:
        """The next step: admissions, the prefill's chunks, and for the rows that then decode the
        rounds' gamma and the most rounds before a read. Should planning fail, the requests it took
        off the queue end (the rows held stay as they were)."""
        taken = [self.waiting.popleft() for _ in range(self._admissible())]
        try:
            return self._plan(taken)
        except BaseException as exc:
            for r in taken:
                self.end(r, f"aborted: planning its step failed ({type(exc).__name__}: {exc})")
            raise

    def _plan(self, taken: list[Request]) -> StepPlan:
        batch = self.batch
        admitted = self._admit(taken)
        staged = batch.prefilling + [a.row for a in admitted]
        chunks, layers, joins = [], None, []
        if staged:
            controller = self._gamma_controller()
            if controller is not None:
                rows = batch.rows_held + len(admitted)
                for a in admitted:
                    a.row.request.acceptance = controller.new_estimate(rows, greedy=a.row.request.params.temperature == 0)
            share = self.prefill_budget.next(decoding=bool(batch.requests))
            pending = batch.pending
            chunks = pending.chunks if pending is not None else self._chunks(staged, share.tokens)
            # Chunks shorter than CHUNK in all run whole: short prompts' prefills are not the chunks
            # whose pace the budget measured, and they cost little.
            if pending is not None or sum(c.tokens for c in chunks) >= CHUNK:
                layers = share.layers
            joins = self._joins(staged, chunks, layers)
        decoding = batch.requests + [j.request for j in joins]
        gamma = self.choose_gamma(decoding) if decoding else 0
        return StepPlan(admitted, chunks, layers, joins, decoding, gamma,
                        self._rounds_per_read(decoding, gamma) if decoding else 0)

    def _admit(self, taken: list[Request]) -> list[Admission]:
        """The requests taken off the queue for free rows (first come first served), each with the
        prefix cache's blocks of its prompt. Requests admitted together take rows by prompt length:
        the shorter join sooner, and chunks of similar length share prefill calls (row order does
        not matter: seeded rows sample alike anywhere)."""
        return [self._admission(r) for r in sorted(taken, key=lambda r: len(r.prompt_token_ids))]

    def _admission(self, request: Request) -> Admission:
        j = self._staged_row(request)
        if self.prefix_cache is None:
            return Admission(j, [])
        j.keys = block_keys(j.prefill)
        if request.prompt_logprobs is not None:
            # Its prompt is scored from its prefill's hidden states: prefilled whole (and cached).
            return Admission(j, [])
        blocks = self.prefix_cache.match(j.keys, j.prefill)
        if self._features_needed:  # a feature drafter needs the blocks' features too
            blocks = blocks[:next((i for i, b in enumerate(blocks) if b.features is None), len(blocks))]
        j.stored = len(blocks)
        j.done = request.stats.cached_prompt_tokens = len(blocks) * BLOCK
        return Admission(j, blocks)

    @staticmethod
    def _chunks(staged: list[Prefilling], budget: int | None) -> list[PrefillChunk]:
        """The step's chunks within `budget` prompt tokens (None: no limit), the oldest request
        first, each ending at a multiple of its row's cut or at its prefill's end (a chunk of a
        decoder-only prompt at a multiple of CHUNK tokens; an encoder's at a block, a block over S
        tokens counting as S / blocks tokens). The first chunk of a step takes one cut at least."""
        chunks: list[PrefillChunk] = []
        left = budget
        for j in staged:
            rest = j.units - j.done
            if rest == 0:
                continue
            affordable = rest if left is None else min(rest, int(left // j.unit_tokens))
            n = rest if affordable == rest else (j.done + affordable) // j.cut * j.cut - j.done
            if n <= 0:
                if chunks:
                    break
                n = min(rest, j.cut - j.done % j.cut)
            cost = math.ceil(n * j.unit_tokens)
            chunks.append(PrefillChunk(j, n, cost))
            if left is not None:
                left -= cost
                if left <= 0:
                    break
        return chunks

    def _joins(self, staged: list[Prefilling], chunks: list[PrefillChunk], layers: int | None) -> list[Prefilling]:
        """The staged rows whose prefill these chunks complete: every unit done, and the chunks'
        target forward through its last layer this step."""
        pending = self.batch.pending
        done = 0 if pending is None else pending.layers_done
        whole = layers is None or done + layers >= self.chunk_layers
        units = {c.row: c.units for c in chunks} if whole else {}
        return [j for j in staged if j.done + units.get(j, 0) == j.units]

    def choose_gamma(self, decoding: list[Request]) -> int:
        """The rounds' gamma for these rows: the fixed one, or the controller's choice."""
        controller = self._gamma_controller()
        if controller is None:
            return self.gamma
        gamma = controller.choose([r.acceptance for r in decoding])
        # Chosen from timings, which differ between ranks: every rank takes rank 0's choice.
        return gamma if self._tp is None else self._tp.broadcast_int(gamma)

    def _rounds_per_read(self, decoding: list[Request], gamma: int) -> int:
        """As many rounds as the setting allows and every row has room for with full budgets
        (rounds.rounds_that_fit: a block drafts exactly what host rounds would), else one."""
        if self.rounds_per_read == 1 or min(len(r.tokens) for r in decoding) < 2:
            return 1
        if any(r.logprobs is not None for r in decoding):
            return 1  # log-probabilities come from each round's verification logits, which a block overwrites
        return max(1, min(self.rounds_per_read, rounds_that_fit(rooms(decoding, self.max_seq_len), gamma)))

    # ---- what the step taught -----------------------------------------------------------------

    def observe(self, plan: StepPlan, outcome: StepOutcome, round_s: float | None, finished: list[Request]):
        """After a step: what carrying its plan out did, a round's seconds (its outcome applied
        included), and the requests that finished in it."""
        prefill, gamma = outcome.prefill, outcome.gamma
        if prefill is not None:
            self.prefill_budget.observe_prefill(prefill.tokens, prefill.share, prefill.seconds)
        if not outcome.rounds:
            return
        controller = self._gamma_controller()
        self.prefill_budget.observe_round(round_s)
        if controller is not None:
            for r in finished:
                controller.observe_finished(r.acceptance, r.stats.accepted, r.stats.rejections)
            # A drafting round after rounds without drafts, or with rows that just joined, also
            # fed the draft model what it lacked.
            controller.observe_round(len(plan.decoding), gamma, round_s,
                                     after_gap=self._previous_gamma == 0 or bool(plan.joins))
        self._previous_gamma = gamma

    # ---- requests that leave ----------------------------------------------------------------------

    def fail(self, plan: StepPlan, part: str, exc: BaseException) -> RowRelease:
        """The runner failed carrying out the plan, in its "prefill" (the requests admitted and
        being prefilled end; the rows decoding stay as they were) or its "rounds" (the rounds'
        rows are in no known state: every request holding a row ends). Returns the rows to drop."""
        if part == "prefill":
            for a in plan.admitted:  # those not staged yet
                self.end(a.row.request, f"aborted: its prefill failed ({type(exc).__name__}: {exc})")
            return self.rows_broken("prefilling", exc)
        return self._end_running(f"aborted: the round failed ({type(exc).__name__}: {exc})")

    def rows_broken(self, rows: str, exc: BaseException) -> RowRelease:
        """Moving rows failed, leaving these in no known state: "prefilling" (the staged rows:
        their requests end) or "running" (every row: every request holding one ends). Returns the
        rows to drop."""
        if rows == "prefilling":
            for j in self.batch.prefilling:
                self.end(j.request, f"aborted: its prefill failed ({type(exc).__name__}: {exc})")
            return RowRelease(all_prefilling=True)
        return self._end_running(f"aborted: freeing another request's row failed ({type(exc).__name__}: {exc})")

    def abort(self, request_id: str) -> RowRelease | None:
        """End a request now, whatever its state: the rows to free (None: no unfinished request
        has this id)."""
        request = self.unfinished.get(request_id)
        if request is None:
            return None
        # Ended first: whatever happens to the rows, the request is over and reported.
        self.end(request, "aborted")
        if request in self.waiting:
            self.waiting.remove(request)
            return RowRelease()
        return self.release()

    def release(self, report: bool = False) -> RowRelease:
        """The rows of requests that ended, to free (report: their outputs are still to be reported)."""
        ended = tuple(j for j in self.batch.prefilling if j.request.finish_reason is not None)
        running = self.batch.requests
        keep = tuple(i for i, r in enumerate(running) if r.finish_reason is None)
        for r in running:
            if r.finish_reason is not None and self.unfinished.pop(r.request_id, None) is not None and report:
                self.ended.append(r)
        return RowRelease(ended, None if len(keep) == len(running) else keep)

    def end(self, r: Request, message: str):
        """Abort a request: it ends now, with the message, and the next step reports it."""
        if r.finish_reason is None:
            r.finish_reason, r.message = "abort", message
            r.stats.wall_time_s = time.perf_counter() - r.added_at
        if self.unfinished.pop(r.request_id, None) is not None:
            self.ended.append(r)

    def _end_running(self, message: str) -> RowRelease:
        """End every request holding a row, prefilling ones too (their rows are in no known state):
        every row to drop."""
        for r in self.batch.requests + self.prefilling:
            self.end(r, message)
        return RowRelease(all_rows=True)

    def take_ended(self) -> list[Request]:
        ended, self.ended = self.ended, []
        return ended
