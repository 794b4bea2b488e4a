"""Dynamic batching: ranking requests that arrive together scored in one model call.

A request is read and checked on the event loop's worker threads, then queued here; one
scoring loop takes the queue's head and, while the rows fit `batch_rows`, the ranking
requests queued behind it (those that arrived while the call before ran, and those that
arrive within `batch_wait_ms`), and scores them as one batch of several users
(scoring/ranking.py's `rankings_batch`: each request's user row once, its candidates
pointing at it):

    clients ──▶ read, parse, check (threads) ──▶ queue ──▶ [ r1 r2 r3 ] one model call
                                                            ▲ rows ≤ batch_rows
                                              (rows past it, or sample rows: a call alone)

so under many clients the model runs on full batches instead of one request at a time, and
reading and checking the next requests overlaps the scoring. A request whose deadline
passed while it waited is answered 504 and not scored; one body's NaN refuses that body
alone. Scores are the ones each request gets alone (1e-6: the same model on a batch).
"""

from __future__ import annotations

import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from recd_core.config import ServeConfig
from recd_core.runtime import cpu_budget
from recd_core.scoring.scorer import Checked, NonFinite, finite

SWITCH_INTERVAL_S = 0.001


def set_up_scoring(cfg: ServeConfig) -> int:
    """The serving process set up for its scoring thread; returns torch's threads.

    torch's threads for a model call (`serve.threads`): by default the CPU budget less the
    two threads that read and check requests meanwhile, at least one. And the interpreter's
    switch interval at 1 ms (Python's default is 5): the scoring thread lets go of the GIL
    at every torch op and takes it back after, and under load a checking thread holding it
    keeps it until the interval ends; a model call of a hundred ops then waited up to 5 ms
    a time (8 clients: 378 requests a second at 5 ms, 430 at 1 ms; 32 clients' p99 163 ->
    95 ms, `bench/serving_load.py`)."""
    threads = cfg.threads or max(cpu_budget() - 2, 1)
    torch.set_num_threads(threads)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    return threads


@dataclass
class Job:
    """A checked body waiting for its scores (`done`)."""

    checked: Checked
    served: object  # serving/app.py's Served: the model the request started with
    deadline: float  # monotonic
    done: asyncio.Future = field(repr=False)


class Batcher:
    """The one scoring loop (module doc) over `batch_rows`-row model calls."""

    def __init__(self, batch_rows: int, wait_s: float, dedup: bool):
        self.batch_rows, self.wait_s, self.dedup = batch_rows, wait_s, dedup
        self.queue: asyncio.Queue[Job] = asyncio.Queue()
        self.held: Job | None = None  # taken off the queue, not fitting the call before
        self.task: asyncio.Task | None = None
        self.calls = self.batched = 0  # model calls, and requests scored with another
        # the scoring thread, its own: under a burst the checking of new requests queues on
        # the loop's workers and never delays a model call
        self.scorer = ThreadPoolExecutor(1, thread_name_prefix="recd-score")

    async def score(self, checked: Checked, served, deadline: float) -> np.ndarray:
        """`checked`'s probabilities, scored with whatever the loop batches it with."""
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self.run())
        job = Job(checked, served, deadline, asyncio.get_running_loop().create_future())
        await self.queue.put(job)
        return await job.done

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            group = await self._group()
            await loop.run_in_executor(self.scorer, self._score, group)

    async def _group(self) -> list[Job]:
        """The next model call's jobs: the head, then the ranking requests behind it while
        their rows fit (waiting up to `wait_s` for more)."""
        first = self.held or await self.queue.get()
        self.held = None
        group, rows = [first], first.checked.rows
        if first.checked.rankings is None:
            return group
        end = time.monotonic() + self.wait_s
        while rows < self.batch_rows:
            try:
                job = self.queue.get_nowait()
            except asyncio.QueueEmpty:
                left = end - time.monotonic()
                if left <= 0:
                    break
                try:
                    job = await asyncio.wait_for(self.queue.get(), left)
                except TimeoutError:
                    break
            if (
                job.checked.rankings is None
                or job.served is not first.served
                or rows + job.checked.rows > self.batch_rows
            ):
                self.held = job
                break
            group.append(job)
            rows += job.checked.rows
        return group

    def _score(self, group: list[Job]) -> None:
        """The scoring thread: the group's live jobs scored, each one's future resolved."""
        live = [j for j in group if not j.done.done()]  # a 504 already answered: skipped
        now = time.monotonic()
        for job in [j for j in live if j.deadline < now]:
            self._answer(job, TimeoutError())
        live = [j for j in live if j.deadline >= now]
        if not live:
            return
        cfg = live[0].served.scorer
        try:
            if len(live) == 1:
                job = live[0]
                probs = [cfg.score_checked(job.checked, self.batch_rows, self.dedup, job.deadline)]
            else:
                probs = cfg.score_together([j.checked for j in live], self.dedup)
                self.batched += len(live)
        except Exception as e:  # noqa: BLE001 - every waiting request gets the failure
            for job in live:
                self._answer(job, e)
            return
        finally:
            self.calls += 1
        for job, p in zip(live, probs, strict=True):
            try:
                self._answer(job, finite(p))
            except NonFinite as e:
                self._answer(job, e)

    @staticmethod
    def _answer(job: Job, result) -> None:
        loop = job.done.get_loop()

        def resolve() -> None:
            if job.done.done():
                return
            if isinstance(result, BaseException):
                job.done.set_exception(result)
            else:
                job.done.set_result(result)

        loop.call_soon_threadsafe(resolve)
