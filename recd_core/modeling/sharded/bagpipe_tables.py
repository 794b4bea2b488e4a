"""BagPipe's cache in training (bagpipe.py: the oracle), over FlexShard's tables
(flexshard_tables.py): before each step a rank brings into its cache the remote rows the
step reads, keeps those its next `lookahead` steps read again (within `budget` rows), and
reads them there; the oracle and the fetches of the step after run in the background while
a step computes (BagPipe's prefetch).

    step s-1 runs ──────────────────────────────▶│ step s runs ───────────────────▶
    background:  the oracle's view of step s     │ background: the view of s+1, its
                 (its batches' keys, the plan);   │   fetches ahead ...
                 the rows s fetches that nobody   │
                 reads (so updates) at s-1,       │
                 fetched from their owners        │
                 (their own process group)        │
                                   before step s: the view taken; the rows s fetches
                                   that were updated at s-1 (or stale) fetched now,
                                   after the update (the step's critical path)

    forward      a cached row's lookups are served from the cache; the rest as before
    backward     a cached row's gradient, summed over the rank's lookups, goes to its
                 owner with the other gradients (write-through): the owner stays the
                 authority and updates every row exactly as without the cache; a held
                 row only this rank read takes the same step in the cache, a held row
                 another rank read is marked stale (refreshed before its next use)

So the cache never changes what is computed, only where a lookup is served (the run ends
where the uncached one does, up to the order of float sums): a row fetched during step s-1
is one no rank updates in it, and its owner serves it after its own step s-2. Checkpoints
and the saved model are the owners' rows, and hold no cache. A forward the cache was not
prepared for (validation, the fold-in, a new pass's restored tables) reads the owners; a
training one empties the cache first. `background=False` runs the oracle and every fetch at
the step's start (the same rows, on the critical path: what the prefetch saves)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from recd_core.modeling.sharded.bagpipe import plan
from recd_core.modeling.sharded.flexshard_tables import FlexShardTables

# batch index -> every rank's keys read at it (one array a rank)
KeysAt = Callable[[int], list[np.ndarray]]


@dataclass
class View:
    """The oracle's decision for one step of this rank, made ahead (bagpipe.py's `plan`)."""

    step: int
    want: np.ndarray  # the rows held while the step runs, ascending
    others: np.ndarray  # the keys other ranks read at the step (held copies go stale)
    ahead: np.ndarray  # the rows it fetches that nobody reads at the step before
    # every rank's reads of the step fit its budget, so the plan holds them all: no rank
    # looks a row up remotely (the step skips the lookups' exchange)
    no_miss: bool = False
    rows: tuple | None = None  # (weights, accumulators) of `ahead`, once fetched
    spent: Counter = field(default_factory=Counter)  # the job's bytes and seconds


class CachedTables(FlexShardTables):
    """FlexShard's tables with each rank's oracle cache of remote rows (module doc).

    cache_key  int64 [C]       the rows held, keyed across tables, ascending
    cache_w    float32 [C, d]  their weights
    cache_acc  float32 [C]     their Adagrad accumulators
    stale      bool [C]        updated by another rank since fetched
    """

    def __init__(
        self, *args, lookahead: int = 4, budget_rows: int = 0, background: bool = True, **kwargs
    ):
        super().__init__(*args, **kwargs)
        self.lookahead, self.budget_rows = lookahead, budget_rows
        self._empty()
        self.armed = False  # prepared for the next forward (before_step)
        self.others: np.ndarray = np.zeros(0, np.int64)  # keys other ranks read this step
        self.no_miss = False  # this step's reads all cached, on every rank (View)
        self.hits = self.lookups = 0
        self.seen: dict[int, tuple] = {}  # batch -> its rows, as `_read` gives them
        self.worker = self.prefetch_group = self.stream = None
        self.pending: Future | None = None  # the background job: the next step's View
        if background:
            self.prefetch_group = dist.new_group()  # its fetches beside the step's exchanges
            self.worker = ThreadPoolExecutor(1, thread_name_prefix="bagpipe-prefetch")
            if self.device.type == "cuda":
                self.stream = torch.cuda.Stream(self.device)

    def _empty(self) -> None:
        self.cache_key = np.zeros(0, np.int64)
        self.cache_w = torch.zeros(0, self.dim, device=self.device)
        self.cache_acc = torch.zeros(0, device=self.device)
        self.stale = np.zeros(0, bool)

    # -- before a step ------------------------------------------------------------------
    def before_step(self, k: int, order, keys_at: KeysAt) -> None:
        """Prepare the cache for step `k` of a pass over the batches `order` (`keys_at`:
        every rank's keys read at a batch): the background job's view of it (or, with
        none, the oracle's now), the rows it did not fetch fetched now; then the job of
        step k+1 started. A collective (the same on every rank)."""
        t0 = time.perf_counter()
        if k == 0:  # a new pass (its tables may be restored): nothing held is known
            self.drain()
            self._empty()
            self.seen = {}
        view = self._taken(k)
        if view is None:
            view = self._view(k, order, keys_at, self.cache_key[~self.stale])
            self._account(view)
        keep = np.isin(self.cache_key, view.want) & ~self.stale
        need = np.setdiff1d(view.want, self.cache_key[keep], assume_unique=True)
        got_key, got_w, got_acc = np.zeros(0, np.int64), self.cache_w[:0], self.cache_acc[:0]
        if view.rows is not None:  # fetched ahead: the ones still needed
            use = np.isin(view.ahead, need)
            at = torch.from_numpy(np.flatnonzero(use)).to(self.device)
            got_key, got_w, got_acc = view.ahead[use], view.rows[0][at], view.rows[1][at]
        late = np.setdiff1d(need, got_key, assume_unique=True)
        w, acc = self._fetch(late, None, self.sent, "fetch")
        key = np.concatenate([self.cache_key[keep], got_key, late])
        order_ = np.argsort(key)
        idx = torch.from_numpy(np.flatnonzero(keep)).to(self.device)
        at = torch.from_numpy(order_).to(self.device)
        self.cache_key = key[order_]
        self.cache_w = torch.cat([self.cache_w[idx], got_w, w])[at]
        self.cache_acc = torch.cat([self.cache_acc[idx], got_acc, acc])[at]
        self.stale = np.zeros(len(self.cache_key), bool)
        self.others, self.no_miss, self.armed = view.others, view.no_miss, True
        if self.worker is not None and k + 1 < len(order):
            # held after step k: what it wants, less what other ranks update in it
            held = view.want[~np.isin(view.want, view.others)]
            if self.stream is not None:  # the owners' rows as step k-1 left them
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            self.pending = self.worker.submit(self._ahead, k + 1, order, keys_at, held)
        self.timed["prepare"] += time.perf_counter() - t0

    def _view(self, s: int, order, keys_at: KeysAt, held: np.ndarray) -> View:
        """The oracle's view of step `s`, from the `lookahead` batches from s on and the
        one before (`held`: the fresh copies held when it starts)."""
        t0 = time.perf_counter()
        every = [
            self._read(int(order[j]), keys_at)
            for j in range(s, min(s + self.lookahead, len(order)))
        ]
        remote, others = [e[0] for e in every], [e[1] for e in every]
        want = plan(remote, 0, self.lookahead, self.budget_rows, others, held)
        fetch = np.setdiff1d(want, held, assume_unique=True)
        before = self._read(int(order[s - 1]), keys_at)[2] if s else np.zeros(0, np.int64)
        no_miss = every[0][3] <= self.budget_rows
        view = View(s, want, others[0], fetch[~np.isin(fetch, before)], no_miss)
        view.spent["oracle"] += time.perf_counter() - t0
        return view

    def _read(self, i: int, keys_at: KeysAt) -> tuple:
        """Batch i's (this rank's remote rows, the rows other ranks read, all rows read, the
        most rows one rank reads), kept for the steps that look at it again (the oracle's
        thread only)."""
        if i not in self.seen:
            keys = keys_at(i)
            mine = keys[self.rank]
            self.seen[i] = (
                np.unique(mine[self.server[mine] != self.rank]),
                _union(keys[: self.rank] + keys[self.rank + 1 :]),
                _union(keys),
                max(len(np.unique(k)) for k in keys),
            )
            while len(self.seen) > self.lookahead + 2:
                self.seen.pop(next(iter(self.seen)))
        return self.seen[i]

    def _ahead(self, s: int, order, keys_at: KeysAt, held: np.ndarray) -> View:
        """The background job: step s's view, its rows fetched ahead (nobody updates them
        in the step running meanwhile) on the prefetch group."""
        view = self._view(s, order, keys_at, held)
        t0 = time.perf_counter()
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            view.rows = self._fetch(view.ahead, self.prefetch_group, view.spent, "prefetch")
        view.spent["prefetch"] += time.perf_counter() - t0
        return view

    def _taken(self, k: int) -> View | None:
        """The background job's view of step k (waited for), or None."""
        if self.pending is None:
            return None
        view, self.pending = self.pending.result(), None
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self._account(view)
        return view if view.step == k else None

    def _account(self, view: View) -> None:
        for what, n in view.spent.items():  # seconds (the oracle's, the fetches'), bytes
            (self.timed if what in ("oracle", "prefetch") else self.sent)[what] += n

    def drain(self) -> None:
        """Wait for the background job and drop it (the run's end, a new pass)."""
        if self.pending is not None:
            self._taken(-1)

    def _fetch(self, keys: np.ndarray, group, sent: Counter, what: str):
        """The owners' weights and accumulators of `keys` (a collective on `group`)."""
        owner = self.server[keys]  # a remote row's server is its owner (cold) or copy
        order = np.argsort(owner, kind="stable")
        send = np.bincount(owner, minlength=self.world)
        recv = self._exchange_counts(send, group)
        asked = self._all_to_all(
            torch.from_numpy(keys[order]), send, recv, f"{what}_ids", group, sent
        ).numpy()
        pos = torch.from_numpy(self.local[asked]).to(self.device)
        rows = torch.cat([self.all_weights[pos], self.all_accs[pos].unsqueeze(1)], 1)
        got = self._all_to_all(rows, recv, send, f"{what}_rows", group, sent)
        back = torch.empty_like(got)
        back[torch.from_numpy(order).to(got.device)] = got
        return back[:, : self.dim].contiguous(), back[:, self.dim].contiguous()

    # -- a step ---------------------------------------------------------------------------
    def _lookup(self, tables, values):
        grad_on = torch.is_grad_enabled() and self.training
        if not self.armed and grad_on and len(self.cache_key):
            self._empty()  # tables trained without the cache: the copies may be stale
        if not (self.armed and grad_on):
            return super()._lookup(tables, values)
        self.armed = False
        anchor = torch.zeros((), device=self.device, requires_grad=True)
        return _CachedLookup.apply(anchor, self, tables, values)

    @torch.no_grad()
    def _after(self, keys: np.ndarray, g: torch.Tensor) -> None:
        """The cached rows this rank read (`keys`, their summed gradients `g`): those no
        other rank read take the owner's step here too; every held row another rank read
        is stale."""
        read_elsewhere = np.isin(self.cache_key, self.others)
        mine = ~np.isin(keys, self.others)
        at = torch.from_numpy(np.searchsorted(self.cache_key, keys[mine])).to(self.device)
        step = g[torch.from_numpy(np.flatnonzero(mine)).to(g.device)] / self.world
        if len(at):
            self.cache_acc.index_add_(0, at, step.pow(2).mean(1))
            scale = self.lr / (self.cache_acc.index_select(0, at).sqrt() + self.eps)
            self.cache_w.index_add_(0, at, -scale.unsqueeze(1) * step)
        self.stale |= read_elsewhere


class _CachedLookup(torch.autograd.Function):
    """The step's lookups, a cached row's from the cache; backward writes the cached rows'
    gradients through to their owners with the others."""

    @staticmethod
    def forward(ctx, anchor, tables: CachedTables, which: list[int], values: list):
        t0 = time.perf_counter()
        keys = tables.keys_of(which, values)
        cached = np.isin(keys, tables.cache_key)
        tables.hits += int(cached.sum())
        tables.lookups += int((tables.server[keys] != tables.rank).sum())
        far = np.flatnonzero(~cached)
        out = torch.empty(len(keys), tables.dim, device=tables.device)
        route = None
        if not tables.no_miss:  # some rank looks rows up remotely: the exchange
            order, send, recv, pos = tables._route_keys(keys[far])
            back = tables._all_to_all(tables._serve(pos), recv, send, "vectors")
            out[torch.from_numpy(far[order]).to(back.device)] = back
            route = order, send, recv, pos
        elif len(far) and (tables.server[keys[far]] != tables.rank).any():
            raise RuntimeError("the oracle held every remote row of the step, yet one is not")
        else:  # this rank's own rows
            out[torch.from_numpy(far).to(out.device)] = tables._serve(tables.local[keys[far]])
        near = np.flatnonzero(cached)
        slot = np.searchsorted(tables.cache_key, keys[near])
        out[torch.from_numpy(near).to(out.device)] = tables.cache_w[
            torch.from_numpy(slot).to(out.device)
        ]
        ctx.tables, ctx.route = tables, (keys, far, near, route)
        tables.timed["lookup"] += time.perf_counter() - t0
        return out

    @staticmethod
    def backward(ctx, grad):
        t0 = time.perf_counter()
        tables = ctx.tables
        keys, far, near, route = ctx.route
        if route is not None:
            order, send, recv, pos = route
            grads = tables._all_to_all(
                grad[torch.from_numpy(far[order]).to(grad.device)], send, recv, "gradients"
            )
        else:  # this rank's own rows only
            pos, grads = tables.local[keys[far]], grad[torch.from_numpy(far).to(grad.device)]
        # the cached rows' gradients, summed here, written through to their owners: each
        # row's key (its int64 as two float32 lanes) beside its gradient, one exchange
        rows, g = tables._summed(keys[near], grad[torch.from_numpy(near).to(grad.device)])
        owner = tables.server[rows] if len(rows) else np.zeros(0, np.int32)
        w_order = np.argsort(owner, kind="stable")
        w_send = np.bincount(owner, minlength=tables.world)
        w_recv = tables._exchange_counts(w_send)
        lanes = torch.from_numpy(rows[w_order]).view(torch.float32).reshape(-1, 2)
        packed = torch.cat([lanes.to(g.device), g[torch.from_numpy(w_order).to(g.device)]], 1)
        got = tables._all_to_all(packed, w_send, w_recv, "write_through")
        w_keys = got[:, :2].cpu().contiguous().view(torch.int64).reshape(-1).numpy()
        tables._update(np.concatenate([pos, tables.local[w_keys]]), torch.cat([grads, got[:, 2:]]))
        tables._after(rows, g)
        tables.timed["backward"] += time.perf_counter() - t0
        return None, None, None, None


def _union(keys: list[np.ndarray]) -> np.ndarray:
    return np.unique(np.concatenate([np.zeros(0, np.int64), *keys]))
