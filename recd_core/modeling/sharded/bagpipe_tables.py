"""BagPipe's cache in training (bagpipe.py: the oracle), over FlexShard's tables
(flexshard_tables.py): before each step a rank brings into its cache the remote rows the
step reads, keeps those its next `lookahead` steps read again (within `budget` rows), and
reads them there.

    before step s   the oracle's plan (bagpipe.py): the remote rows the rank reads at s,
                    and of those it holds, the ones it reads again within the lookahead
                    before any other rank does, within the budget; rows not held, or
                    stale, fetched from their owners (weights and accumulators, one
                    exchange)
    forward         a cached row's lookups are served from the cache; the rest as before
    backward        a cached row's gradient, summed over the rank's lookups, goes to its
                    owner with the other gradients (write-through): the owner stays the
                    authority and updates every row exactly as without the cache; a held
                    row only this rank read takes the same step in the cache, a held row
                    another rank read is marked stale (refreshed before its next use)

So the cache never changes what is computed, only where a lookup is served (the run ends
where the uncached one does, up to the order of float sums); checkpoints and the saved
model are the owners' rows, and hold no cache. A forward the cache was not prepared for
(validation, the fold-in, a new pass's restored tables) reads the owners; a training one
empties the cache first.

The fetch is not yet overlapped with the step before (BagPipe's background prefetch): the
bytes are counted as the oracle classifies them (`sent["fetch_ahead"]`: those a prefetch
during the step before could move; `sent["fetch_late"]`: those updated in it), and the
step time includes both."""

from __future__ import annotations

import numpy as np
import torch

from recd_core.modeling.sharded.bagpipe import plan
from recd_core.modeling.sharded.flexshard_tables import FlexShardTables


class CachedTables(FlexShardTables):
    """FlexShard's tables with each rank's oracle cache of remote rows (module doc).

    cache_key  int64 [C]       the rows held, keyed across tables, ascending
    cache_w    float32 [C, d]  their weights
    cache_acc  float32 [C]     their Adagrad accumulators
    stale      bool [C]        updated by another rank since fetched
    """

    def __init__(self, *args, lookahead: int = 4, budget_rows: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.lookahead, self.budget_rows = lookahead, budget_rows
        self._empty()
        self.armed = False  # prepared for the next forward (before_step)
        self.others: np.ndarray = np.zeros(0, np.int64)  # keys other ranks read this step
        self.hits = self.lookups = 0

    def _empty(self) -> None:
        self.cache_key = np.zeros(0, np.int64)
        self.cache_w = torch.zeros(0, self.dim, device=self.device)
        self.cache_acc = torch.zeros(0, device=self.device)
        self.stale = np.zeros(0, bool)

    # -- before a step ------------------------------------------------------------------
    def before_step(self, mine: list[np.ndarray], others: list[np.ndarray], before):
        """Prepare the cache for the next forward: `mine`: this rank's keys read at this
        step and the next ones (one array a step, `lookahead` at most); `others`: the keys
        other ranks read at the same steps (the first: what goes stale in this one);
        `before`: the keys read by anyone at the step before (what a prefetch could not
        have moved)."""
        remote = [np.unique(k[self.server[k] != self.rank]) for k in mine]
        want = plan(
            remote, 0, self.lookahead, self.budget_rows, others, self.cache_key[~self.stale]
        )
        keep = np.isin(self.cache_key, want) & ~self.stale
        fetch = np.setdiff1d(want, self.cache_key[keep], assume_unique=True)
        late = np.isin(fetch, before)
        w, acc = self._fetch(fetch, late)
        key = np.concatenate([self.cache_key[keep], fetch])
        order = np.argsort(key)
        idx = torch.from_numpy(np.flatnonzero(keep)).to(self.device)
        self.cache_key = key[order]
        at = torch.from_numpy(order).to(self.device)
        self.cache_w = torch.cat([self.cache_w[idx], w])[at]
        self.cache_acc = torch.cat([self.cache_acc[idx], acc])[at]
        self.stale = np.zeros(len(self.cache_key), bool)
        self.others = others[0]
        self.armed = True

    def _fetch(self, keys: np.ndarray, late: np.ndarray):
        """The owners' weights and accumulators of `keys` (a collective)."""
        owner = self.server[keys]  # a remote row's server is its owner (cold) or copy
        order = np.argsort(owner, kind="stable")
        send = np.bincount(owner, minlength=self.world)
        recv = self._exchange_counts(send)
        asked = self._all_to_all(torch.from_numpy(keys[order]), send, recv, "fetch_ids").numpy()
        pos = torch.from_numpy(self.local[asked]).to(self.device)
        rows = torch.cat([self.all_weights[pos], self.all_accs[pos].unsqueeze(1)], 1)
        got = self._all_to_all(rows, recv, send, "fetch_rows")
        back = torch.empty_like(got)
        back[torch.from_numpy(order).to(got.device)] = got
        row = 4 * (self.dim + 1) + 8
        self.sent["fetch_late"] += row * int(late[owner != self.rank].sum())
        self.sent["fetch_ahead"] += row * int((~late)[owner != self.rank].sum())
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
        keys = tables.keys_of(which, values)
        cached = np.isin(keys, tables.cache_key)
        tables.hits += int(cached.sum())
        tables.lookups += int((tables.server[keys] != tables.rank).sum())
        far = np.flatnonzero(~cached)
        order, send, recv, pos = tables._route_keys(keys[far])
        served = tables._serve(pos)
        back = tables._all_to_all(served, recv, send, "vectors")
        out = torch.empty(len(keys), tables.dim, device=back.device)
        out[torch.from_numpy(far[order]).to(back.device)] = back
        near = np.flatnonzero(cached)
        slot = np.searchsorted(tables.cache_key, keys[near])
        out[torch.from_numpy(near).to(out.device)] = tables.cache_w[
            torch.from_numpy(slot).to(out.device)
        ]
        ctx.tables, ctx.route = tables, (keys, far, near, order, send, recv, pos)
        return out

    @staticmethod
    def backward(ctx, grad):
        tables = ctx.tables
        keys, far, near, order, send, recv, pos = ctx.route
        grads = tables._all_to_all(
            grad[torch.from_numpy(far[order]).to(grad.device)], send, recv, "gradients"
        )
        # the cached rows' gradients, summed here, written through to their owners
        rows, g = tables._summed(keys[near], grad[torch.from_numpy(near).to(grad.device)])
        owner = tables.server[rows] if len(rows) else np.zeros(0, np.int32)
        w_order = np.argsort(owner, kind="stable")
        w_send = np.bincount(owner, minlength=tables.world)
        w_recv = tables._exchange_counts(w_send)
        w_keys = tables._all_to_all(
            torch.from_numpy(rows[w_order]), w_send, w_recv, "write_ids"
        ).numpy()
        w_grads = tables._all_to_all(
            g[torch.from_numpy(w_order).to(g.device)], w_send, w_recv, "write_through"
        )
        tables._update(np.concatenate([pos, tables.local[w_keys]]), torch.cat([grads, w_grads]))
        tables._after(rows, g)
        return None, None, None, None
