"""Serving the champion: `recd serve` and `mlflow models serve` as real processes on loopback,
the same registered model behind both: the same scores, typed ids, limits in rows and bytes,
one-line refusals, a stop on SIGTERM; ranking requests (one user, many candidates) scored as
their sample rows are."""

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlflow.artifacts
import pytest
from doc_blocks import block_with, run_block
from mlflow.tracking import MlflowClient

from recd_core.modeling.launch import free_port
from recd_core.runtime import cpu_budget

BIN = Path(sys.executable).parent
DAY = "2026-11-01"


def as_rows(ranking: dict) -> dict:
    """A ranking request as the same samples in the row format: its user side in every row."""
    split = ranking["dataframe_split"]
    records = []
    for values in split["data"]:
        request = dict(zip(split["columns"], values, strict=True))
        records += [{**request, **cand} for cand in request.pop("candidates")]
    columns = list(records[0])
    return {
        "dataframe_split": {"columns": columns, "data": [[r[c] for c in columns] for r in records]}
    }


@pytest.fixture(scope="module")
def champion(tmp_path_factory):
    """One day of `recd run` (registers and promotes its model) and the champion's own
    serving example (a ranking request, as MLflow stored it) as sample rows."""
    root = tmp_path_factory.mktemp("serving")
    uri = f"sqlite:///{root}/mlflow.db"
    r = subprocess.run(
        [
            str(BIN / "recd"),
            "--tracking-uri",
            uri,
            "run",
            "--warehouse",
            root / "wh",
            "--logs",
            root / "logs",
            "--out",
            root / "out",
            "--ds",
            DAY,
            "--config",
            Path(__file__).parent / "configs/small.yaml",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    version = MlflowClient(tracking_uri=uri).get_model_version_by_alias("recd-dlrm", "champion")
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=version.source, dst_path=str(root / "champion"), tracking_uri=uri
    )
    example = json.loads((Path(local) / "serving_input_example.json").read_text())
    (root / "ranking.json").write_text(json.dumps(example))
    return root, uri, as_rows(example)


@pytest.fixture(scope="module")
def ranking(champion) -> dict:
    """The champion's serving example: one user's side once, its candidates listed."""
    root, _, _ = champion
    return json.loads((root / "ranking.json").read_text())


class Server:
    """A scoring server process on a free loopback port, stopped (and reaped) on exit."""

    def __init__(self, cmd: list[str], uri: str, port: int):
        env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PATH": f"{BIN}:{os.environ['PATH']}"}
        self.port = port
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(self.url("/ping"), timeout=2):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.fail("server did not start: " + self.proc.stderr.read().decode()[-2000:])
                time.sleep(0.5)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, body, content_type: str = "application/json") -> tuple[int, str]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url("/invocations"), data=data, headers={"Content-Type": content_type}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def recd_serve(uri: str, *limits: str) -> Server:
    port = free_port()
    return Server(
        [
            str(BIN / "recd"),
            "serve",
            "--model",
            "models:/recd-dlrm@champion",
            "--port",
            str(port),
            *limits,
        ],
        uri,
        port,
    )


def one_line_refusal(status: int, body: str, expected: int, *words: str) -> None:
    assert status == expected, (status, body)
    assert "\n" not in body.strip() and "Traceback" not in body and "stack_trace" not in body
    message = json.loads(body)["message"]
    for w in words:
        assert w in message, (w, message)


def test_both_servers_score_the_champions_example_alike(champion):
    """`recd serve` and `mlflow models serve`, one registered model: the same scores."""
    _, uri, example = champion
    ours = recd_serve(uri)
    try:
        status, body = ours.post(example)
        assert status == 200, body
        scores = json.loads(body)["predictions"]
        # the same rows as dataframe_records: the same scores
        cols = example["dataframe_split"]["columns"]
        records = [dict(zip(cols, row, strict=True)) for row in example["dataframe_split"]["data"]]
        status, body = ours.post({"dataframe_records": records})
        assert status == 200 and json.loads(body)["predictions"] == scores
        with urllib.request.urlopen(ours.url("/version")) as r:
            assert json.loads(r.read())["model"] == "models:/recd-dlrm@champion"
    finally:
        ours.stop()
    port = free_port()
    theirs = Server(
        [
            str(BIN / "mlflow"),
            "models",
            "serve",
            "-m",
            "models:/recd-dlrm@champion",
            "--env-manager",
            "local",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
        ],
        uri,
        port,
    )
    cols = example["dataframe_split"]["columns"]
    dense = next(c for c in ("user_dense", "item_dense") if c in cols)
    broken = json.loads(json.dumps(example))
    row = broken["dataframe_split"]["data"][0]
    row[cols.index(dense)] = [float("nan")] * len(row[cols.index(dense)])
    try:
        status, body = theirs.post(example)
        # MLflow's server runs the model's own checks too: a 400 naming the row and field
        # (its body also echoes the request: recd serve's does not)
        refused, why = theirs.post(broken)
    finally:
        theirs.stop()
    assert status == 200, body
    assert refused == 400 and "row 0" in why and dense in why and "not finite" in why, why
    assert "stack_trace" not in why and "Traceback" not in why
    assert json.loads(body)["predictions"] == pytest.approx(scores, rel=1e-6)
    assert len(scores) == len(example["dataframe_split"]["data"]) > 0
    assert all(0.0 < p < 1.0 for p in scores)


def test_a_malformed_request_of_each_kind_is_one_line_naming_what(champion):
    _, uri, example = champion
    cols = example["dataframe_split"]["columns"]
    dense = next(c for c in ("user_dense", "item_dense") if c in cols)

    def with_value(col: str, value):
        broken = json.loads(json.dumps(example))
        broken["dataframe_split"]["data"][1][cols.index(col)] = value
        return broken

    width = len(example["dataframe_split"]["data"][0][cols.index(dense)])
    cases = [
        # ids are JSON integers, as ingest takes them: no coercion
        (with_value("item_id", 3.7), 400, "row 1", "'item_id'", "expected an integer"),
        (with_value("item_id", True), 400, "row 1", "'item_id'", "bool"),
        (with_value("item_id", "58"), 400, "row 1", "'item_id'", "str"),
        (with_value("item_id", 10**30), 400, "row 1", "'item_id'", "out of range"),
        (with_value("item_id", -4), 400, "row 1", "'item_id'", "negative"),
        (with_value("item_id", None), 400, "row 1", "missing required field 'item_id'"),
        (with_value(dense, [float("nan")] * width), 400, "row 1", dense, "not finite"),
        (with_value(dense, [0.5]), 400, "row 1", dense, f"expected {width} values"),
        (with_value("user_history", "not a list"), 400, "row 1", "user_history"),
        (b"{garbage", 400, "invalid JSON"),
        (b'{"dataframe_split": {"columns": ["a"], "data": [[1]]}}', 400, "lacks feature"),
        (b'{"rows": []}', 400, "dataframe_split"),
        (b"[1, 2, 3]", 400, "JSON object"),
        (b'{"dataframe_split": {"columns": ["a", "b"], "data": [[1]]}}', 400, "row 0"),
        (b"\xff\xfe not text", 400, "UTF-8"),
        (b'{"dataframe_records": [{"item_id": 1, "\\ud800": 2}]}', 400, "lone UTF-16 surrogate"),
        (json.dumps(with_value("user_history", ["\ud800"])).encode(), 400, "surrogate"),
        (b'{"dataframe_records": [{"item_id": ' + b"9" * 5000 + b"}]}", 400, "invalid JSON"),
    ]
    server = recd_serve(uri)
    try:
        for body, status, *words in cases:
            one_line_refusal(*server.post(body), status, *words)
        one_line_refusal(*server.post(b"a,b\n1,2\n", "text/csv"), 415, "application/json")
        status, body = server.post(example)  # and it still serves
        assert status == 200, body
    finally:
        server.stop()


def test_requests_past_the_limits_are_refused_with_413_before_the_work(champion):
    _, uri, example = champion
    rows = example["dataframe_split"]["data"]
    small = len(json.dumps(example))
    server = recd_serve(uri, "--max-rows", str(len(rows)), "--max-bytes", str(2 * small))
    try:
        more = json.loads(json.dumps(example))
        more["dataframe_split"]["data"] = rows + rows[:1]
        one_line_refusal(*server.post(more), 413, f"{len(rows) + 1:,} rows", "serve.max_rows")
        big = json.loads(json.dumps(example))
        big["padding"] = "x" * (3 * small)
        one_line_refusal(*server.post(big), 413, "serve.max_bytes")
        # a chunked body (no Content-Length) is cut off as it streams in
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.putrequest("POST", "/invocations")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        chunk = b"x" * small
        for _ in range(4):
            conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        conn.send(b"0\r\n\r\n")
        response = conn.getresponse()
        one_line_refusal(response.status, response.read().decode(), 413, "at least")
        conn.close()
        status, body = server.post(example)  # within the limits: served
        assert status == 200, body
    finally:
        server.stop()


def test_a_request_past_its_time_is_a_504_and_sigterm_stops_the_server(champion):
    _, uri, example = champion
    server = recd_serve(uri, "--timeout-s", "0.000001")
    try:
        one_line_refusal(*server.post(example), 504, "serve.timeout_s")
    finally:
        t0 = time.monotonic()
        server.stop()
        stopped = time.monotonic() - t0
    # uvicorn finishes what is in flight, then ends by the signal it was sent
    assert server.proc.returncode in (0, -signal.SIGTERM) and stopped < 10


def test_serve_refuses_a_model_it_cannot_load_in_one_line(champion, tmp_path):
    root, uri, _ = champion
    for args, env_uri, words in (
        (["--model", str(tmp_path / "nowhere")], None, "nowhere"),
        (["--model", "models:/recd-dlrm@champion"], None, "--tracking-uri"),
        (["--model", "models:/no-such-model@champion"], uri, "no-such-model"),
    ):
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
        cmd = [str(BIN / "recd"), *(["--tracking-uri", env_uri] if env_uri else []), "serve", *args]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "Traceback" not in r.stderr and words in r.stdout + r.stderr


def test_requests_past_the_in_flight_limit_are_told_to_retry(champion):
    """`--max-in-flight 1`: while one request is still arriving (a chunked body half sent),
    the next is a 503 with Retry-After, at once; the first then completes."""
    _, uri, example = champion
    server = recd_serve(uri, "--max-in-flight", "1")
    try:
        body = json.dumps(example).encode()
        slow = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        slow.putrequest("POST", "/invocations")
        slow.putheader("Content-Type", "application/json")
        slow.putheader("Transfer-Encoding", "chunked")
        slow.endheaders()
        slow.send(b"%x\r\n%s\r\n" % (10, body[:10]))  # in flight, its body half there
        time.sleep(1)
        t0 = time.monotonic()
        request = urllib.request.Request(
            server.url("/invocations"), data=body, headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as busy:
            urllib.request.urlopen(request, timeout=60)
        assert time.monotonic() - t0 < 5  # told at once, not queued
        one_line_refusal(busy.value.code, busy.value.read().decode(), 503, "serve.max_in_flight")
        assert busy.value.headers["Retry-After"] == "1"
        rest = body[10:]
        slow.send(b"%x\r\n%s\r\n0\r\n\r\n" % (len(rest), rest))
        response = slow.getresponse()
        assert response.status == 200 and json.loads(response.read())["predictions"]
        slow.close()
    finally:
        server.stop()


def test_concurrent_ranking_requests_share_model_calls_and_score_as_alone(champion, ranking):
    """Eight clients at once, each its own user (`--batch-wait-ms`: a model call waits for
    the requests arriving with it): every answer is the one its request gets alone, and
    requests were scored together, on `--threads` torch threads; a request past `--queue-rows`
    alone is a 413 naming the limit (it could never be held)."""
    import concurrent.futures

    _, uri, _ = champion
    columns = ranking["dataframe_split"]["columns"]
    bodies = []
    for k in range(8):
        split = json.loads(json.dumps(ranking["dataframe_split"]))
        split["data"][0][columns.index("user_id")] = k + 1
        bodies.append(json.dumps({"dataframe_split": split}).encode())
    server = recd_serve(uri, "--batch-wait-ms", "300", "--threads", "2")
    try:

        def scores(body: bytes) -> list[float]:
            status, answer = server.post(body)
            assert status == 200, answer
            return json.loads(answer)["predictions"]

        alone = [scores(b) for b in bodies]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            together = list(pool.map(scores, bodies))
        assert len({tuple(a) for a in alone}) > 1  # the users' answers differ
        for a, b in zip(alone, together, strict=True):
            assert b == pytest.approx(a, abs=1e-6)
        with urllib.request.urlopen(server.url("/stats"), timeout=30) as r:
            stats = json.loads(r.read())
        assert stats["requests_batched"] >= 2 and stats["in_flight"] == stats["rows_held"] == 0
        assert stats["model_calls"] < 16 and stats["scoring_threads"] == 2
    finally:
        server.stop()
    server = recd_serve(uri, "--queue-rows", "1")
    try:
        status, answer = server.post(bodies[0])
        one_line_refusal(status, answer, 413, "serve.queue_rows", "split the request")
        with urllib.request.urlopen(server.url("/stats"), timeout=30) as r:  # the CPUs, less 2
            assert json.loads(r.read())["scoring_threads"] == max(cpu_budget() - 2, 1)
    finally:
        server.stop()


def as_v2(split: dict) -> dict:
    """A dataframe_split body as KServe's v2 inference request: a tensor a column, lists
    (and a ranking request's candidates) as BYTES, a JSON text a row."""
    inputs = []
    for j, name in enumerate(split["columns"]):
        values = [row[j] for row in split["data"]]
        if any(isinstance(v, list | dict) for v in values):
            kind, values = "BYTES", [json.dumps(v) for v in values]
        else:
            kind = "INT64" if all(isinstance(v, int) for v in values) else "FP64"
        inputs.append({"name": name, "shape": [len(values)], "datatype": kind, "data": values})
    return {"id": "req-1", "inputs": inputs}


def test_kserve_v2_protocol_scores_as_mlflows(champion, ranking):
    """The Open Inference Protocol beside MLflow's on one server: health and metadata, the
    ranking request and its rows as v2 tensors score as through /invocations (1e-6); a
    refusal names the row and field in the protocol's error body; another model's name is
    a 404."""
    _, uri, example = champion
    server = recd_serve(uri)

    def get(path: str) -> dict:
        with urllib.request.urlopen(server.url(path), timeout=60) as r:
            assert r.status == 200
            return json.loads(r.read())

    def infer(body: dict, name: str = "recd-dlrm") -> tuple[int, dict]:
        request = urllib.request.Request(
            server.url(f"/v2/models/{name}/infer"),
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        assert get("/v2/health/live") == {"live": True}
        assert get("/v2/health/ready") == {"ready": True}
        assert get("/v2/models/recd-dlrm/ready") == {"name": "recd-dlrm", "ready": True}
        meta = get("/v2/models/recd-dlrm")
        names = {i["name"]: i for i in meta["inputs"]}
        assert names["user_id"]["datatype"] == "INT64" and names["candidates"]["shape"] == [-1]
        assert meta["outputs"] == [{"name": "predictions", "datatype": "FP64", "shape": [-1]}]
        for body in (ranking, example):
            status, mlflows = server.post(body)
            assert status == 200, mlflows
            status, got = infer(as_v2(body["dataframe_split"]))
            assert status == 200, got
            out = got["outputs"][0]
            assert got["model_name"] == "recd-dlrm" and got["id"] == "req-1"
            assert out["datatype"] == "FP64" and out["shape"] == [len(out["data"])]
            assert out["data"] == pytest.approx(json.loads(mlflows)["predictions"], abs=1e-6)
        bad = as_v2(ranking["dataframe_split"])
        user_id = next(i for i in bad["inputs"] if i["name"] == "user_id")
        user_id["data"], user_id["datatype"] = [3.7], "FP64"
        status, refusal = infer(bad)
        assert status == 400 and "'user_id'" in refusal["error"] and "\n" not in refusal["error"]
        status, refusal = infer(as_v2(ranking["dataframe_split"]), name="other")
        assert status == 404 and "recd-dlrm" in refusal["error"]
    finally:
        server.stop()


def mlflow_serve(uri: str) -> Server:
    port = free_port()
    return Server(
        [
            str(BIN / "mlflow"),
            "models",
            "serve",
            "-m",
            "models:/recd-dlrm@champion",
            "--env-manager",
            "local",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
        ],
        uri,
        port,
    )


def test_a_ranking_request_scores_as_its_rows_on_both_servers(champion, ranking):
    """One user's side said once, its candidates listed: the scores of the same samples sent
    as rows, on `recd serve` (and with the user side computed per candidate, --no-dedup) and
    on `mlflow models serve` (the same pyfunc)."""
    _, uri, _ = champion
    rows = as_rows(ranking)
    candidates = len(ranking["dataframe_split"]["data"][0][-1])
    assert ranking["dataframe_split"]["columns"][-1] == "candidates" and candidates > 1
    ours = recd_serve(uri)
    try:
        status, body = ours.post(ranking)
        assert status == 200, body
        scores = json.loads(body)["predictions"]
        status, body = ours.post(rows)
        assert status == 200 and json.loads(body)["predictions"] == pytest.approx(scores, abs=1e-6)
        twice = json.loads(json.dumps(ranking))  # two requests in one body: one after the other
        twice["dataframe_split"]["data"] *= 2
        status, body = ours.post(twice)
        assert status == 200 and json.loads(body)["predictions"] == pytest.approx(2 * scores)
        # ready: the smallest valid ranking request scored through the same path
        with urllib.request.urlopen(ours.url("/ready"), timeout=60) as r:
            assert r.status == 200 and len(json.loads(r.read())["predictions"]) == 1
    finally:
        ours.stop()
    per_candidate = recd_serve(uri, "--no-dedup")
    try:
        status, body = per_candidate.post(ranking)
    finally:
        per_candidate.stop()
    assert status == 200 and json.loads(body)["predictions"] == pytest.approx(scores, abs=1e-6)
    theirs = mlflow_serve(uri)
    broken = json.loads(json.dumps(ranking))
    broken["dataframe_split"]["data"][0][-1][1]["item_id"] = -4
    try:
        by_request = theirs.post(ranking)
        by_rows = theirs.post(rows)
        refused, why = theirs.post(broken)
    finally:
        theirs.stop()
    assert by_request[0] == 200 and by_rows[0] == 200, (by_request, by_rows)
    assert json.loads(by_request[1])["predictions"] == pytest.approx(scores, abs=1e-6)
    assert json.loads(by_rows[1])["predictions"] == pytest.approx(scores, abs=1e-6)
    assert len(scores) == candidates and all(0.0 < p < 1.0 for p in scores)
    assert refused == 400 and "candidate 1" in why and "'item_id'" in why and "negative" in why
    assert "Traceback" not in why and "stack_trace" not in why


def test_a_malformed_ranking_request_of_each_kind_is_one_line_naming_what(champion, ranking):
    _, uri, _ = champion
    split = ranking["dataframe_split"]
    request = dict(zip(split["columns"], split["data"][0], strict=True))
    dense = next(c for c in ("item_dense", "user_dense") if c in request["candidates"][0])

    def changed(change) -> dict:
        req = json.loads(json.dumps(request))
        change(req)
        return {"dataframe_records": [req]}

    def candidate(i: int, field: str, value):
        return lambda req: req["candidates"][i].__setitem__(field, value)

    def user(field: str, value):
        return lambda req: req.__setitem__(field, value)

    width = len(request["candidates"][0][dense]) if dense == "item_dense" else 1
    cases = [
        (changed(candidate(1, "item_id", 3.7)), 400, "candidate 1", "'item_id'", "integer"),
        (changed(candidate(1, "item_id", "58")), 400, "candidate 1", "'item_id'", "str"),
        (changed(candidate(2, "item_id", -4)), 400, "candidate 2", "'item_id'", "negative"),
        (
            changed(candidate(1, dense, [float("nan")] * width)),
            400,
            "candidate 1",
            dense,
            "not finite",
        ),
        (
            changed(lambda req: req["candidates"][1].pop("item_id")),
            400,
            "candidate 1",
            "lacks 'item_id'",
        ),
        (changed(lambda req: req["candidates"].__setitem__(0, 7)), 400, "candidate 0", "object"),
        (changed(user("candidates", [])), 400, "'candidates'", "non-empty list"),
        (changed(user("candidates", "all")), 400, "'candidates'", "non-empty list"),
        (changed(user("user_id", -3)), 400, "user field 'user_id'", "negative"),
        (changed(user("user_history", "not a list")), 400, "user field 'user_history'", "list"),
        (changed(lambda req: req.pop("user_id")), 400, "lacks user feature", "user_id"),
    ]
    server = recd_serve(uri, "--max-rows", str(2 * len(request["candidates"]) - 1))
    try:
        for body, status, *words in cases:
            one_line_refusal(*server.post(body), status, *words)
        over = {"dataframe_records": [request, request]}  # the limit counts candidates
        one_line_refusal(*server.post(over), 413, "candidates", "serve.max_rows")
        status, body = server.post(ranking)  # and it still serves
        assert status == 200, body
    finally:
        server.stop()


def test_a_moved_alias_is_followed_and_a_broken_version_never_served(champion, ranking):
    """`--follow-alias-s`: a promotion (the alias moved to another version) is loaded, checked
    and swapped in while the server answers; a version that cannot load is logged and the
    served one stays."""
    _, uri, _ = champion
    client = MlflowClient(tracking_uri=uri)
    first = client.get_model_version_by_alias("recd-dlrm", "champion")
    server = recd_serve(uri, "--follow-alias-s", "0.5")

    def served_version() -> str:
        with urllib.request.urlopen(server.url("/version"), timeout=30) as r:
            return json.loads(r.read())["version"]

    def wait_for(version: str) -> None:
        deadline = time.monotonic() + 90
        while served_version() != version:
            assert time.monotonic() < deadline, f"still serving {served_version()}"
            status, body = server.post(ranking)  # answering all along
            assert status == 200, body
            time.sleep(0.2)

    try:
        assert served_version() == str(first.version)
        status, body = server.post(ranking)
        scores = json.loads(body)["predictions"]
        # a promotion: a new version of the same model, the alias moved to it
        promoted = client.create_model_version("recd-dlrm", first.source, run_id=first.run_id)
        client.set_registered_model_alias("recd-dlrm", "champion", promoted.version)
        wait_for(str(promoted.version))
        status, body = server.post(ranking)
        assert status == 200 and json.loads(body)["predictions"] == pytest.approx(scores)
        # a version whose artifacts are gone: never swapped in
        broken = client.create_model_version(
            "recd-dlrm", str(Path(uri[10:]).parent / "gone"), run_id=first.run_id
        )
        client.set_registered_model_alias("recd-dlrm", "champion", broken.version)
        time.sleep(3)
        assert served_version() == str(promoted.version)
        assert server.post(ranking)[0] == 200
    finally:
        client.set_registered_model_alias("recd-dlrm", "champion", first.version)
        server.stop()
    log = server.proc.stderr.read().decode()
    assert f"now serving models:/recd-dlrm@champion version {promoted.version}" in log
    assert f"version {promoted.version} serves on" in log


def test_the_operations_pages_serving_and_status_commands_run_as_written(champion, tmp_path):
    """docs/operations.md's requests pasted into a shell: the ranking request written out in
    full (and as v2 tensors: the same scores) and the registered version's own example,
    each answered with scores; `recd status` of the day. Only the places that name a user's
    site are swapped."""
    root, uri, _ = champion
    server = recd_serve(uri)
    try:
        host = {"http://recd-serve:8080": f"http://127.0.0.1:{server.port}"}
        direct = run_block(block_with("/invocations -d '{"), host)
        assert direct.returncode == 0, direct.stderr
        scores = json.loads(direct.stdout)["predictions"]
        assert len(scores) == 2 and all(0 < p < 1 for p in scores), direct.stdout
        # the same request as KServe's v2 tensors: the same scores
        v2 = run_block(
            block_with("/v2/models/recd-dlrm/infer -d '{"),
            {"http://recd-dlrm-predictor.recd": f"http://127.0.0.1:{server.port}"},
        )
        assert v2.returncode == 0, v2.stderr
        answer = json.loads(v2.stdout)
        assert answer["id"] == "rank-3"
        assert answer["outputs"][0]["data"] == pytest.approx(scores, abs=1e-6), v2.stdout
        saved = run_block(
            block_with("mlflow artifacts download"),
            {**host, "/tmp/champion": str(tmp_path / "champion")},
            env={"MLFLOW_TRACKING_URI": uri},
        )
        assert saved.returncode == 0, saved.stderr[-2000:]
        # mlflow prints the file's path, then curl the answer
        assert json.loads(saved.stdout.splitlines()[-1])["predictions"], saved.stdout
    finally:
        server.stop()
    status = run_block(
        block_with("recd status --warehouse"),
        {"2026-11-24": DAY},
        env={"RECD_WAREHOUSE": str(root / "wh")},
    )
    assert status.returncode == 0, status.stderr
    assert "fresh" in status.stdout + status.stderr


def test_v2_tensors_become_columns_or_a_one_line_refusal():
    """A v2 request's tensors as the columns MLflow's protocol gives: a dense vector [n, k]
    row by row (flat or nested data), BYTES as each row's JSON; malformed tensors refused
    naming the input, too many rows a 413."""
    from recd_core.scoring.request import RequestError
    from recd_core.serving.v2 import columns_of

    body = {
        "inputs": [
            {"name": "user_id", "shape": [2], "datatype": "INT64", "data": [3, 4]},
            {"name": "dense", "shape": [2, 3], "datatype": "FP32", "data": [1, 2, 3, 4, 5, 6]},
            {"name": "nested", "shape": [2, 2], "datatype": "FP32", "data": [[1, 2], [3, 4]]},
            {"name": "history", "shape": [2], "datatype": "BYTES", "data": ["[1, 2]", "[]"]},
        ]
    }
    columns, n = columns_of(body, 10)
    assert n == 2 and columns["user_id"] == [3, 4] and columns["history"] == [[1, 2], []]
    assert columns["dense"] == [[1, 2, 3], [4, 5, 6]] and columns["nested"] == [[1, 2], [3, 4]]
    for change, words in (
        (lambda b: b["inputs"][0].update(shape=[3]), "2 values for shape [3]"),
        (lambda b: b["inputs"][1].update(shape=[3, 2]), "'dense': 3 rows"),
        (lambda b: b["inputs"][0].update(datatype="INT128"), "not one of the protocol's"),
        (lambda b: b["inputs"][3].update(data=["[1, 2", "[]"]), "row 0, field 'history'"),
        (lambda b: b.pop("inputs"), "'inputs'"),
    ):
        bad = json.loads(json.dumps(body))
        change(bad)
        with pytest.raises(RequestError) as refused:
            columns_of(bad, 10)
        assert words in str(refused.value) and refused.value.status == 400, str(refused.value)
    with pytest.raises(RequestError) as refused:
        columns_of(body, 1)
    assert refused.value.status == 413 and "serve.max_rows" in str(refused.value)
