"""Which requests decode: the queue, admission into the running batch's rows, their prefill, and
how requests leave it (finished, aborted, failed), each leaving alone.

Requests wait in arrival order and take rows at a step's start while rows are free
(max_batch_size counts the rows of requests still being prefilled). Their prompts are then
prefilled a chunk a step (engine.batch) and they join the rounds once prefilled. A request that
ends holds no row from then on; its last output is reported by the next step (those of requests
that ended outside a step: aborts, failed prefills, failed rounds). Moving the other rows to the
front is device work: should it fail, no row is in a known state, so the running requests end
with the reason rather than decode from a broken cache. A failed prefill ends the requests being
prefilled; the rows decoding stay as they were.
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque

from .batch import Prefilling, PrefillStep, RunningBatch
from .prefill_budget import CHUNK, PrefillShare
from .request import Request

log = logging.getLogger("specengine")


class Scheduler:
    def __init__(self, batch: RunningBatch, max_batch_size: int | None):
        self.batch = batch
        self.max_batch_size = max_batch_size
        self.unfinished: dict[str, Request] = {}  # by id, until they end
        self.waiting: deque[Request] = deque()
        self.ended: list[Request] = []  # ended outside a step's report: the next step reports them

    @property
    def decoding(self) -> list[Request]:
        return self.batch.requests

    def add(self, requests: list[Request]):
        now = time.perf_counter()
        for r in requests:
            r.added_at = now
            self.unfinished[r.request_id] = r
            self.waiting.append(r)

    @property
    def prefilling(self) -> list[Request]:
        """Requests holding a row whose prompt is still being prefilled, oldest first."""
        return [j.request for j in self.batch.prefilling]

    def admissions(self) -> list[Request]:
        """Waiting requests that get a row now, first come first served (taken off the queue)."""
        held = self.batch.rows_held
        free = len(self.waiting) if self.max_batch_size is None else self.max_batch_size - held
        return [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]

    def stage(self, admitted: list[Request]):
        """Give requests admitted now rows, holding what the prefix cache has of their prompts."""
        try:
            self.batch.stage(admitted)
        except BaseException as exc:
            for r in admitted:  # those not staged yet
                self.end(r, f"aborted: its prefill failed ({type(exc).__name__}: {exc})")
            self._end_prefilling(exc)
            raise

    def prefill(self, share: PrefillShare) -> PrefillStep:
        """Prefill the requests holding staged rows, as much as `share` allows (chunks, _chunks);
        those done join the running rows. Should it fail, the rows running stay as they were and
        the requests being prefilled end (then it raises)."""
        pending = self.batch.pending
        chunks = pending.work if pending is not None else self._chunks(share.tokens)
        # Chunks shorter than CHUNK in all run whole: short prompts' prefills are not the chunks
        # whose pace the budget measured, and they cost little.
        layers = share.layers if pending is not None or sum(n for _, n in chunks) >= CHUNK else None
        try:
            return self.batch.prefill(chunks, layers)
        except BaseException as exc:
            self._end_prefilling(exc)
            raise

    def _chunks(self, budget: int | None) -> list[tuple[Prefilling, int]]:
        """The step's chunks within `budget` prompt tokens (None: no limit), the oldest request
        first: a decoder-only prompt's tokens, each chunk ending at a multiple of CHUNK tokens or
        at the prompt's end; an encoder-decoder's encoder blocks, a block over S tokens counting
        as S / blocks tokens (at least one block a step)."""
        chunks: list[tuple[Prefilling, int]] = []
        left = budget
        for j in self.batch.prefilling:
            if self.batch.target.is_encoder_decoder:
                if j.encoded:
                    continue
                source, total = len(j.request.source), len(self.batch.target.encoder)
                n = total - j.encoders[0].blocks_done
                if left is not None:
                    n = min(n, left * total // source)
                    if n < 1:
                        if chunks:
                            break
                        n = 1
                cost = math.ceil(n * source / total)
            else:
                rest = len(j.prefill) - j.done
                if rest == 0:
                    continue
                n = rest if left is None or rest <= left else (j.done + left) // CHUNK * CHUNK - j.done
                if n <= 0:
                    break
                cost = n
            chunks.append((j, n))
            if left is not None:
                left -= cost
                if left <= 0:
                    break
        return chunks

    def _end_prefilling(self, exc: BaseException):
        for j in self.batch.prefilling:
            self.end(j.request, f"aborted: its prefill failed ({type(exc).__name__}: {exc})")
        self.batch.drop_all_prefilling()

    def abort(self, request_id: str) -> bool:
        """End a request now, whatever its state, and free its row. False when none has this id."""
        request = self.unfinished.get(request_id)
        if request is None:
            return False
        # Ended first: whatever happens to the rows, the request is over and reported.
        self.end(request, "aborted")
        if request in self.waiting:
            self.waiting.remove(request)
        else:
            self.release()
        return True

    def release(self, report: bool = False):
        """Drop the rows of requests that ended (report: their outputs are still to be reported)."""
        ended = [j for j in self.batch.prefilling if j.request.finish_reason is not None]
        if ended:
            try:
                self.batch.drop_prefilling(ended)
            except Exception as exc:  # noqa: BLE001 (contained: the other joiners end with the reason)
                log.exception("freeing the row of a request being prefilled failed; those being prefilled end")
                self._end_prefilling(exc)
        running = self.batch.requests
        keep = [i for i, r in enumerate(running) if r.finish_reason is None]
        for r in running:
            if r.finish_reason is not None and self.unfinished.pop(r.request_id, None) is not None and report:
                self.ended.append(r)
        if len(keep) == len(running):
            return
        try:
            self.batch.keep(keep)
        except Exception as exc:  # noqa: BLE001 (contained: the survivors end with the reason)
            log.exception("freeing the rows of ended requests failed; the running requests end")
            self.batch.requests = [running[i] for i in keep]
            self.end_running(f"aborted: freeing another request's row failed ({type(exc).__name__}: {exc})")

    def end(self, r: Request, message: str):
        """Abort a request: it ends now, with the message, and the next step reports it."""
        if r.finish_reason is None:
            r.finish_reason, r.message = "abort", message
            r.stats.wall_time_s = time.perf_counter() - r.added_at
        if self.unfinished.pop(r.request_id, None) is not None:
            self.ended.append(r)

    def end_running(self, message: str):
        """End every request holding a row, prefilling ones too (their rows are in no known state),
        and drop the rows."""
        for r in self.batch.requests + self.prefilling:
            self.end(r, message)
        self.batch.clear()

    def take_ended(self) -> list[Request]:
        ended, self.ended = self.ended, []
        return ended
