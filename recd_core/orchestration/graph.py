"""The pipeline, declared once: its stages and the graphs they form, as data.

Every runner reads this module and nothing else for the shape of a pipeline: the local
runner behind `recd run` / `recd compare` (`recd_core.orchestration.runner`), the Airflow DAG factory
(`dags/airflow/recd_tasks.py`) and the Kubeflow pipeline builder (`dags/kubeflow/`). The
work of each stage is `recd_core.orchestration.stages`; adding a stage means a `Stage` here, its function
there, and a `Task` in the graphs that run it.

A `Stage` says what it reads and writes in the warehouse and which arguments it takes from
an upstream stage's summary (`Pull`); the arguments of its own are declared with the
arguments (`stage_args.StageArgs`, `arg(stages=...)`). A `Task` places a stage in a graph: its id, the arm it
runs for, fixed arguments, the tasks it waits for, and the tasks whose summaries it merges
(compare, finish). The evaluation day is prepared by tasks of its own (`ingest_eval`,
`generate_eval`: the same stages on the run's evaluation days, `days_of`), beside the
training day's work, after the training day's ingest: an evaluation day's events are
checked against the training day's (a redelivered event is quarantined, so no row is both
trained on and scored); synth writes every day of the run at once (the users' click
histories carry over into the evaluation day).

    daily (`DAILY`, one arm, registered):

        start → synth → ingest → generate → preprocess → train → evaluate → register → finish
                               └ ingest_eval → generate_eval ─────┘

    comparison (`COMPARISON`, both arms on the same samples, a quality gate):

                                        ┌ preprocess_dedup → train_dedup → evaluate_dedup ┐
        start → synth → ingest → generate                                                 compare → finish
                              │         └ preprocess_baseline → …        → evaluate_baseline ┘
                              └ ingest_eval → generate_eval (→ both evaluates)
"""

from __future__ import annotations

from dataclasses import dataclass

ARMS = ("dedup", "baseline")
ARM_LAYOUT = {"dedup": "clustered", "baseline": "shuffled"}  # the samples layout each arm reads


@dataclass(frozen=True)
class Pull:
    """Argument `arg` of a stage is `key` of the summary of upstream stage `stage` (of the
    same arm): e.g. evaluate's `model_uri` is train's `train.model_uris`."""

    arg: str
    stage: str
    key: str


RUN = Pull("parent_run_id", "start", "mlflow.run_id")  # every stage records under the run
MODEL = Pull("model_uri", "train", "train.model_uris")


@dataclass(frozen=True)
class Stage:
    name: str
    doc: str
    reads: tuple[str, ...] = ()  # warehouse tables (or `logs`)
    writes: tuple[str, ...] = ()
    pulls: tuple[Pull, ...] = (RUN,)
    per_arm: bool = False  # runs once per training arm (its `mode`)
    gathers: bool = False  # works on upstream stages' summaries (compare, finish)
    run_edge: bool = False  # opens or closes the pipeline's MLflow run (start, finish)
    accelerated: bool = False  # the stage a GPU (and the most memory) is for


STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage("start", "opens the pipeline's MLflow run", pulls=(), run_edge=True),
        Stage("synth", "synthesizes logs for days without any (embedded default)",
              writes=("logs",)),
        Stage("ingest", "validates raw logs; bad rows quarantined with a reason",
              reads=("logs",), writes=("events", "quarantine")),
        Stage("generate", "session-clustered and shuffled samples, storage figures",
              reads=("events",), writes=("samples",)),
        Stage("preprocess", "DPP: transforms once per unique value, IKJT (or KJT) batches",
              reads=("samples",), writes=("batches",), per_arm=True),
        Stage("train", "the DLRM, warm-started from the champion, checkpointed",
              reads=("batches",), writes=("models",), per_arm=True, accelerated=True),
        Stage("evaluate", "NE, AUC, log loss, calibration on the next day",
              reads=("models", "samples"), pulls=(RUN, MODEL), per_arm=True),
        Stage("register", "MLflow model version `challenger`; `champion` if no worse",
              reads=("models", "samples"), per_arm=True,
              pulls=(RUN, MODEL, Pull("register_run_id", "train", "mlflow.run_id"))),
        Stage("compare", "both arms side by side: table, chart, quality gate",
              gathers=True),
        Stage("finish", "closes the pipeline's MLflow run with every stage's figures",
              gathers=True, run_edge=True),
    )
}  # fmt: skip


def outputs(stage: str) -> dict[str, str]:
    """The typed outputs a stage leaves beside its summary, by name: `dataset` per table it
    writes (a partition per day, by URI), `model` for the trained model, `metrics` (the
    summary's figures), `markdown` (what a gathering stage found, as a table). Orchestrators
    that track artifacts (Kubeflow) declare these; the components write them."""
    s = STAGES[stage]
    out = {OUTPUT_NAMES.get(t, t): "model" if t == "models" else "dataset" for t in s.writes}
    if not s.run_edge or s.gathers:
        out["metrics"] = "metrics"
    if s.gathers:
        out["report"] = "markdown"
    return out


OUTPUT_NAMES = {"models": "model", "logs": "raw_logs"}  # where a table's name will not do


# the stages whose summaries others pull arguments from (start, train): orchestrators that
# pass whole summaries (Kubeflow, the components) take one input per such stage
PULLED_FROM = tuple(dict.fromkeys(p.stage for s in STAGES.values() for p in s.pulls))


@dataclass(frozen=True)
class Task:
    id: str
    stage: str
    after: tuple[str, ...] = ()
    mode: str | None = None  # the arm, for per-arm stages
    gathers: tuple[str, ...] = ()  # task ids whose summaries the stage merges
    fixed: tuple[tuple[str, object], ...] = ()  # further arguments of this task's stage

    def args(self) -> dict:
        """The arguments this task adds to the graph's shared ones: its arm and `fixed`."""
        return {**({"mode": self.mode} if self.mode else {}), **dict(self.fixed)}


@dataclass(frozen=True)
class Graph:
    name: str
    doc: str
    tasks: tuple[Task, ...]

    def task(self, task_id: str) -> Task:
        return next(t for t in self.tasks if t.id == task_id)

    def source(self, task: Task, pull: Pull) -> str:
        """The task whose summary fills `pull` for `task`: the pulled stage's task of the
        same arm (or the one task of that stage)."""
        found = [
            t for t in self.tasks if t.stage == pull.stage and t.mode in (task.mode, None)
        ] or [t for t in self.tasks if t.stage == pull.stage]
        if len(found) != 1:
            raise ValueError(f"{self.name}: {task.id} pulls {pull.stage!r}: {len(found)} tasks")
        return found[0].id

    def pulls(self, task: Task) -> list[tuple[Pull, str]]:
        """(pull, source task id) for every argument `task` takes from upstream."""
        return [(p, self.source(task, p)) for p in STAGES[task.stage].pulls]

    def gathered(self) -> tuple[str, ...]:
        """Every task whose summary some task merges (in order)."""
        return tuple(dict.fromkeys(g for t in self.tasks for g in t.gathers))

    def table(self) -> str:
        """The tasks as a Markdown table (task, what its stage does, what it writes, what it
        runs after): the DAGs' `doc_md` shows it, so their documentation cannot drift from
        the graph."""
        rows = ["| task | does | writes | after |", "|---|---|---|---|"]
        for t in self.tasks:
            stage = STAGES[t.stage]
            arm = (
                f" ({t.mode} arm)"
                if t.mode and len({x.mode for x in self.tasks} - {None}) > 1
                else ""
            )
            rows.append(f"| {t.id} | {stage.doc}{arm} | {', '.join(stage.writes)} | "
                        f"{', '.join(t.after)} |")  # fmt: skip
        return "\n".join(rows) + "\n"

    def order(self) -> list[Task]:
        """The tasks in an order that runs every task after its upstreams (the declared
        order, checked)."""
        seen: set[str] = set()
        for t in self.tasks:
            missing = [u for u in (*t.after, *t.gathers) if u not in seen]
            if missing:
                raise ValueError(f"{self.name}: {t.id} runs after undeclared {missing}")
            seen.add(t.id)
        return list(self.tasks)


def pipeline_graph(arms: tuple[str, ...], register: bool, compare: bool, name: str) -> Graph:
    """The graph over `arms`: the data stages once (for the training days, and apart for the
    evaluation day), DPP → train → evaluate per arm, then `register` (the first arm's
    model) and/or `compare` (needs both arms), then finish."""
    evaluation = (("days_of", "evaluation"),)
    tasks = [Task("start", "start"), Task("synth", "synth", ("start",), fixed=(("days_of", "run"),)),
             Task("ingest", "ingest", ("synth",)), Task("generate", "generate", ("ingest",)),
             Task("ingest_eval", "ingest", ("ingest",), fixed=evaluation),
             Task("generate_eval", "generate", ("ingest_eval",), fixed=evaluation)]  # fmt: skip
    ends = []
    for arm in arms:
        suffix = f"_{arm}" if len(arms) > 1 else ""
        ids = [f"{s}{suffix}" for s in ("preprocess", "train", "evaluate")]
        tasks += [Task(ids[0], "preprocess", ("generate",), arm),
                  Task(ids[1], "train", (ids[0],), arm),
                  Task(ids[2], "evaluate", (ids[1], "generate_eval"), arm)]  # fmt: skip
        ends.append(ids)
    arm_tasks = tuple(i for ids in ends for i in ids)
    last = tuple(ids[-1] for ids in ends)
    if register:
        tasks.append(Task("register", "register", last, arms[0]))
        last = ("register",)
    if compare:
        if set(arms) != set(ARMS):
            raise ValueError("compare needs both arms")
        tasks.append(Task("compare", "compare", last, gathers=("generate", *arm_tasks)))
        last = ("compare",)
    gathered = ("synth", "ingest", "generate", *arm_tasks, *(("register",) if register else ()),
                *(("compare",) if compare else ()))  # fmt: skip
    tasks.append(Task("finish", "finish", last, gathers=gathered))
    return Graph(name, __doc__, tuple(tasks))


DAILY = pipeline_graph(("dedup",), register=True, compare=False, name="recd_daily_retrain")
COMPARISON = pipeline_graph(ARMS, register=False, compare=True, name="recd_dedup_vs_baseline")
