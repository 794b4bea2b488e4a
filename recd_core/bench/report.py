"""`recd bench`'s report: the run's figures (`bench.json`) as the tables of `bench.md`
(what docs/benchmarks.md shows) and the headline chart next to the paper's ratios."""

from __future__ import annotations

from pathlib import Path

from recd_core.bench.lineage_cost import lineage_markdown
from recd_core.bench.serving import ranking_markdown, serving_markdown
from recd_core.bench.serving_load import load_markdown
from recd_core.report import human_bytes

PAPER = {"storage": 3.71, "DPP": 1.79, "training": 2.48}  # RecD (MLSys 2023), headline ratios


def chart(r: dict, path: Path) -> Path:
    """The headline ratios next to the paper's, with our measured bounds where we have them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = {
        "storage": r.get("bench.storage_ratio"),
        "DPP": r.get("bench.dpp_speedup"),
        "training": r.get("bench.train_speedup"),
    }
    names = [k for k, v in ours.items() if v is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(names))
    mine = ax.bar([i - 0.2 for i in x], [ours[n] for n in names], 0.4, label="recd (this run)")
    paper = ax.bar(
        [i + 0.2 for i in x], [PAPER[n] for n in names], 0.4, label="RecD paper", color="#bbbbbb"
    )
    ax.bar_label(mine, fmt="%.2fx")
    ax.bar_label(paper, fmt="%.2fx")
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    ax.set_xticks(list(x), names)
    ax.set_yscale("log")
    ax.set_ylabel("dedup / baseline (log scale)")
    ax.set_title(f"recd bench, {r['bench.preset']} preset, {r['bench.machine']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def markdown(r: dict) -> str:

    rows = [
        "| workload | rows | sessions | shuffled | clustered | ratio | lower bound | clustered / bound | dedup factor (clustered / shuffled) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("synthetic", "movielens"):
        s = r.get(name)
        if not s:
            continue
        label = (
            f"synthetic ({r['bench.preset']})"
            if name == "synthetic"
            else f"MovieLens ({s['data']})"
        )
        rows.append(
            f"| {label} | {s['rows']:,} | {s['sessions']:,} | {human_bytes(s['shuffled_bytes'])} | "
            f"{human_bytes(s['clustered_bytes'])} | **{s['storage_ratio']:.2f}x** | {human_bytes(s['lower_bound_bytes'])} | "
            f"{s['clustered_over_lower_bound']:.3f} | {s['dedup_factor_mean_clustered']:.1f} / {s['dedup_factor_mean_shuffled']:.2f} |"
        )
    if "bench.ingest_rows_per_s" in r:
        rows.append("")
        rows.append(
            f"Ingestion ({r['bench.preset']}): {r['bench.ingest_rows_per_s']:,.0f} rows/s, "
            f"{r['bench.ingest_mb_per_s']:.1f} MB/s of gzipped input, on {r['bench.machine']}."
        )
    if "bench.small_files.files" in r:
        rows.append(
            f"{r['bench.small_files.files']:,} one-line files: {r['bench.small_files.seconds_many']:.2f} s, "
            f"the same lines as one file {r['bench.small_files.seconds_one']:.2f} s "
            f"(**{r['bench.small_files.ratio']:.2f}x**; events files published: "
            f"{r['bench.small_files.events_files_many']} and {r['bench.small_files.events_files_one']})."
        )
    if "bench.dpp_speedup" in r:
        bs, pb = r.get("bench.dpp_batch_size", "?"), r.get("bench.dpp_pipeline_batch_size", "?")
        rows += [
            "",
            f"| DPP preprocessing (the stage, batch {bs}, 1 worker, {r.get('bench.dpp_repeats', '?')} "
            "repeats interleaved, medians) | dedup | baseline | ratio |",
            "|---|---|---|---|",
            f"| samples/s | {r['dpp.samples_per_s.dedup']:,.0f} | {r['dpp.samples_per_s.baseline']:,.0f} | "
            f"**{r['bench.dpp_speedup']:.2f}x** |",
        ]
        if "dpp.transform_samples_per_s.dedup" in r:
            rows += [
                f"| the transform alone (read, encode, write), samples/s | "
                f"{r['dpp.transform_samples_per_s.dedup']:,.0f} | "
                f"{r['dpp.transform_samples_per_s.baseline']:,.0f} | {r['bench.dpp_worker_speedup']:.2f}x |",
                f"| the stage's fixed cost (statistics, dedup profile, validation split, manifest) | "
                f"{r['dpp.fixed_seconds.dedup']:.2f} s | {r['dpp.fixed_seconds.baseline']:.2f} s | |",
                f"| the stage at the daily pipeline's batch ({pb}) | | | "
                f"{r['bench.dpp_pipeline_batch_speedup']:.2f}x |",
            ]
        rows.append(
            f"| bytes out | {human_bytes(r['dpp.bytes_out.dedup'])} | {human_bytes(r['dpp.bytes_out.baseline'])} | "
            f"{r['dpp.bytes_out.baseline'] / r['dpp.bytes_out.dedup']:.2f}x |"
        )
        rows.append(
            f"| dedup, 2 worker processes | {r['dpp.samples_per_s.dedup_2_workers']:,.0f} samples/s | | "
            f"{r['bench.dpp_scaling_2_workers']:.2f}x of 1 worker |"
        )
        rows.append(
            f"| dedup, 2 worker threads | {r['dpp.samples_per_s.dedup_2_threads']:,.0f} samples/s | | "
            f"{r['bench.dpp_scaling_2_threads']:.2f}x of 1 worker |"
        )
    if "bench.train_speedup" in r:
        rows += [
            "",
            f"| training (B={r['train.batch_size']}, {r['train.device']}) | dedup | baseline | ratio |",
            "|---|---|---|---|",
        ]
        rows.append(
            f"| step time | {r['train.step_ms.dedup']:.0f} ms | {r['train.step_ms.baseline']:.0f} ms | "
            f"**{r['bench.train_speedup']:.2f}x** (bound {r['bench.train_speedup_bound']:.2f}x, "
            f"{r['bench.train_speedup_of_bound']:.0%} of it; component bound "
            f"{r['bench.train_speedup_component_bound']:.2f}x, {r['bench.train_speedup_of_component_bound']:.0%}) |"
        )
        rows.append(
            f"| samples/s | {r['train.samples_per_s.dedup']:,.0f} | {r['train.samples_per_s.baseline']:,.0f} | |"
        )
        for name in ("passive", "spinning"):  # bench/neighbour.py
            if f"bench.neighbour.train_speedup.{name}" in r:
                rows.append(
                    f"| step time beside a busy neighbour, {name} threads | "
                    f"{r[f'train.neighbour.step_ms.dedup.{name}']:,.0f} ms | "
                    f"{r[f'train.neighbour.step_ms.baseline.{name}']:,.0f} ms | "
                    f"{r[f'bench.neighbour.train_speedup.{name}']:.2f}x |"
                )
        if "train.peak_mem_bytes.dedup" in r:
            rows.append(
                f"| peak memory | {human_bytes(r['train.peak_mem_bytes.dedup'])} | "
                f"{human_bytes(r['train.peak_mem_bytes.baseline'])} | |"
            )
    rows += sharded_markdown(r)
    rows += lineage_markdown(r)
    rows += quality_markdown(r)
    if serving := serving_markdown(r):
        rows += ["", *serving]
    if ranking := ranking_markdown(r):
        rows += [
            "",
            "One user, many candidates: a ranking request against the same samples as rows",
            "",
            *ranking,
        ]
    if load := load_markdown(r):
        rows += ["", "Many clients: one `recd serve`, closed and open loop", "", *load]
    if "embedding.step_ms.ours_dedup" in r:
        rows += ["", "| embedding bags only (fwd+bwd+sparse Adagrad) | step |", "|---|---|"]
        for k in ("torchrec_kjt", "torchrec_vbe", "ours_all_rows", "ours_dedup"):
            rows.append(f"| {k} | {r['embedding.step_ms.' + k]:.1f} ms |")
    return "\n".join(rows) + "\n"


def sharded_markdown(r: dict) -> list[str]:
    """The tables sharded over N processes: the all-to-alls' bytes and the step, dedup vs
    baseline; the over-budget table (bench/sharded.py)."""
    if "sharded.world" not in r:
        return []
    rows = [
        "",
        f"| tables sharded, {r['sharded.world']} processes ({r['sharded.device']}, "
        f"B={r['sharded.batch_size']}) | ids + lengths / step | vectors + gradients / step "
        "| step time |",
        "|---|---|---|---|",
    ]
    for sharding in ("table_wise", "row_wise"):
        k = f"sharded.{sharding}"
        for mode in ("dedup", "baseline"):
            rows.append(
                f"| {sharding}, {mode} | {human_bytes(r[f'{k}.{mode}.id_bytes_per_step'])} | "
                f"{human_bytes(r[f'{k}.{mode}.vector_bytes_per_step'])} | "
                f"{r[f'{k}.{mode}.step_ms']:,.0f} ms |"
            )
        ratio = [
            r[f"{k}.baseline.{x}"] / r[f"{k}.dedup.{x}"]
            for x in ("id_bytes_per_step", "vector_bytes_per_step", "step_ms")
        ]
        rows.append(
            f"| {sharding}, baseline / dedup | {ratio[0]:.2f}x | **{ratio[1]:.2f}x** | "
            f"{ratio[2]:.2f}x |"
        )
    rows.append(
        f"| dedup factor of a rank's slice (samples a unique user row) | "
        f"{r['sharded.dedup_factor_per_rank']:.1f} | | |"
    )
    if "sharded.budget_mb" in r:
        mb = 1 << 20
        rows += [
            "",
            f"A table past a process's budget: the items table at {r['sharded.big_table_rows']:,} "
            f"rows ({r['sharded.big_table_bytes'] / mb:,.0f} MB of weights) with "
            f"`--memory-budget-mb {r['sharded.budget_mb']}` on {r['sharded.world']} processes: "
            f"placed {r['sharded.big_table_plan']}; tables held per rank "
            f"{', '.join(f'{b / mb:,.0f} MB' for b in r['sharded.table_bytes_per_rank'])}; "
            f"peak RSS per rank {', '.join(f'{b / mb:,.0f} MB' for b in r['sharded.peak_rss_per_rank'])} "
            f"({r['sharded.rss_before_tables'] / mb:,.0f} MB of it before the tables were placed: "
            f"Python, torch, TorchRec, the batches, the dense layers). At half the budget: "
            f"`{r['sharded.half_budget_refusal']}`",
        ]
    return rows + pipeline_markdown(r) + verify_markdown(r)


def verify_markdown(r: dict) -> list[str]:
    """What verifying a saved model's shard files costs (bench/sharded.py)."""
    if "sharded.verify.bytes" not in r:
        return []
    v, mb = "sharded.verify.", 1 << 20
    return [
        "",
        f"Verifying a saved model's shard files ({r[v + 'rows']:,} x {r[v + 'dim']} table "
        f"and accumulators, {r[v + 'bytes'] / mb:,.0f} MB, page cache warm):",
        "",
        "| reading every byte | verified open (size, box, CRC-32) | private open (a server's "
        "copy, then checked) | the whole table read through the maps |",
        "|---|---|---|---|",
        f"| {r[v + 'read_s']:.2f} s | {r[v + 'verify_s']:.2f} s | {r[v + 'private_s']:.2f} s "
        f"| {r[v + 'materialize_s']:.2f} s |",
    ]


def pipeline_markdown(r: dict) -> list[str]:
    """The daily pipeline with a table past the budget, day by day (bench/sharded.py)."""
    rows = []
    if "sharded.pipeline.table_bytes" in r:
        mb, p = 1 << 20, "sharded.pipeline."

        def mbs(values) -> str:
            return ", ".join(f"{v / mb:,.0f}" for v in values)

        rows += [
            "",
            f"The daily pipeline with a table past the budget (`recd run`, two days: "
            f"items table {r[p + 'table_bytes'] / mb:,.0f} MB, budget "
            f"{r[p + 'budget_mb']} MB a process, 2 processes row-wise):",
            "",
            "| day | started from | saved | shards a rank, MB | rank runtime, MB | rank peak above it, MB "
            "| evaluate / register peak above start, MB | largest file, MB | decision |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for k in (1, 2):
            d = f"{p}day{k}."
            rows.append(
                f"| {k} | {r[d + 'init']} | {r[d + 'saved_layout']} | {mbs(r[d + 'shard_bytes_per_rank'])} "
                f"| {mbs(r[d + 'rank_runtime_bytes'])} | {mbs(r[d + 'rank_grown_bytes'])} "
                f"| {r[d + 'evaluate_grown_bytes'] / mb:,.0f} / {r[d + 'register_grown_bytes'] / mb:,.0f} "
                f"| {r[d + 'largest_file_bytes'] / mb:,.0f} | {r[d + 'decision']} |"
            )
        rows += [
            "",
            f"The champion served (`recd serve --model models:/recd-dlrm@champion`, "
            f"{r[p + 'serve_rows']} rows a request): {r[p + 'serve_idle_bytes'] / mb:,.0f} MB "
            f"idle, {r[p + 'serve_peak_bytes'] / mb:,.0f} MB at its peak, "
            f"{r[p + 'serve_p50_ms']:,.1f} ms a request (p50).",
        ]
    return rows


# each reference's row: its words, given the result and the keys' prefix
REFERENCE_ROWS = {
    "lr": lambda r, q: f"logistic regression, one-hot (C={r[q + 'lr_c']:.3g})",
    "fm": lambda r, q: (
        f"factorization machine, same one-hot (L2 {r[q + 'fm_l2']:.3g}, {r[q + 'fm_passes']} passes)"
    ),
    "gbdt": lambda r, q: (
        f"gradient-boosted trees, LightGBM ({r[q + 'gbdt_leaves']} leaves, "
        f"{r[q + 'gbdt_rounds']} rounds)"
    ),
    "din": lambda r, q: f"DIN, target attention over the history ({_tuned(r, q + 'din_')})",
    "dcn_v2": lambda r, q: f"DCN-v2, cross network ({_tuned(r, q + 'dcn_v2_')})",
    "sim": lambda r, q: f"SIM, genre-searched history + recent ({_tuned(r, q + 'sim_')})",
}


def _tuned(r: dict, p: str) -> str:
    return f"lr {r[p + 'lr']:.3g}, {r[p + 'passes']:.1f} passes of batch {r[p + 'batch']}"


def movielens_markdown(r: dict, q: str, words: str, kept: list[dict] = ()) -> list[str]:
    """One split's table: every reference, ours, ours over the best, with training times."""
    from recd_core.bench.quality import REFERENCES

    def row(name: str, p: str, minutes: float) -> str:
        return (
            f"| {name} | {r[p + 'ne']:.4f} | {r[p + 'logloss']:.4f} | {r[p + 'auc']:.4f} "
            f"| {minutes:.1f} |"
        )

    h = r[q + "test_entropy"]  # log loss = NE x the test rows' entropy
    rows = [
        "",
        f"| MovieLens ({r.get(q + 'data', 'ml-100k')}), {words} | NE | log loss | AUC | minutes |",
        "|---|---|---|---|---|",
    ]
    rows += [
        row(REFERENCE_ROWS[n](r, q), f"{q}{n}_", r[f"{q}{n}_minutes"])
        for n in REFERENCES
        if f"{q}{n}_auc" in r
    ]
    members = r[q + "members"]
    ours = (
        f"**recd DLRM** (batch {r[q + 'batch_size']}, {members} "
        f"model{'s' if members > 1 else ''}, {r[q + 'train_samples_per_s']:,.0f} samples/s)"
    )
    rows += [
        row(ours, q, r[q + "train_minutes"]),
        f"| recd DLRM over the best reference, figure by figure | {r[q + 'best_ne_gain']:+.4f} "
        f"| {r[q + 'best_ne_gain'] * h:+.4f} | {r[q + 'best_auc_gain']:+.4f} | |",
        f"| logistic regression calibrated as ours (on the latest 10%) "
        f"| {r[q + 'lr_calibrated_ne']:.4f} | {r[q + 'lr_calibrated_ne'] * h:.4f} "
        f"| {r[q + 'lr_auc']:.4f} | |",
    ]
    rows += seed_rows(r, q)
    if kept:  # figures an earlier run measured on the same rows with the same code
        rows += [
            "",
            "Kept from an earlier run on the same rows and code (minutes are that "
            "run's): "
            + "; ".join(f"{k['model']} (measured {k['measured']}, {k['machine']})" for k in kept)
            + ".",
        ]
    return rows


SHORT_NAMES = {
    "lr": "the logistic regression",
    "fm": "the factorization machine",
    "gbdt": "LightGBM",
    "din": "DIN",
    "dcn_v2": "DCN-v2",
    "sim": "SIM",
}


def seed_rows(r: dict, q: str) -> list[str]:
    """The spread rows under a table (`quality.seed_spread`): ours and the best reference
    over their seeds, mean (lowest-highest), and ours' worst seed over its best."""
    if r.get(q + "seeds", 1) < 2:
        return []
    best = r[q + "spread_reference"]

    def row(words: str, model: str) -> str:
        p = f"{q}{model}_seeds_"
        cells = [
            f"{r[p + k + '_mean']:.4f} ({r[p + k + '_min']:.4f}-{r[p + k + '_max']:.4f})"
            for k in ("ne", "logloss", "auc")
        ]
        return f"| {words} | " + " | ".join(cells) + f" | {r[p + 'minutes']:.1f} |"

    n, fitted = r[q + "seeds"], r[f"{q}{best}_seeds_fitted"]
    theirs = (
        f"{SHORT_NAMES[best]}, {fitted} seeds at its tuned learning rate"
        if fitted > 1
        else f"{SHORT_NAMES[best]}, one fit (the same from the same rows every time)"
    )
    return [
        row(f"recd DLRM, {n} seeds: mean (lowest-highest)", "ours"),
        row(theirs, best),
        f"| recd DLRM's worst seed over {SHORT_NAMES[best]}'s best, figure by figure "
        f"| {r[q + 'worst_seed_ne_gain']:+.4f} | {r[q + 'worst_seed_logloss_gain']:+.4f} "
        f"| {r[q + 'worst_seed_auc_gain']:+.4f} | |",
    ]


def quality_markdown(r: dict) -> list[str]:
    """The model-quality tables: ours next to a reference on the same data."""
    from recd_core.bench.quality import SPLITS

    rows: list[str] = []
    for split, (q, _, _, words) in SPLITS.items():
        if q + "auc" in r:
            kept = r.get(f"movielens_quality_{split}", {}).get("kept", [])
            rows += movielens_markdown(r, q, words, kept)
    if r.get("week"):
        rows += [
            "",
            f"| synthetic ({r['bench.preset']}), day trained -> evaluated | start | next-day NE | AUC | oracle NE | gap to the oracle | learnable bound (gap) | the features alone (gap) | the generator's model, learned (gap) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for w in r["week"]:
            rows.append(
                f"| {w['day']} -> {w['eval_day']} | {w['init']} | {w['ne']:.4f} | {w['auc']:.4f} | "
                f"{w['oracle_ne']:.4f} | {w['gap']:+.4f} | "
                f"{w['bound_ne']:.4f} ({w['bound_ne'] - w['oracle_ne']:+.4f}) | "
                f"{w['features_ne']:.4f} ({w['features_ne'] - w['oracle_ne']:+.4f}) | "
                f"{w['learned_ne']:.4f} ({w['learned_ne'] - w['oracle_ne']:+.4f}) |"
            )
        missed = [w for w in r["week"] if "missed" in w]
        if missed:
            rows += [
                "",
                "Where the gap lies: next-day NE of the model's logit with one true term of the "
                "click logit added (a logistic refit on half the day, scored on the other half); "
                "the larger the drop, the less of that term the model learned.",
                "",
                "| term added | " + " | ".join(f"{w['day']} model" for w in missed) + " |",
                "|---|" + "---|" * len(missed),
            ]
            for term in missed[0]["missed"]:
                cells = []
                for w in missed:
                    ne, alone = w["missed"][term], w["missed"]["model"]
                    cells.append(
                        f"{ne:.4f}" if term == "model" else f"{ne:.4f} ({ne - alone:+.4f})"
                    )
                name = "none (the model, recalibrated)" if term == "model" else term
                rows.append(f"| {name} | " + " | ".join(cells) + " |")
        if "bench.quality.week.baseline_first_ne" in r:
            rows += [
                "",
                f"First day, both arms: dedup NE {r['week'][0]['ne']:.4f}, baseline NE "
                f"{r['bench.quality.week.baseline_first_ne']:.4f} "
                f"(|gap| {r['bench.quality.week.arms_ne_gap']:.4f}).",
            ]
    return rows
