"""Training throughput, dedup vs baseline, measured side by side (the training part of `recd bench`).

train_speedup        median baseline step time / median dedup step time; both modes train
                     their own copy of one initial model on the same batches, steps
                     interleaved (dedup, baseline, dedup, ...) so drift hits both alike
train_speedup_bound  Amdahl's bound 1 / ((1 - p) + p / f): p = the share of a baseline step
                     spent in deduplicable work (the grouped features' embedding bags and
                     history encoder, forward, backward and sparse update), profiled on
                     the baseline step; f = samples per unique row of the group
embedding workload   the same embedding-bag work (every id / id-list feature) as TorchRec's
                     EmbeddingBagCollection on a KJT, on a variable-batch KJT with
                     inverse_indices (VBE), and as our per-sample and unique+index_select
                     paths (only with the `torchrec` extra installed)
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from recd_core.config import TrainConfig
from recd_core.dedup.unique import DedupPlan, plan_dedup
from recd_core.dpp.batch_store import Batch
from recd_core.dpp.encode import batch_ranges, make_batch
from recd_core.modeling.cooccurrence import list_features, rows_loss
from recd_core.modeling.launch import peak_mem
from recd_core.modeling.model import DLRM
from recd_core.modeling.optim import RowWiseAdagrad, quiet_sparse_warnings
from recd_core.modeling.step import cooccurrence_term, make_optimizers, train_step
from recd_core.schema import feature_set_of


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _batches(table: pa.Table, cfg: TrainConfig, n: int, device: torch.device):
    features = feature_set_of(table.schema)
    plan = plan_dedup(table, features, cfg.dedup, cfg.batch_size)
    slices = batch_ranges(table.num_rows, cfg.batch_size)[:n]
    rows = [table.slice(lo, hi - lo) for lo, hi in slices if hi - lo == cfg.batch_size]
    dedup = [make_batch(r, features, plan).to(device) for r in rows]
    base = [make_batch(r, features, None).to(device) for r in rows]
    return features, plan, dedup, base


def dedupable_share(
    model: DLRM,
    base: Batch,
    dedup: Batch,
    grouped: set[str],
    cfg: TrainConfig,
    device,
    repeats: int,
) -> tuple[float, float, float]:
    """Profile of the baseline step: (p, step seconds, seconds of the grouped work on the
    unique rows only). p = the share of the step spent in the grouped features' work
    (embedding bags / history encoder forward + backward + sparse update) on all rows."""
    model = copy.deepcopy(model)
    opt_dense, opt_sparse = make_optimizers(model, cfg)
    tables = {model.table_of[n] for n in grouped if n in model.table_of} | {
        model.history_table[n] for n in grouped if model.history_table.get(n)
    }
    group_params = [model.bags[t].weight for t in sorted(tables)] + [
        model.history[n].embedding.weight
        for n in grouped
        if n in model.history and model.history[n].embedding is not None
    ]
    sparse_group = RowWiseAdagrad(group_params, lr=cfg.lr_sparse) if group_params else None
    all_rows = {n: jt for n, jt in base.kjt.to_dict().items() if n in grouped}
    unique_rows = {n: jt for ik in dedup.groups.values() for n, jt in ik.unique.to_dict().items()}

    aux = cooccurrence_term(model, cfg, 0)
    lists = list_features(model.features)

    def group_work(jts):
        for p in model.parameters():
            p.grad = None
        outs = [model._encode(n, jt)[0].sum() for n, jt in jts.items()]
        if aux is not None:  # the list co-occurrence loss is the group's work too
            rows = [
                (n, jt, torch.ones(jt.lengths.numel(), device=jt.values.device))
                for n, jt in sorted(jts.items())
                if n in lists
            ]
            gen = torch.Generator().manual_seed(cfg.seed)
            loss = rows_loss(model, rows, cfg.cooccurrence_negatives, gen)
            if loss is not None:
                outs.append(loss)
        torch.stack(outs).sum().backward()
        if sparse_group:
            sparse_group.step()

    def full_step():
        train_step(model, base, opt_dense, opt_sparse, False, aux)

    group_t, unique_t, step_t = [], [], []
    for _ in range(repeats):
        group_t.append(_timed(lambda: group_work(all_rows), device))
        unique_t.append(_timed(lambda: group_work(unique_rows), device))
        step_t.append(_timed(full_step, device))
    step = statistics.median(step_t)
    # p below 1: the rest of the step (MLPs, item features, dense update) is never free, and
    # medians of noisy timings can put the grouped work at or above the whole step.
    return min(statistics.median(group_t) / step, 0.99), step, statistics.median(unique_t)


def bench_train(
    table: pa.Table, cfg: TrainConfig, repeats: int = 5, n_batches: int = 4, device: str = "cpu"
) -> dict:
    quiet_sparse_warnings()
    dev = torch.device(device)
    features, plan, dedup, base = _batches(table, cfg, n_batches, dev)
    if not dedup:
        raise ValueError(f"bench needs at least one full batch of {cfg.batch_size} rows")
    init = DLRM(features, cfg.model)
    models = {"dedup": copy.deepcopy(init).to(dev), "baseline": copy.deepcopy(init).to(dev)}
    opts = {m: make_optimizers(models[m], cfg) for m in models}
    times: dict[str, list[float]] = {"dedup": [], "baseline": []}

    def step(m: str, b, k: int) -> None:  # a training step as `recd train` takes it
        train_step(models[m], b, *opts[m], False, cooccurrence_term(models[m], cfg, k))

    for m, batches in (("dedup", dedup), ("baseline", base)):  # warm-up
        step(m, batches[0], 0)
    for r in range(repeats):
        for m, batches in (("dedup", dedup), ("baseline", base)):
            b = batches[r % len(batches)]
            times[m].append(_timed(lambda m=m, b=b, r=r: step(m, b, r + 1), dev))
    med = {m: statistics.median(t) for m, t in times.items()}
    group = next(iter(plan.groups.values()), [])
    factor = (
        statistics.mean(b.size / ik.num_unique for b in dedup for ik in b.groups.values())
        if plan.groups
        else 1.0
    )
    p, step, unique_s = dedupable_share(
        init.to(dev), base[0], dedup[0], set(group), cfg, dev, max(3, repeats // 2)
    )
    bound = 1.0 / ((1 - p) + p / factor)
    component_bound = step / (step * (1 - p) + unique_s)
    speedup = med["baseline"] / med["dedup"]
    return {
        "bench.train_speedup": speedup,
        "bench.train_speedup_bound": bound,
        "bench.train_speedup_of_bound": speedup / bound,
        "bench.train_speedup_component_bound": component_bound,
        "bench.train_speedup_of_component_bound": speedup / component_bound,
        "train.samples_per_s.dedup": cfg.batch_size / med["dedup"],
        "train.samples_per_s.baseline": cfg.batch_size / med["baseline"],
        "train.step_ms.dedup": 1000 * med["dedup"],
        "train.step_ms.baseline": 1000 * med["baseline"],
        "train.dedupable_share": p,
        "train.group_dedup_factor": factor,
        "train.batch_size": cfg.batch_size,
        "train.repeats": repeats,
        "train.device": str(dev),
    }


def _memory_probe(args) -> int:
    """Peak memory of a few training steps in one mode (run in a fresh process)."""
    table_path, cfg_json, mode, device = args
    quiet_sparse_warnings()

    cfg = TrainConfig.model_validate_json(cfg_json)
    table = pq.read_table(table_path)
    dev = torch.device(device)
    features, plan, dedup, base = _batches(table, cfg, 2, dev)
    model = DLRM(features, cfg.model).to(dev)
    opts = make_optimizers(model, cfg)
    for k, b in enumerate(dedup if mode == "dedup" else base):
        train_step(model, b, *opts, False, cooccurrence_term(model, cfg, k))
    return peak_mem(dev)


def peak_memory(table: pa.Table, cfg: TrainConfig, tmp_dir: str, device: str = "cpu") -> dict:

    path = f"{tmp_dir}/bench_batches.parquet"
    pq.write_table(table.slice(0, 2 * cfg.batch_size), path)
    ctx = mp.get_context("spawn")
    out = {}
    for mode in ("dedup", "baseline"):
        with ctx.Pool(1) as pool:
            out[f"train.peak_mem_bytes.{mode}"] = pool.map(
                _memory_probe, [(path, cfg.model_dump_json(), mode, device)]
            )[0]
    return out


def bench_embeddings(table: pa.Table, cfg: TrainConfig, repeats: int = 5) -> dict:
    """Embedding bags only (fwd + bwd + sparse Adagrad) on one batch: TorchRec vs ours."""
    try:
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    except ImportError:
        return {}
    from recd_core.dedup.sparse import KeyedJaggedTensor, to_torchrec

    features = feature_set_of(table.schema)
    plan = plan_dedup(table, features, cfg.dedup, cfg.batch_size)
    names = [f.name for f in features.features if f.kind in ("sparse", "id_list")]
    rows = table.slice(0, cfg.batch_size)
    flat = make_batch(rows, features, None)
    grouped = [n for n in names if n in plan.grouped]
    per_sample = [n for n in names if n not in plan.grouped]
    d = cfg.model.embedding_dim
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=f"t_{n}",
                embedding_dim=d,
                num_embeddings=features[n].table_size,
                feature_names=[n],
            )
            for n in names
        ]
    )
    for bag in ebc.embedding_bags.values():
        bag.sparse = True  # sparse gradients, as in our model
    # the grouped features' IKJT, transformed exactly as the DPP does
    ik_group = make_batch(rows, features, DedupPlan(groups={"user": grouped}, profile={})).groups[
        "user"
    ]
    per_kjt = KeyedJaggedTensor(per_sample, *_kv(flat.kjt, per_sample))
    vbe = _vbe(ik_group, per_kjt)
    keys = grouped + per_sample
    trec_kjt = to_torchrec(KeyedJaggedTensor(keys, *_kv(flat.kjt, keys)))
    opt = torch.optim.Adagrad(ebc.parameters(), lr=cfg.lr_sparse)

    def trec_step(kjt):
        opt.zero_grad(set_to_none=True)
        out = ebc(kjt)
        out.values().sum().backward()
        opt.step()

    bags = {
        n: torch.nn.EmbeddingBag(features[n].table_size, d, mode="sum", sparse=True) for n in names
    }
    opt2 = torch.optim.Adagrad([b.weight for b in bags.values()], lr=cfg.lr_sparse)

    def ours(dedup: bool):
        opt2.zero_grad(set_to_none=True)
        outs = []
        if dedup:
            inv = ik_group.inverse_indices
            for n in grouped:
                jt = ik_group.unique[n]
                outs.append(bags[n](jt.values, jt.offsets[:-1]).index_select(0, inv))
            for n in per_sample:
                jt = flat.kjt[n]
                outs.append(bags[n](jt.values, jt.offsets[:-1]))
        else:
            for n in names:
                jt = flat.kjt[n]
                outs.append(bags[n](jt.values, jt.offsets[:-1]))
        torch.stack([o.sum() for o in outs]).sum().backward()
        opt2.step()

    variants = {
        "torchrec_kjt": lambda: trec_step(trec_kjt),
        "torchrec_vbe": lambda: trec_step(vbe),
        "ours_all_rows": lambda: ours(False),
        "ours_dedup": lambda: ours(True),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        fn()
    for _ in range(repeats):
        for k, fn in variants.items():
            times[k].append(_timed(fn, torch.device("cpu")))
    med = {k: 1000 * statistics.median(v) for k, v in times.items()}
    return {
        **{f"embedding.step_ms.{k}": v for k, v in med.items()},
        "bench.embedding_speedup_vs_torchrec_kjt": med["torchrec_kjt"] / med["ours_dedup"],
        "bench.embedding_speedup_vs_torchrec_vbe": med["torchrec_vbe"] / med["ours_dedup"],
    }


def _kv(kjt, keys):
    return torch.cat([kjt[k].values for k in keys]), torch.cat([kjt[k].lengths for k in keys])


def _vbe(ik_group, per_kjt):
    """TorchRec variable-batch KJT: grouped keys with the group's unique rows and inverse,
    per-sample keys with all rows and the identity inverse."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TrecKJT

    b = ik_group.batch_size
    keys = ik_group.keys + per_kjt.keys
    inv = torch.stack(
        [ik_group.inverse_indices] * len(ik_group.keys) + [torch.arange(b)] * len(per_kjt.keys)
    )
    strides = [[ik_group.num_unique]] * len(ik_group.keys) + [[b]] * len(per_kjt.keys)
    return TrecKJT(
        keys=keys,
        values=torch.cat([ik_group.unique.values, per_kjt.values]),
        lengths=torch.cat([ik_group.unique.lengths, per_kjt.lengths]),
        stride_per_key_per_rank=strides,
        inverse_indices=(keys, inv),
    )
