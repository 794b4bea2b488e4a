"""How a figure is named in MLflow: `<section>/<name>`. The UI groups a run's charts into
sections by the part before the `/`, so a run reads as a few sections (storage, dpp, train,
eval, ingest, system: MLflow's own system metrics live there too) instead of one
alphabetical wall of single-bar charts. The summaries keep their dotted contract keys
(`eval.ne`, `storage.ratio`); only the record in MLflow is named this way:

    eval.ne                  ->  eval/ne
    eval.ne.dedup            ->  eval/ne.dedup          (a comparison's arms)
    storage.ratio            ->  storage/ratio
    dedup.factor.user_id     ->  storage/dedup.factor.user_id
    preprocess.peak_rss_bytes -> system/preprocess.peak_rss_bytes
    registry.champion_ne     ->  eval/registry.champion_ne
    compare.dpp_speedup_low  ->  dpp/speedup_low       (a comparison's, beside its stage's)
"""

from __future__ import annotations

# the summary key's first part -> the section its figure is shown in
SECTIONS = {
    "storage": "storage",
    "dedup": "storage",
    "generate": "storage",
    "dpp": "dpp",
    "preprocess": "dpp",
    "train": "train",
    "eval": "eval",
    "evaluate": "eval",
    "registry": "eval",
    "register": "eval",
    "compare": "eval",
    "ingest": "ingest",
    "synth": "ingest",
    "bench": "bench",
    "pipeline": "run",
    "start": "run",
    "finish": "run",
}


def metric_name(key: str) -> str:
    """The MLflow metric name of summary key `key` (module doc)."""
    if "/" in key:  # already sectioned (MLflow's `system/...`)
        return key
    if key.endswith("_rss_bytes"):  # a stage's process memory: beside the system metrics
        return f"system/{key}"
    head, _, rest = key.partition(".")
    stage, _, figure = rest.partition("_")
    if head == "compare" and figure and SECTIONS.get(stage) == stage:  # beside its stage's
        return f"{stage}/{figure}"
    section = SECTIONS.get(head)
    if section is None:
        return key
    return f"{section}/{rest}" if head == section and rest else f"{section}/{key}"


def once_each(figures: dict[str, float], arms: list[str]) -> dict[str, float]:
    """A run of one arm records each figure once: `eval.ne`, not also `eval.ne.dedup` with
    the same value (the pipeline's merged summary carries both, for a comparison's sake)."""
    if len(arms) != 1:
        return figures
    suffix = f".{arms[0]}"
    return {
        k: v
        for k, v in figures.items()
        if not (k.endswith(suffix) and figures.get(k.removesuffix(suffix)) == v)
    }
