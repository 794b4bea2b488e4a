"""Ingest's parsing on Ray Data: each source file is parsed and validated by a Ray task (the
same function as the local engine), and the results stream back to the driver in file
order, so the events and quarantine partitions equal the local engine's. The driver keeps
writing and runs the day-wide checks (they need every file's keys); parsing, the dominant
cost, scales out with the cluster.

Rows travel as Arrow IPC bytes; Ray Data's streaming executor bounds how many files are in
flight. The source files must be readable where the tasks run (a shared volume).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from recd_core.config import FeatureSet
from recd_core.data.sources import Parsed, Rejects


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def _table(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def parse_on_ray(
    files: list[Path],
    schema: pa.Schema,
    features: FeatureSet,
    parse: Callable[[Path, pa.Schema, FeatureSet], tuple[Parsed, Rejects]],
    workers: int,
) -> Iterator[tuple[Parsed, Rejects]]:
    """`parse(file)` for every file on Ray, yielded in file order."""
    import ray

    from recd_core.ray_cluster import ray_session

    paths = [str(p) for p in files]

    def run(row: dict) -> dict:
        parsed, rejects = parse(Path(paths[row["i"]]), schema, features)
        return {"i": row["i"], "table": _ipc(parsed.table), "source": parsed.source,
                "lines": parsed.lines, "rejects": _ipc(rejects.table())}  # fmt: skip

    with ray_session(workers):
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        items = ray.data.from_items([{"i": i} for i in range(len(paths))],
                                    override_num_blocks=max(1, len(paths)))  # fmt: skip
        for row in items.map(run, concurrency=workers, num_cpus=1).iter_rows():
            parsed = Parsed(_table(row["table"]), row["source"], np.asarray(row["lines"]), None)
            yield parsed, Rejects([_table(row["rejects"])])
