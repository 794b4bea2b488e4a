"""The local runner: a graph of `recd_core.orchestration.graph` run in this process, task by task through
`stages.run_stage`, exactly as an orchestrator runs it (the same stages, arguments and
summaries), for `recd run` and `recd compare`.

The caller may own the pipeline's MLflow run (the command's run): then `start` hands that
run to the stages instead of opening one, and `finish` merges the summaries without closing
it (the command closes it with the result).
"""

from __future__ import annotations

from collections.abc import Callable

from recd_core.errors import RecdError
from recd_core.orchestration.graph import STAGES, Graph
from recd_core.orchestration.stage_args import for_stage
from recd_core.orchestration.stages import run_stage
from recd_core.orchestration.summaries import with_upstream


def run_graph(
    graph: Graph,
    args: dict,
    run_id: str | None = None,
    progress: Callable[[str, int], None] | None = None,
    accelerated: Callable[[str, dict, list | None], dict] | None = None,
) -> dict[str, dict]:
    """Run every task of `graph` in order with the shared `args` (StageArgs fields); return
    each task's summary by task id. A failing stage raises (its `RecdError` when the
    taxonomy knows it), after its MLflow run is closed FAILED. `accelerated`: how the
    accelerated stage (train) runs instead of here (across machines: a TrainJob, `trainjob.py`)."""
    done: dict[str, dict] = {}
    order = graph.order()
    for i, task in enumerate(order):
        targs = {**for_stage(task.stage, args), **task.args()}
        edge = STAGES[task.stage].run_edge
        if run_id is not None and edge:
            targs.pop("tracking_uri", None)  # the caller's run: neither opened nor closed here
        sources = {pull.stage: done[src] for pull, src in graph.pulls(task)}
        targs = with_upstream(task.stage, targs, sources)
        upstream = [done[t] for t in task.gathers] if task.gathers else None
        try:
            run = accelerated if accelerated and STAGES[task.stage].accelerated else run_stage
            summary = run(task.stage, targs, upstream)
        except RecdError as e:  # say how far the graph got: nothing after this task ran
            ran = ", ".join(done) or "none"
            rest = ", ".join(t.id for t in order[i + 1 :]) or "none"
            raise type(e)(f"{task.id}: {e} (done: {ran}; not run: {rest})", e.summary) from None
        if run_id is not None and edge and not task.gathers:
            summary["mlflow.run_id"] = run_id  # the run the stages record under
        done[task.id] = summary
        if progress:
            progress(task.id, 1)
    return done
