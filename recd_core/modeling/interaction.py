"""The DLRM's pairwise dots and the top MLP's first layer, a dedup group's part once per
unique row.

A sample's interaction vectors are [constant | bottom outputs | id features | histories
attended by the item] (n of them); the top MLP reads the bottom outputs and the n(n-1)/2
dots of distinct vectors (the upper triangle, row by row). In a dedup batch one group's
vectors (the user's ids, lists and history, computed on its unique rows) and the constant
are the same for every sample of a unique row, and so are their dots with each other and
those dots' share of the first layer. `split_logit` computes that part once a unique row:

    U [G, u, d]   the constant and the group's vectors, per unique row
    P [B, p, d]   the rest (bottom outputs, the item's features, history@item), per sample

    U·U  [G, u(u-1)/2] ── their columns of the first layer ── [G, h] ── by inverse ──┐
    P·U  [B, p, u]     ┐                                                             + ─ relu ─ top
    P·P  [B, p(p-1)/2] ┴─ with the bottom outputs: the other columns ── [B, h] ──────┘

and the factorization machine's weights over the dots split the same way.

For one ranking request (one user row, 1,000 candidates: u = 13, p = 9 of 22 vectors) the
user's 78 dots and their share of the first layer are computed once, not 1,000 times, and
the 1,000 x 22 x 22 products of the full interaction shrink to the 1,000 x 9 x 22 that
differ. The same products summed in another order: the full interaction's logits within
float roundoff (tests/test_train.py). `full_dots` is the full interaction (baseline
batches, cross layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F


def upper_pairs(n: int) -> list[tuple[int, int]]:
    """The pairs (i < j) of n vectors, row by row: the order of the dots the top MLP reads."""
    return [(i, j) for i in range(n) for j in range(i + 1, n)]


def full_dots(vecs: torch.Tensor, flat_pairs: torch.Tensor) -> torch.Tensor:
    """[B, n, d] -> [B, n(n-1)/2]: every pair's dot (`flat_pairs`: i * n + j per pair)."""
    return torch.bmm(vecs, vecs.transpose(1, 2)).flatten(1).index_select(1, flat_pairs)


@dataclass(frozen=True)
class Split:
    """Where each part of `split_logit` sits among the full interaction's inputs.

    `unique`, `per_sample`: the vector indices (of n) in U and in P. `u_pairs`, `p_pairs`: the
    flat indices (a * u + b) of U's and P's upper triangles. `u_columns`: the dot columns
    (of n(n-1)/2) of U·U's pairs; `s_columns`: of P·U (row by row) then P·P's."""

    unique: tuple[int, ...]
    per_sample: tuple[int, ...]
    u_pairs: torch.Tensor
    p_pairs: torch.Tensor
    u_columns: torch.Tensor
    s_columns: torch.Tensor

    @staticmethod
    def of(n: int, unique: list[int], device) -> Split:
        column = {pair: k for k, pair in enumerate(upper_pairs(n))}
        per_sample = [i for i in range(n) if i not in unique]
        u, p = len(unique), len(per_sample)

        def col(i: int, j: int) -> int:
            return column[min(i, j), max(i, j)]

        pu = [col(per_sample[a], unique[b]) for a in range(p) for b in range(u)]
        pp = [col(per_sample[a], per_sample[b]) for a, b in upper_pairs(p)]

        def t(values: list[int]) -> torch.Tensor:  # kept by the model: never an inference
            with torch.inference_mode(False):  # tensor (scoring's), which training refuses
                return torch.tensor(values, dtype=torch.long, device=device)

        return Split(
            tuple(unique),
            tuple(per_sample),
            t([a * u + b for a, b in upper_pairs(u)]),
            t([a * p + b for a, b in upper_pairs(p)]),
            t([col(unique[a], unique[b]) for a, b in upper_pairs(u)]),
            t(pu + pp),
        )


def split_logit(
    unique_vecs: torch.Tensor,
    sample_vecs: torch.Tensor,
    inverse: torch.Tensor,
    sides: list[torch.Tensor],
    split: Split,
    top: list[torch.nn.Module],
    fm: torch.nn.Linear | None,
) -> torch.Tensor:
    """The raw logit [B] (module doc): `unique_vecs` U [G, u, d], `sample_vecs` P [B, p, d],
    sample b's unique row `inverse[b]`; `sides` the bottom outputs ([B, d] each) the top MLP
    reads first; `top` the top MLP's layers, the first a Linear over [sides | dots]; `fm` the
    factorization machine's weights over the dots."""
    first, s = top[0], sum(x.shape[1] for x in sides)
    uu = full_dots(unique_vecs, split.u_pairs)  # [G, u(u-1)/2]
    expanded = unique_vecs.index_select(0, inverse)  # [B, u, d]
    pu = torch.bmm(sample_vecs, expanded.transpose(1, 2)).flatten(1)  # [B, p * u]
    pp = full_dots(sample_vecs, split.p_pairs)  # [B, p(p-1)/2]
    dots = torch.cat([pu, pp], dim=1)
    weight = first.weight
    w_sample = torch.cat([weight[:, :s], weight.index_select(1, s + split.s_columns)], dim=1)
    w_unique = weight.index_select(1, s + split.u_columns)
    if fm is not None:  # the fm's share of U·U rides with the first layer's: one product
        w_unique = torch.cat([w_unique, fm.weight.index_select(1, split.u_columns)])
    once = F.linear(uu, w_unique).index_select(0, inverse)  # [B, h (+ 1)]
    h = F.linear(torch.cat([*sides, dots], dim=1), w_sample, first.bias)
    h = h + once[:, : h.shape[1]]
    for layer in top[1:]:
        h = layer(h)
    if fm is not None:
        h = h + F.linear(dots, fm.weight.index_select(1, split.s_columns)) + once[:, -1:]
    return h.squeeze(1)
