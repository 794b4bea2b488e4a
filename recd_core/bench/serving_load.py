"""The scoring service under many clients: throughput, latency and refusals, closed and open
loop, side by side in one run against one `recd serve`.

    python -m recd_core.bench.serving_load --model W/models/RUN --warehouse W --ds D

The server runs with its defaults (dynamic batching: ranking requests that arrive together
share a model call; the in-flight limit and the row queue from the row budget). Each client
is its own user: a ranking request of 50 candidates (the user side of one row of day D, the
candidates of the 50 rows from it).

    closed loop   C clients (1, 8, 32), each sending its next request once the last is
                  answered, for 6 s: requests and candidates answered a second, p50 / p99
                  latency of the answered ones, 503s
    open loop     requests arriving at a fixed rate (0.5x and 1.5x the 32 clients'
                  throughput, spread evenly) for 6 s, latency from the arrival: below and
                  past saturation

and 8 clients of 1,000-candidate requests, as ranking requests and as the same samples in
the row format (dedup's gain under load); with the model calls and the requests that shared
one (`/stats`) and the server's peak RSS per scenario; keys `serving.load.closed.c<C>.*`,
`serving.load.open.x<rate>.*`, `serving.load.closed.c8.n1000.*`. The clients run on the
same cores as the server (Python threads, one keep-alive connection each; the
open loop up to 1,024 at once), their process's collector off while they time.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from recd_core.bench.serving import (
    _peak_rss,
    _reset_peak,
    _wait,
    client_collector_off,
    recd_serve_cmd,
    served_model_args,
    user_bodies,
)
from recd_core.modeling.launch import free_port
from recd_core.report import print_summary
from recd_core.runtime import owned_child, stop_group
from recd_core.warehouse import Warehouse

CLIENTS = (1, 8, 32)
RATES = (0.5, 1.5)  # the open loop's arrivals, as multiples of the 32 clients' throughput
CANDIDATES = 50
LARGE = 1_000  # and 8 clients of 1,000-candidate requests, as requests and as rows
SECONDS = 6.0
# the open loop's connections: more than the server's default in-flight limit, so past
# saturation the requests pile up at the server (and its 503s show), not in the client
OPEN_CONNECTIONS = 1024


class _Client:
    """One keep-alive connection; `send` -> (HTTP status, seconds)."""

    def __init__(self, port: int):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def send(self, body: bytes) -> tuple[int, float]:
        t0 = time.perf_counter()
        self.conn.request(
            "POST", "/invocations", body=body, headers={"Content-Type": "application/json"}
        )
        response = self.conn.getresponse()
        response.read()
        return response.status, time.perf_counter() - t0


def _stats(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/stats")
    return json.loads(conn.getresponse().read())


def _summary(done, seconds: float, stats0, stats1, rss, n: int = CANDIDATES) -> dict:
    ok = np.array([t for s, t in done if s == 200]) * 1e3
    calls = stats1["model_calls"] - stats0["model_calls"]
    return {
        "requests_per_s": len(ok) / seconds,
        "candidates_per_s": len(ok) * n / seconds,
        "p50_ms": float(np.percentile(ok, 50)) if len(ok) else float("nan"),
        "p99_ms": float(np.percentile(ok, 99)) if len(ok) else float("nan"),
        "answered": len(ok),
        "refused_503": sum(1 for s, _ in done if s == 503),
        "other_errors": sum(1 for s, _ in done if s not in (200, 503)),
        "model_calls": calls,
        "requests_a_call": len(ok) / max(calls, 1),
        "peak_rss": rss,
    }


def closed_loop(port: int, pid: int, bodies: list[bytes], clients: int, n=CANDIDATES) -> dict:
    stop = time.perf_counter() + SECONDS
    done: list[tuple[int, float]] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        c = _Client(port)
        i = k
        while time.perf_counter() < stop:
            got = c.send(bodies[i % len(bodies)])
            with lock:
                done.append(got)
            i += clients

    _reset_peak(pid)
    before = _stats(port)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return _summary(done, time.perf_counter() - t0, before, _stats(port), _peak_rss(pid), n)


def open_loop(port: int, pid: int, bodies: list[bytes], rate: float) -> dict:
    """Arrivals every 1/rate s; a request's latency counts from its arrival."""
    arrivals = int(rate * SECONDS)
    local = threading.local()
    done: list[tuple[int, float]] = []
    lock = threading.Lock()

    def one(k: int, due: float) -> None:
        if not hasattr(local, "client"):
            local.client = _Client(port)
        status, _ = local.client.send(bodies[k % len(bodies)])
        with lock:
            done.append((status, time.perf_counter() - due))

    _reset_peak(pid)
    before = _stats(port)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(OPEN_CONNECTIONS) as pool:
        for k in range(arrivals):
            due = t0 + k / rate
            time.sleep(max(due - time.perf_counter(), 0))
            pool.submit(one, k, due)
    return _summary(done, time.perf_counter() - t0, before, _stats(port), _peak_rss(pid))


def load_figures(model_uri: str, warehouse: str, ds: str) -> dict:
    """`serving.load.*` (module doc) for the model at `model_uri`."""
    from recd_core.modeling.saved import saved_meta
    from recd_core.scoring.scorer import features_of

    rows = Warehouse(warehouse).read_range("samples", ds, 0, 64 * CANDIDATES, layout="clustered")
    features = features_of(saved_meta(model_uri))
    bodies = user_bodies(rows, features, 64, CANDIDATES)
    big = {  # 1,000 candidates, as a ranking request and as rows: 8 clients
        kind: user_bodies(rows, features, 8, LARGE, as_rows=kind == "rows")
        for kind in ("request", "rows")
    }
    port = free_port()
    server = subprocess.Popen(
        recd_serve_cmd(model_uri, port),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        **owned_child(),
    )
    out: dict = {"serving.load.candidates": CANDIDATES, "serving.load.seconds": SECONDS}
    try:
        _wait(port, server)
        c = _Client(port)
        for b in bodies[:4]:  # warm-up
            c.send(b)
        with client_collector_off():  # the clients' own pauses are not the server's
            for clients in CLIENTS:
                for k, v in closed_loop(port, server.pid, bodies, clients).items():
                    out[f"serving.load.closed.c{clients}.{k}"] = v
            peak = out[f"serving.load.closed.c{max(CLIENTS)}.requests_per_s"]
            for x in RATES:
                for k, v in open_loop(port, server.pid, bodies, x * peak).items():
                    out[f"serving.load.open.x{x:g}.{k}"] = v
                out[f"serving.load.open.x{x:g}.rate"] = x * peak
            for kind, b in big.items():
                for k, v in closed_loop(port, server.pid, b, 8, LARGE).items():
                    out[f"serving.load.closed.c8.n{LARGE}.{kind}.{k}"] = v
    finally:
        stop_group(server)
    big_ratio = f"serving.load.closed.c8.n{LARGE}"
    out[f"{big_ratio}.rows_ratio"] = (
        out[f"{big_ratio}.request.requests_per_s"] / out[f"{big_ratio}.rows.requests_per_s"]
    )
    one = out["serving.load.closed.c1.requests_per_s"]
    for clients in CLIENTS[1:]:
        out[f"serving.load.closed.c{clients}.vs_one_client"] = (
            out[f"serving.load.closed.c{clients}.requests_per_s"] / one
        )
    return out


def load_markdown(r: dict) -> list[str]:
    if "serving.load.closed.c1.p50_ms" not in r:
        return []
    lines = [
        f"| {r['serving.load.candidates']} candidates a request | requests/s | vs one client | "
        "candidates/s | p50 | p99 | 503s | requests a model call | peak RSS |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    keys = [(f"closed loop, {c} client{'s' * (c > 1)}", f"closed.c{c}") for c in CLIENTS]
    keys += [(f"open loop, {x:g}x the 32 clients' rate", f"open.x{x:g}") for x in RATES]
    keys += [
        (f"8 clients, {LARGE:,} candidates, {what}", f"closed.c8.n{LARGE}.{kind}")
        for kind, what in (("request", "ranking requests"), ("rows", "as sample rows"))
    ]
    one = r["serving.load.closed.c1.requests_per_s"]
    for name, k in keys:
        a = f"serving.load.{k}"
        vs = "-" if ".n" in k else f"{r[a + '.requests_per_s'] / one:.2f}x"  # 50 candidates
        lines.append(
            f"| {name} | {r[a + '.requests_per_s']:,.1f} | {vs}"
            f" | {r[a + '.candidates_per_s']:,.0f} | {r[a + '.p50_ms']:,.1f} ms | "
            f"{r[a + '.p99_ms']:,.1f} ms | {r[a + '.refused_503']:,} | "
            f"{r[a + '.requests_a_call']:.1f} | {r[a + '.peak_rss'] / 2**20:,.0f} MiB |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    a = served_model_args(__doc__).parse_args(argv)
    r = load_figures(a.model, a.warehouse, a.ds)
    print("\n".join(load_markdown(r)))
    print_summary("recd bench (serving under load)", r)


if __name__ == "__main__":
    sys.exit(main())
