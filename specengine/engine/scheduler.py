"""Which requests decode: the queue, admission into the running batch's rows, and how requests
leave it (finished, aborted, failed), each leaving alone.

Requests wait in arrival order and join at a round boundary while rows are free
(max_batch_size). A request that ends holds no row from then on; its last output is reported by
the next step (those of requests that ended outside a step: aborts, failed prefills, failed
rounds). Moving the other rows to the front is device work: should it fail, no row is in a known
state, so the running requests end with the reason rather than decode from a broken cache.
"""
from __future__ import annotations

import logging
import time
from collections import deque

from .batch import RunningBatch
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
    def running(self) -> list[Request]:
        return self.batch.requests

    def add(self, requests: list[Request]):
        now = time.perf_counter()
        for r in requests:
            r.added_at = now
            self.unfinished[r.request_id] = r
            self.waiting.append(r)

    def next_joining(self) -> list[Request]:
        """Waiting requests that get a row now, first come first served (taken off the queue)."""
        free = len(self.waiting) if self.max_batch_size is None else self.max_batch_size - len(self.batch)
        return [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]

    def join(self, joining: list[Request], prefill_draft: bool):
        """Give the joining requests rows and prefill them. Nothing half-done: should the prefill
        fail, the rows already running stay as they were and the joiners end (then it raises)."""
        running = len(self.batch)
        try:
            self.batch.admit(joining, prefill_draft=prefill_draft)
        except BaseException as exc:
            self.batch.keep(list(range(running)))
            for r in joining:
                self.end(r, f"aborted: its prefill failed ({type(exc).__name__}: {exc})")
            raise

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
        """End every running request (their rows are in no known state) and drop the rows."""
        for r in self.batch.requests:
            self.end(r, message)
        self.batch.clear()

    def take_ended(self) -> list[Request]:
        ended, self.ended = self.ended, []
        return ended
