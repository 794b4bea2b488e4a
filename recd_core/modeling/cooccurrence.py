"""An auxiliary loss that teaches the embedding tables which ids go together.

Why: a click teaches the ids of one impression a little; an id seen in a few impressions a
day barely moves from its random start, so on one day's data the model learns the
user-item match slowly (on the standard preset's first day it had learned about half of
the topic match the generator draws clicks from). The user's own lists say more: the
creators a user follows, the categories she likes, the items she clicked lean to her
interests, so ids that share lists share interests. Predicting a list's members from the
rest of the list (item2vec's and CBOW's objective; CL4CTR, Wang et al. WSDM 2023, adds
such self-supervised losses to CTR models for the same reason) trains those tables on
every id of every list, and a table a list shares with the item (followed creators and the
item's creator, clicked items and the shown item) then scores an item against the user's
lists from the first day.

How, per user-side list feature (id lists and the history), for each row with at least two
ids:

    row   [a b c d e f]     members split by position: even [a c e], odd [b d f]
    even members are scored against the mean of the odd ones, and odd against even
    score(member) = mean(other half) . e(member), a softmax against `negatives` ids drawn
    from the batch's distinct ids of the feature (one draw per step, shared by all rows;
    a drawn id equal to the member is left out)

A row's loss is the mean over its members; rows are weighted by their samples. The loss is
a function of the rows' contents only, so it is the same on a group's unique rows (weighted
by their duplicates: RecD computes it once per unique row) as on every sample's copy (the
baseline arm): both arms train on the same objective. Halves rather than leave-one-out:
each half's mean is one vector, so the negatives are scored once per half-row, not once
per member (the baseline arm has every member of every sample).

It helps where users carry several topical lists (the synthetic workload) and hurts on
MovieLens, whose one list is the rated items' history, so MovieLens' config turns it off
(the figures: docs/journal.md).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from recd_core.config import FeatureSet
from recd_core.dedup.sparse import JaggedTensor
from recd_core.dpp.batch_store import Batch
from recd_core.modeling.model import members_of


def list_features(features: FeatureSet) -> set[str]:
    """The features the loss runs on: the user-side id lists and histories."""
    return {
        f.name for f in features.features if f.side == "user" and f.kind in ("id_list", "sequence")
    }


def list_rows(model, batch: Batch) -> list[tuple[str, JaggedTensor, torch.Tensor]]:
    """(feature, its rows, each row's sample count) for each user-side id list and history:
    a group's unique rows with their duplicates counted, or per-sample rows (count 1)."""
    wanted = list_features(model.features)
    out = []
    for ik in batch.groups.values():
        counts = torch.bincount(ik.inverse_indices, minlength=ik.num_unique).to(torch.float32)
        out += [(n, jt, counts) for n, jt in ik.unique.to_dict().items() if n in wanted]
    if batch.kjt is not None:
        for n, jt in batch.kjt.to_dict().items():
            if n in wanted:
                ones = torch.ones(jt.lengths.numel(), device=jt.values.device)
                out.append((n, jt, ones))
    return sorted(out, key=lambda x: x[0])


def _negatives(values: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """`k` distinct ids among the batch's distinct `values` (all of them if fewer)."""
    pool = torch.unique(values)
    if pool.numel() <= k:
        return pool
    pick = torch.randperm(pool.numel(), generator=generator)[:k].to(pool.device)
    return pool[pick]


def _first_positions(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Where each of `ids` (all among `values`) first appears in `values`."""
    pool, inverse = torch.unique(values, return_inverse=True)
    order = torch.arange(values.numel(), device=values.device)
    first = torch.full_like(pool, values.numel()).scatter_reduce(0, inverse, order, "amin")
    return first[torch.searchsorted(pool, ids)]


def feature_loss(
    table: torch.Tensor | None,
    jt: JaggedTensor,
    counts: torch.Tensor,
    negatives: int,
    generator: torch.Generator,
    vectors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(sum of the weighted per-row losses, sum of the weights) for one feature's rows.
    `vectors`: the rows' ids already looked up ([nnz, d], a sharded model's, whose tables
    are not in this process) in place of `table`: a drawn negative is one of the rows' ids,
    so its vector is where it first appears."""
    lengths = jt.lengths
    n_rows = lengths.numel()
    rows_ok = lengths >= 2
    if not bool(rows_ok.any()):
        return None
    values = jt.values
    device = values.device
    row = torch.repeat_interleave(torch.arange(n_rows, device=device), lengths)
    pos_in_row = torch.arange(values.numel(), device=device) - jt.offsets[:-1][row]
    half = pos_in_row % 2
    emb = F.embedding(values, table, sparse=True) if vectors is None else vectors  # [M, d]
    seg = 2 * row + half
    sums = torch.zeros(2 * n_rows, emb.shape[1], device=device, dtype=emb.dtype)
    sums = sums.index_add(0, seg, emb)
    sizes = torch.bincount(seg, minlength=2 * n_rows).clamp(min=1).to(emb.dtype)
    context = sums / sizes.unsqueeze(1)  # [2R, d]: each half-row's mean
    other = 2 * row + (1 - half)  # the half a member is scored against
    pos = (context[other] * emb).sum(1)  # [M]
    neg_ids = _negatives(values, negatives, generator)
    if vectors is None:
        neg_emb = F.embedding(neg_ids, table, sparse=True)
    else:
        neg_emb = vectors[_first_positions(values, neg_ids)]
    neg_logits = context @ neg_emb.T  # [2R, K]
    neg_lse = torch.logsumexp(neg_logits, 1)[other]  # [M]
    # a drawn id equal to the member scores what the member does (same context, same
    # vector): the softmax over (member, negatives) is then the negatives' alone
    hit = torch.isin(values, neg_ids)
    loss = torch.where(hit, neg_lse, torch.logaddexp(neg_lse, pos)) - pos  # [M]
    weight = (counts / lengths.clamp(min=1))[row] * rows_ok[row]
    return (loss * weight).sum(), (counts * rows_ok).sum()


def cooccurrence_loss(
    model, batch: Batch, negatives: int, generator: torch.Generator
) -> torch.Tensor | None:
    """The mean over the user-side lists of their members' loss (see the module); None
    when the batch has no list with two ids in a row. An `Ensemble`: the sum of its
    members' losses, each on its own tables (as its click loss)."""
    rows = list_rows(model, batch)
    losses = [rows_loss(m, rows, negatives, generator) for m in members_of(model)]
    return None if losses[0] is None else torch.stack(losses).sum()


def rows_loss(
    model,
    rows: list[tuple[str, JaggedTensor, torch.Tensor]],
    negatives: int,
    generator: torch.Generator,
) -> torch.Tensor | None:
    """`cooccurrence_loss` of given (feature, rows, sample counts), as `list_rows` gives
    them (the training bench times it on the rows alone)."""
    losses = []
    for name, jt, counts in rows:
        looked_up = getattr(model, "looked_up", {})  # a sharded model's, from the forward
        if name in looked_up:
            part = feature_loss(None, jt, counts, negatives, generator, looked_up[name])
        else:
            part = feature_loss(model.table_for(name), jt, counts, negatives, generator)
        if part is not None:
            losses.append(part[0] / part[1].clamp(min=1))
    return torch.stack(losses).mean() if losses else None
