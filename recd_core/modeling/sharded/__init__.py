"""Embedding tables beyond one process: the DLRM's tables as one TorchRec
`EmbeddingCollection`, sharded across the run's processes by `DistributedModelParallel`
(`TrainConfig.sharding`); the dense part stays data parallel (DDP, which DMP wraps it in).

    rank r's part of the batch (rows r*B/N ..)          every rank
    ┌────────────────────────────────────────┐
    │ item-side keys: B/N rows               │── input all-to-all ──┐  ids to the ranks
    │ user-side group keys: its U unique     │   (ids: unique rows  │  holding their rows
    │   rows, then B/N - U empty rows        │    only)             ▼
    └────────────────────────────────────────┘        lookups on the local shards (fused
    per-id vectors, unique rows only  ◀── output all-to-all ──┘   row-wise Adagrad in backward)
        │ pooled by the DLRM (mean/sum of a row's ids), a history's tokens gathered
        ▼ (HistoryEncoder on the unique rows), expanded to samples by `inverse_indices`
    dense layers (DDP)

The rooms, by concern:

    tables.py       the tables as one EmbeddingCollection, their specs, the batch as
                    TorchRec's input, where this rank's shards sit
    model.py        ShardedDLRM: the DLRM looking its ids up in the sharded tables
    plan.py         placing the tables (TorchRec's planner within a memory budget), the
                    one-line refusals, where they went
    state.py        the single-process layout gathered onto rank 0, or the shards written
                    as files by every rank, and scattered back on any N; the fused
                    optimizer's state as the training loop sees it
    checkpoints.py  a run's checkpoints as shard files (../shard_files.py; resharded
                    on load: a resume may use another N)
    metrics.py      NE and AUC by torchrec.metrics over the ranks (a cross-check)
    strategy.py     `Sharded`: the parallelism strategy training asks (modeling/parallel.py);
                    `FlexSharded`: the same with the tables placed by FlexShard
    flexshard.py    FlexShard's tiers of a table by how often its rows are read, within a
                    row budget, and the all-to-all traffic model of each placement
    flexshard_tables.py  training on that placement (not TorchRec's): the step's exchange,
                    the copies' sparse gradient sync, the fused row-wise Adagrad
    bagpipe.py      BagPipe's oracle cacher over the known next batches, and a model of
                    the bytes a step then waits for and prefetches
    bagpipe_tables.py  the cache in training, over FlexShard's tables (never read stale)

Why an EmbeddingCollection (one vector per id) and not a pooled EmbeddingBagCollection: the
DLRM's tables are shared by pooled features and histories (the clicked items' history reads
the item table token by token), and a TorchRec table belongs to one module. Why the group
keys are padded rows and not a variable-batch KJT: TorchRec 1.8's EmbeddingCollection
expands a variable-batch KJT's output to every sample (measured), and the history encoder
must run on the unique rows; both carry the same vectors through the all-to-alls, the
padding adds a zero length (8 bytes) a padding row and key to the ids' (tested).

Optimizer: the tables train with FBGEMM's fused EXACT_ROWWISE_ADAGRAD (the update runs in
the backward pass), the same rule as modeling/optim.py's RowWiseAdagrad. TorchRec sums a
row's gradient over the ranks while DDP averages the dense ones; row-wise Adagrad from a
zero accumulator does not change with the gradient's scale, so the two agree (a non-zero
`adagrad_initial_accumulator` is refused).
"""
