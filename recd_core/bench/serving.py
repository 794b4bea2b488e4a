"""The scoring service, measured: latency and the server's memory per request size.

    python -m recd_core.bench.serving --model W/models/RUN --warehouse W --ds D

serves a trained model with `recd serve` (and, beside it, the same model as an MLflow pyfunc
under `mlflow models serve`, the reference) on loopback, sends requests of 1, 100 and
10,000 of day D's sample rows (MLflow's dataframe_split JSON, what both take), one at a
time on a keep-alive connection, and reports per size the p50 / p99 latency (after
warm-up requests) and the server's peak resident memory while that size was served (the
kernel's high-water mark, reset before each size). The sizes' timed requests are spread
over three passes through the sizes (and servers), so a slow spell of the machine weighs
on each alike.

Then ranking (`serving.ranking.*`): one user and 1, 100 or 1,000 candidates, sent to
`recd serve` as a ranking request (the user side once: scoring/ranking.py), as the same
request in the row format (the user side repeated in every row), and as the ranking request
to the same model served with `--no-dedup` (the user side computed per candidate): p50 /
p99 latency, requests a second (one client, one request at a time) and the server's peak
RSS, and the ratios of the row format and of dedup off to the ranking request.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import orjson

from recd_core.config import ServeConfig
from recd_core.modeling.launch import free_port
from recd_core.report import print_summary
from recd_core.runtime import owned_child, stop_group
from recd_core.scoring.request import request_columns
from recd_core.warehouse import Warehouse

SIZES = (1, 100, 10_000)
REQUESTS = {1: 100, 100: 30, 10_000: 5}  # timed requests per size (recd serve)
REFERENCE_REQUESTS = {1: 30, 100: 10, 10_000: 2}  # mlflow models serve: 10k rows take ~30 s
CANDIDATES = (1, 100, 1_000)
RANKING_REQUESTS = {1: 100, 100: 60, 1_000: 40}  # timed requests per candidate count


def _wait(port: int, server: subprocess.Popen, limit_s: float = 180) -> None:
    deadline = time.monotonic() + limit_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2):
                return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the scoring server did not start") from None
            time.sleep(0.5)


def _tree(pid: int) -> list[int]:
    """The server and the processes it started (`mlflow models serve` runs uvicorn as a
    child): memory is the tree's."""
    import psutil

    return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


def _peak_rss(pid: int) -> int:
    """The peak resident set (VmHWM) of the server's process tree, bytes."""
    return sum(_status(p, "VmHWM:") for p in _tree(pid))


def _rss(pid: int) -> int:
    return sum(_status(p, "VmRSS:") for p in _tree(pid))


def _reset_peak(pid: int) -> None:
    for p in _tree(pid):
        Path(f"/proc/{p}/clear_refs").write_text("5")  # resets VmHWM to the current RSS


JSON = "application/json"


@contextlib.contextmanager
def client_collector_off():
    """The client's cyclic collector off while it times (as `timeit` does): a pass over its
    own objects would read as the server's latency."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class Client:
    """One keep-alive connection per server (as a service's client holds a pool of them):
    `post(port, body)` -> seconds to the whole answer; anything but a 200 is an error. A
    connection idle past `IDLE_S` is opened anew, and one the server closed meanwhile (uvicorn
    closes idle ones after 5 s) is reopened and the request sent again, as a pool does."""

    IDLE_S = 2.0

    def __init__(self):
        self.connections: dict[int, tuple[http.client.HTTPConnection, float]] = {}

    def _connection(self, port: int, fresh: bool = False) -> http.client.HTTPConnection:
        held = self.connections.get(port)
        if held is not None and (fresh or time.monotonic() - held[1] > self.IDLE_S):
            held[0].close()
            held = None
        if held is None:
            held = (http.client.HTTPConnection("127.0.0.1", port, timeout=600), 0.0)
        self.connections[port] = held
        return held[0]

    def post(self, port: int, body: bytes) -> float:
        for attempt in range(2):
            connection = self._connection(port, fresh=attempt > 0)
            t0 = time.perf_counter()
            try:
                connection.request("POST", "/invocations", body, {"Content-Type": JSON})
                answer = connection.getresponse()
                text = answer.read()
                break
            except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
                if attempt:
                    raise
        seconds = time.perf_counter() - t0
        self.connections[port] = (connection, time.monotonic())
        if answer.status != 200:
            raise RuntimeError(f"the server answered {answer.status}: {text[:300]!r}")
        return seconds

    def close(self) -> None:
        for connection, _ in self.connections.values():
            connection.close()


PASSES = 3  # each target's timed requests are spread over passes through all targets


def measure(targets: dict) -> dict:
    """Per target (key -> (server, port, body, timed requests)): p50 / p99 latency (ms),
    requests a second (one at a time, on a keep-alive connection) and the server's peak
    RSS. The peaks first, target after target (the kernel's high-water mark reset before
    each; two requests, which warm the server up); then the latencies in `PASSES` passes through the targets, each a warm-up
    request then its share of the timed ones: a slow spell of a shared machine falls on
    every target alike (the ratios between them hold), and a request is timed after others
    of its own kind."""
    peaks, client = {}, Client()
    for key, (server, port, body, _) in targets.items():
        _reset_peak(server.pid)
        for _ in range(2):
            client.post(port, body)
        peaks[key] = _peak_rss(server.pid)
    timed: dict = {key: [] for key in targets}
    with client_collector_off():
        for k in range(PASSES):
            for key, (_, port, body, requests) in targets.items():
                client.post(port, body)
                share = requests * (k + 1) // PASSES - requests * k // PASSES
                timed[key] += [client.post(port, body) for _ in range(share)]
    client.close()
    out = {}
    for key, seconds in timed.items():
        times = np.array(seconds) * 1e3
        rows = key[-1] if isinstance(key, tuple) else key
        out[key] = {
            "p50_ms": float(np.percentile(times, 50)),
            "p99_ms": float(np.percentile(times, 99)),
            "rows_per_s": rows / float(np.median(times)) * 1e3,
            "requests_per_s": len(times) / float(times.sum()) * 1e3,
            "peak_rss": peaks[key],
            "requests": len(times),
        }
    return out


def recd_serve_cmd(model_uri: str, port: int, *flags: str) -> list[str]:
    """`recd serve` of `model_uri` on `port` as its own process, with `flags`."""
    cmd = [sys.executable, "-m", "recd_core.cli", "serve", "--model", model_uri]
    return [*cmd, "--port", str(port), *flags]


@contextlib.contextmanager
def started(servers: dict):
    """Servers (name -> (command, port, extra environment)) started and answering, then
    stopped with what they started; a bench killed meanwhile takes them with it
    (`runtime.owned_child`). Yields name -> process."""
    procs = {}
    try:
        for name, (cmd, _, env) in servers.items():
            procs[name] = subprocess.Popen(
                cmd,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={
                    **os.environ,
                    **(env or {}),
                    "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                },
                **owned_child(),
            )
        for name, (_, port, _) in servers.items():
            _wait(port, procs[name])
        yield procs
    finally:
        for proc in procs.values():
            stop_group(proc)


def run_server(
    cmd: list[str], port: int, requests: dict, bodies: dict, env: dict | None = None
) -> dict:
    """`cmd` (a server on `port`) measured (`measure`, size -> figures), and its idle RSS."""
    with started({"server": (cmd, port, env)}) as procs:
        server = procs["server"]
        out = {"rss_idle": _rss(server.pid)}
        targets = {size: (server, port, body, requests[size]) for size, body in bodies.items()}
        return out | measure(targets)


def serving_figures(model_uri: str, warehouse: str, ds: str, reference: bool = True) -> dict:
    """`serving.*` figures (module docstring) for the model at `model_uri`."""
    from recd_core.mlops.pyfunc import NON_FEATURE_COLUMNS, save_pyfunc
    from recd_core.modeling.saved import model_dir

    rows = Warehouse(warehouse).read_range("samples", ds, 0, max(SIZES), layout="clustered")
    keep = [c for c in rows.column_names if c not in NON_FEATURE_COLUMNS]
    records = rows.select(keep).to_pylist()
    bodies = {
        n: json.dumps(
            {
                "dataframe_split": {
                    "columns": keep,
                    "data": [[r[c] for c in keep] for r in records[:n]],
                }
            }
        ).encode()
        for n in SIZES
    }
    port = free_port()
    servers = {"recd": (recd_serve_cmd(model_uri, port, "--max-rows", str(max(SIZES))), port, None)}
    with contextlib.ExitStack() as stack:
        if reference:  # the same model as MLflow's pyfunc, served beside it
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="recd-bench-pyfunc-"))
            save_pyfunc(stack.enter_context(model_dir(model_uri)), rows, Path(tmp) / "model")
            mlflow_bin = str(Path(sys.executable).parent / "mlflow")
            serve = [mlflow_bin, "models", "serve", "-m", str(Path(tmp) / "model")]
            port = free_port()
            serve += ["--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)]
            servers["mlflow"] = (serve, port, None)
        procs = stack.enter_context(started(servers))
        counts = {"recd": REQUESTS, "mlflow": REFERENCE_REQUESTS}
        targets = {
            (name, n): (procs[name], servers[name][1], bodies[n], counts[name][n])
            for name in servers
            for n in SIZES
        }
        idle = {name: _rss(proc.pid) for name, proc in procs.items()}
        got = measure(targets)
    out = {"serving.rss_idle_bytes": idle["recd"]}
    for n in SIZES:
        for k, v in got["recd", n].items():
            out[f"serving.rows_{n}.{k}"] = v
        out[f"serving.rows_{n}.body_bytes"] = len(bodies[n])
    if reference:
        out["serving.mlflow.rss_idle_bytes"] = idle["mlflow"]
        for n in SIZES:
            for k, v in got["mlflow", n].items():
                out[f"serving.mlflow.rows_{n}.{k}"] = v
            out[f"serving.speedup.rows_{n}"] = got["mlflow", n]["p50_ms"] / got["recd", n]["p50_ms"]
    return out


def user_bodies(rows, features, users: int, n: int, as_rows: bool = False) -> list[bytes]:
    """`users` ranking requests of n candidates, each another row's user side (the first:
    row 0's, with rows 0..n-1's item and context features as candidates; `as_rows`: the
    same samples in the row format, the user side in every row)."""
    from recd_core.scoring.ranking import CANDIDATES as CANDIDATES_KEY
    from recd_core.scoring.ranking import candidate_side, user_side

    cands = rows.select(candidate_side(features)).to_pylist()
    out = []
    for u in range(users):
        lo = (u * n) % max(rows.num_rows - n, 1)
        user = {c: rows[c][lo].as_py() for c in user_side(features)}
        if as_rows:
            body = {"dataframe_records": [{**user, **c} for c in cands[lo : lo + n]]}
        else:
            body = {"dataframe_records": [{**user, CANDIDATES_KEY: cands[lo : lo + n]}]}
        out.append(json.dumps(body).encode())
    return out


def ranking_bodies(rows, features, sizes=CANDIDATES) -> dict:
    """Per candidate count: the ranking request of one user (`user_bodies`' first) and the
    same request as sample rows."""
    return {
        (kind, n): user_bodies(rows, features, 1, n, as_rows=kind == "rows")[0]
        for n in sizes
        for kind in ("request", "rows")
    }


def ranking_figures(model_uri: str, warehouse: str, ds: str) -> dict:
    """`serving.ranking.*` (module docstring) for the model at `model_uri`."""
    from recd_core.modeling.saved import saved_meta
    from recd_core.scoring.scorer import features_of

    rows = Warehouse(warehouse).read_range("samples", ds, 0, max(CANDIDATES), layout="clustered")
    bodies = ranking_bodies(rows, features_of(saved_meta(model_uri)))
    servers = {}
    for name, flag in (("dedup", "--dedup"), ("no_dedup", "--no-dedup")):
        port = free_port()
        servers[name] = (recd_serve_cmd(model_uri, port, flag), port, None)
    with started(servers) as procs:
        # rows and ranking requests to the dedup server; ranking requests to the other
        targets = {
            (name, n): (procs[server], servers[server][1], bodies[kind, n], RANKING_REQUESTS[n])
            for name, server, kind in (
                ("request", "dedup", "request"),
                ("rows", "dedup", "rows"),
                ("no_dedup", "no_dedup", "request"),
            )
            for n in CANDIDATES
        }
        got = measure(targets)
    out = {}
    for (name, n), figures in got.items():
        for key, v in figures.items():
            out[f"serving.ranking.{name}_{n}.{key}"] = v
        kind = "rows" if name == "rows" else "request"
        out[f"serving.ranking.{name}_{n}.body_bytes"] = len(bodies[kind, n])
    out |= request_breakdown(model_uri, warehouse, ds, max(CANDIDATES))
    for n in CANDIDATES:
        p50 = out[f"serving.ranking.request_{n}.p50_ms"]
        out[f"serving.ranking.rows_ratio_{n}"] = out[f"serving.ranking.rows_{n}.p50_ms"] / p50
        out[f"serving.ranking.no_dedup_ratio_{n}"] = (
            out[f"serving.ranking.no_dedup_{n}.p50_ms"] / p50
        )
    return out


def request_breakdown(model_uri: str, warehouse: str, ds: str, n: int = 1_000) -> dict:
    """Where a ranking request of n candidates spends its time in the server's process, by
    stage, measured in-process (medians of 20): `serving.ranking.breakdown_<n>.*_ms`."""
    import torch

    from recd_core.modeling.saved import load_model, saved_meta
    from recd_core.scoring.ranking import ranking_batch
    from recd_core.scoring.scorer import Scorer, features_of
    from recd_core.serving.app import parse_json
    from recd_core.serving.batching import set_up_scoring

    rows = Warehouse(warehouse).read_range("samples", ds, 0, n, layout="clustered")
    body = ranking_bodies(rows, features_of(saved_meta(model_uri)), (n,))[("request", n)]
    scorer = Scorer(*load_model(model_uri))
    times: dict[str, list[float]] = {}

    def timed(stage: str, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        times.setdefault(stage, []).append(time.perf_counter() - t0)
        return out

    def model(batch):
        with torch.inference_mode():
            return torch.sigmoid(scorer.model(batch)).numpy()

    # set up as `recd serve` sets its process up, for the breakdown only: the bench's
    # process goes on with its own threads and switch interval
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    set_up_scoring(ServeConfig())
    try:
        for k in range(23):
            parsed = timed("parse", parse_json, body)
            columns, rows_n = request_columns(parsed, 10 * n)
            checked = timed("check", scorer.checked, columns, rows_n, 10 * n)
            batch = timed("batch", ranking_batch, checked.rankings[0], scorer.prep)
            probs = timed("model", model, batch)
            timed("answer", lambda p: orjson.dumps({"predictions": p.tolist()}), probs)
            if k < 3:  # warm-up
                times = {}
    finally:
        torch.set_num_threads(threads)
        sys.setswitchinterval(interval)
    return {
        f"serving.ranking.breakdown_{n}.{stage}_ms": 1e3 * float(np.median(v))
        for stage, v in times.items()
    }


def ranking_markdown(r: dict) -> list[str]:
    if "serving.ranking.request_1.p50_ms" not in r:
        return []
    lines = [
        "| candidates | sent as | p50 | p99 | requests/s | peak RSS | body | p50 vs the ranking request |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in CANDIDATES:
        for name, what in (
            ("request", "ranking request"),
            ("rows", "sample rows"),
            ("no_dedup", "ranking request, --no-dedup"),
        ):
            a = f"serving.ranking.{name}_{n}"
            ratio = (
                "1.0x"
                if name == "request"
                else f"**{r[f'serving.ranking.{name}_ratio_{n}']:.1f}x** slower"
            )
            lines.append(
                f"| {n:,} | {what} | {r[a + '.p50_ms']:,.1f} ms | {r[a + '.p99_ms']:,.1f} ms | "
                f"{r[a + '.requests_per_s']:,.1f} | {r[a + '.peak_rss'] / 2**20:,.0f} MiB | "
                f"{r[a + '.body_bytes'] / 1024:,.1f} KiB | {ratio} |"
            )
    b = f"serving.ranking.breakdown_{max(CANDIDATES)}"
    if f"{b}.model_ms" in r:
        stages = ("parse", "check", "batch", "model", "answer")
        total = sum(r[f"{b}.{s}_ms"] for s in stages)
        lines += [
            "",
            f"A {max(CANDIDATES):,}-candidate request in the server's process (medians): "
            + ", ".join(f"{s} {r[f'{b}.{s}_ms']:.1f} ms" for s in stages)
            + f"; the model {r[f'{b}.model_ms'] / total:.0%} of {total:.1f} ms.",
        ]
    return lines


def serving_markdown(r: dict) -> list[str]:
    if "serving.rows_1.p50_ms" not in r:
        return []
    lines = [
        "| rows a request | recd serve p50 | p99 | peak RSS | mlflow models serve p50 | p99 | peak RSS | p50 ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in SIZES:
        a = f"serving.rows_{n}"
        b = f"serving.mlflow.rows_{n}"
        ref = (
            (
                f"{r[b + '.p50_ms']:,.1f} ms | {r[b + '.p99_ms']:,.1f} ms | {r[b + '.peak_rss'] / 2**20:,.0f} MiB | "
                f"**{r[f'serving.speedup.rows_{n}']:.1f}x**"
            )
            if b + ".p50_ms" in r
            else "- | - | - | -"
        )
        lines.append(
            f"| {n:,} | {r[a + '.p50_ms']:,.1f} ms | {r[a + '.p99_ms']:,.1f} ms | "
            f"{r[a + '.peak_rss'] / 2**20:,.0f} MiB | {ref} |"
        )
    return lines


def served_model_args(doc: str) -> argparse.ArgumentParser:
    """The serving benches' command line: the model served and the day its requests come
    from."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--model", required=True, help="<warehouse>/models/<run>")
    p.add_argument("--warehouse", required=True)
    p.add_argument("--ds", required=True, help="the day whose sample rows are sent")
    return p


def main(argv: list[str] | None = None) -> None:
    p = served_model_args(__doc__)
    p.add_argument("--no-reference", action="store_true", help="skip mlflow models serve")
    a = p.parse_args(argv)
    r = serving_figures(a.model, a.warehouse, a.ds, reference=not a.no_reference)
    r.update(ranking_figures(a.model, a.warehouse, a.ds))
    print("\n".join(serving_markdown(r) + [""] + ranking_markdown(r)))
    print_summary("recd bench (serving)", r)


if __name__ == "__main__":
    main()
