"""`recd serve`: the champion as a scoring service, bounded whatever arrives.

It serves the same registered model `mlflow models serve` serves (the pyfunc of
mlops/pyfunc.py, by `models:/<name>@champion`, or a trained model's directory) and speaks
MLflow's scoring protocol, so a client of one works with the other:

    GET  /ping, /health   200 once the model is loaded
    GET  /ready           200 once a ranking request (the smallest valid one: ids 0, one
                          candidate) went through the whole request path to a finite score;
                          the chart's readiness probe
    GET  /version         the recd version, the model served and its registry version
    GET  /stats           requests and rows held now, model calls, requests batched, torch's
                          threads for a model call (serve.threads)
    /v2/...               KServe's Open Inference Protocol (serving/v2.py): health, the
                          model's metadata, POST /v2/models/{name}/infer
    POST /invocations     application/json: dataframe_split | dataframe_records
                          -> {"predictions": [p, ...]}
                          sample rows (one per impression), or ranking requests (the
                          user side once, a `candidates` list: scoring/ranking.py), one
                          probability per row or per candidate

What it adds to MLflow's server is what an orchestrated service needs (`ServeConfig`):

    a request past serve.max_bytes       413, refused before its body is read
      (Content-Length) or while it streams in
    a request past serve.max_rows        413, before a column is built
    more than serve.max_in_flight        503 with Retry-After: the server holds at most that
      requests at once                   many bodies, so its memory is bounded (by default
                                         from the row budget: serve.queue_rows / 16)
    rows past serve.queue_rows held      503 with Retry-After, once the body is checked: the
      at once                            rows waiting or being scored stay within it (413 for
                                         a request past it alone)
    a value of the wrong type, a bad id  400 naming the row and the field (scoring/request.py:
                                         no coercion; ingest's checks)
    a request past serve.timeout_s       504; its scoring stops at the next batch
    anything unexpected                  500 "the server log has the details" (traceback
                                         logged, never sent)
    a score that is not a number         500 naming the model, never a 200 with NaN

Served by alias (`models:/recd-dlrm@champion`) with `serve.follow_alias_s`, the server checks
the alias that often; when it names another version (a promotion), that version is loaded,
its readiness request scored, and it replaces the served model between requests (a request
in flight finishes on the model it started with; memory holds both models meanwhile). A
failed load keeps the old model serving and says why in the log.

A trained model's shard files are verified and copied for the server as it loads them
(modeling/shard_files.py): a file changed, truncated or deleted afterwards changes nothing
it serves.

Every non-200 body is one JSON line, `{"error_code": ..., "message": ...}` (MLflow's keys),
with no stack trace and no echo of the request. Requests are checked on two worker threads,
off the event loop (which keeps reading and refusing); one loop scores them on a thread of
its own (serving/batching.py): ranking requests that arrive together in one model call of up
to serve.batch_rows rows, on serve.threads torch threads (by default the CPU budget less the
two checking threads', at least one: torch's OpenMP threads wait passively in recd, so a
second thread on two cores costs each small op a wake-up and gains the large ones little).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import orjson
import torch
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.logging import DefaultFormatter

from recd_core.config import ServeConfig
from recd_core.errors import BadInput, TrackingError, first_line
from recd_core.lineage import code_version
from recd_core.modeling.saved import load_model
from recd_core.scoring.ranking import probe_request
from recd_core.scoring.request import RequestError, request_columns
from recd_core.scoring.scorer import Checked, NonFinite, Scorer
from recd_core.serving import v2
from recd_core.serving.batching import Batcher

log = logging.getLogger("recd.serving")

ERROR_CODES = {
    400: "BAD_REQUEST",
    413: "REQUEST_TOO_LARGE",
    415: "UNSUPPORTED_MEDIA_TYPE",
    500: "INTERNAL_ERROR",
    503: "TEMPORARILY_UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
JSON = "application/json"
ALIASED = re.compile(r"^models:/(?P<name>[^/@]+)@(?P<alias>[\w-]+)$")
PINNED = re.compile(r"^models:/(?P<name>[^/@]+)/(?P<version>\d+)$")


@dataclass(frozen=True)
class Served:
    """The scorer being served and what names it: the URI it was loaded from, and the
    registry version for a registered model."""

    scorer: Scorer
    uri: str
    version: str | None = None


def alias_version(uri: str) -> str | None:
    """The version a `models:/NAME@ALIAS` URI names now (through the tracking URI already
    set); None for any other URI."""
    found = ALIASED.match(uri)
    if found is None:
        return None
    from mlflow.tracking import MlflowClient

    return str(MlflowClient().get_model_version_by_alias(found["name"], found["alias"]).version)


def load_served(uri: str) -> Served:
    """A registered model (`models:/name@alias`, `models:/name/3`, `runs:/…`: MLflow's pyfunc,
    through the tracking URI already set) or a trained model (a directory, or
    `<warehouse>/models/<run>`). An alias is resolved first and its version loaded, so the
    server knows which version it holds."""
    if uri.startswith(("models:/", "runs:/", "mlflow-artifacts:")):
        import mlflow.pyfunc
        from mlflow.exceptions import MlflowException

        try:
            aliased, pinned = ALIASED.match(uri), PINNED.match(uri)
            version = alias_version(uri) if aliased else pinned["version"] if pinned else None
            source = f"models:/{aliased['name']}/{version}" if aliased else uri
            pyfunc = mlflow.pyfunc.load_model(source).unwrap_python_model()
        except MlflowException as e:
            if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise BadInput(f"no model to serve at {uri}: {first_line(e, 200)}") from None
            raise TrackingError(f"cannot load {uri}: {first_line(e, 200)}") from None
        return Served(pyfunc.scorer, uri, version)
    # its tables its own: the files may change under a running server
    return Served(Scorer(*load_model(uri, private=True)), uri)


def error_body(status: int, message: str) -> bytes:
    """One JSON line: MLflow's error keys, the message on one line, nothing echoed."""
    text = " ".join(str(message).split())[:400]
    return json.dumps({"error_code": ERROR_CODES.get(status, "ERROR"), "message": text}).encode()


async def read_body(request, cap: int) -> bytes:
    """The body, refused (413) past `cap` bytes: by its Content-Length before a byte is
    read, or as it streams in (chunked, or a length that lies)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise RequestError(f"Content-Length {declared[:20]!r} is not a number")
        if int(declared) > cap:
            raise RequestError(_too_large(int(declared), cap), 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise RequestError(_too_large(size, cap, "at least "), 413)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, cap: int, at_least: str = "") -> str:
    return (
        f"request body of {at_least}{size:,} bytes, more than the server's limit of "
        f"{cap:,} (serve.max_bytes): split the request"
    )


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # an escaped surrogate, \\ud800 to \\udfff


def parse_json(body: bytes) -> object:
    """The body's JSON: orjson where it parses (3x faster; an integer past 64 bits reads as
    a float, refused where an id is due as out of range); else the standard library's,
    whose answers (NaN, a lone surrogate, the error's line and column) are the server's."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        pass  # said by the standard parser, below
    try:
        parsed = json.loads(body)
        # JSON may escape a lone UTF-16 surrogate, which is no Unicode text: refused here
        # (looked for only where the body has such an escape at all; a pair is fine)
        if SURROGATE_ESCAPE.search(body) and _lone_surrogate(parsed):
            raise RequestError(
                "invalid JSON: a string holds a lone UTF-16 surrogate "
                "(\\ud800-\\udfff), not Unicode text"
            )
        return parsed
    except json.JSONDecodeError as e:
        raise RequestError(f"invalid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except UnicodeDecodeError:
        raise RequestError("invalid JSON: the body is not UTF-8") from None
    except RecursionError:
        raise RequestError("invalid JSON: nested too deeply") from None
    except ValueError:  # an integer of more digits than Python converts
        raise RequestError("invalid JSON: an integer of thousands of digits") from None


def _lone_surrogate(obj) -> bool:
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class Server:
    """The service's handlers over the model being served (`served`, swapped whole when the
    alias moves: a request keeps the one it started with) under the limits of `cfg`."""

    def __init__(self, first: Served, cfg: ServeConfig):
        self.served = first
        self.cfg = cfg
        self.in_flight = 0  # requests held (being read, checked, waiting or scored)
        self.rows_held = 0  # their rows, once checked
        self.batcher = Batcher(cfg.batch_rows, cfg.batch_wait_ms / 1e3, cfg.dedup)
        # two threads read and check bodies: more would only contend with the scoring
        # thread for the interpreter under a burst (the rest wait their turn, bounded)
        self.checkers = ThreadPoolExecutor(2, thread_name_prefix="recd-check")
        # the name the v2 protocol serves it under: the registered model's, else "recd"
        named = re.match(r"^models:/([^/@]+)", first.uri)
        self.model_name = named[1] if named else "recd"

    def work(self, body: bytes, deadline: float, served: Served | None = None) -> bytes:
        """A body parsed, scored and answered as JSON (runs in a worker thread)."""
        served = served or self.served
        columns, n = request_columns(parse_json(body), self.cfg.max_rows)
        try:
            probs = served.scorer.score(
                columns, n, self.cfg.max_rows, self.cfg.batch_rows, self.cfg.dedup, deadline
            )
        except NonFinite as e:  # never a 200 with NaN: the model is broken
            raise NonFinite(f"the model {served.uri} {e}: the server log has the details") from e
        return orjson.dumps({"predictions": probs.tolist()})

    async def invocations(self, request) -> Response:
        """MLflow's scoring protocol (module doc)."""
        mime = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if mime != "application/json":
            return answer(
                415,
                f"content type {mime or 'none'!r}: recd serve takes application/json "
                "(dataframe_split or dataframe_records)",
            )

        def respond(probs) -> Response:
            return Response(orjson.dumps({"predictions": probs.tolist()}), 200, media_type=JSON)

        return await self._scored(request, request_columns, respond, answer)

    async def infer(self, request) -> Response:
        """KServe's Open Inference Protocol (serving/v2.py)."""
        served, name = self.served, request.path_params["name"]
        if name != self.model_name:
            return v2_error(404, f"no model {name!r} here: this server serves {self.model_name!r}")
        ids: list = []

        def columns(body, max_rows):
            ids.append(body.get("id") if isinstance(body, dict) else None)
            return v2.columns_of(body, max_rows)

        def respond(probs) -> Response:
            out = v2.answer_of(name, served.version, ids[0], probs.tolist())
            return Response(out, 200, media_type=JSON)

        return await self._scored(request, columns, respond, v2_error)

    async def _scored(self, request, columns_of, respond, refuse) -> Response:
        """A request of either protocol read, checked, queued and scored under the server's
        limits: `columns_of(body, max_rows)` its columns, `respond(probs)` the answer,
        `refuse(status, message, headers)` a refusal in the protocol's form."""
        cfg = self.cfg
        if self.in_flight >= cfg.requests_held:
            return refuse(
                503,
                f"{self.in_flight} requests in flight, the server's limit "
                "(serve.max_in_flight): retry shortly",
                {"Retry-After": "1"},
            )
        self.in_flight += 1
        deadline = time.monotonic() + cfg.timeout_s
        held, served = 0, self.served  # a request keeps the model it started with

        def checked(body: bytes) -> Checked:  # a worker thread's
            columns, n = columns_of(parse_json(body), cfg.max_rows)
            return served.scorer.checked(columns, n, cfg.max_rows)

        try:
            body = await asyncio.wait_for(read_body(request, cfg.max_bytes), cfg.timeout_s)
            left = max(deadline - time.monotonic(), 0.001)
            checking = asyncio.get_running_loop().run_in_executor(self.checkers, checked, body)
            job = await asyncio.wait_for(checking, left)
            del body
            if job.rows > cfg.rows_held:  # never, however idle the server
                return refuse(
                    413,
                    f"{job.rows:,} rows in one request, more than the server holds at once "
                    f"({cfg.rows_held:,}, serve.queue_rows): split the request",
                )
            if self.rows_held + job.rows > cfg.rows_held:
                return refuse(
                    503,
                    f"{self.rows_held:,} rows held, {job.rows:,} more would pass the "
                    "server's limit (serve.queue_rows): retry shortly",
                    {"Retry-After": "1"},
                )
            held = job.rows
            self.rows_held += held
            left = max(deadline - time.monotonic(), 0.001)
            probs = await asyncio.wait_for(self.batcher.score(job, served, deadline), left)
            return respond(probs)
        except RequestError as e:
            return refuse(e.status, str(e))
        except TimeoutError:
            return refuse(
                504, f"the request took longer than {cfg.timeout_s:g} s (serve.timeout_s)"
            )
        except NonFinite as e:  # never a 200 with NaN: the model is broken
            message = f"the model {served.uri} {e}: the server log has the details"
            log.error("%s", message)
            return refuse(500, message)
        except Exception as e:  # noqa: BLE001 - the traceback to the log, never to the client
            log.exception("scoring failed")
            return refuse(
                500, f"scoring failed ({type(e).__name__}); the server log has the details"
            )
        finally:
            self.in_flight -= 1
            self.rows_held -= held

    async def ping(self, request) -> Response:
        return Response("\n", 200, media_type="application/json")

    async def v2_server(self, request) -> Response:
        about = {"name": "recd", "version": code_version(), "extensions": []}
        return Response(orjson.dumps(about), 200, media_type=JSON)

    async def v2_live(self, request) -> Response:
        return Response(orjson.dumps({"live": True}), 200, media_type=JSON)

    async def v2_ready(self, request) -> Response:
        """Ready once the readiness request scores (`/ready`), in the protocol's words."""
        name = request.path_params.get("name")
        if name is not None and name != self.model_name:
            return v2_error(404, f"no model {name!r} here: this server serves {self.model_name!r}")
        ok = (await self.ready(request)).status_code == 200
        out = {"ready": ok} if name is None else {"name": name, "ready": ok}
        return Response(orjson.dumps(out), 200 if ok else 503, media_type=JSON)

    async def v2_model(self, request) -> Response:
        name, served = request.path_params["name"], self.served
        if name != self.model_name:
            return v2_error(404, f"no model {name!r} here: this server serves {self.model_name!r}")
        scorer = served.scorer
        about = v2.metadata(name, served.version, scorer.schema, scorer.features)
        return Response(orjson.dumps(about), 200, media_type=JSON)

    def probed(self, served: Served) -> bytes:
        """The model's readiness request scored through `work` (ValueError if the score is
        not a probability)."""
        out = self.work(served.scorer.probe, time.monotonic() + self.cfg.timeout_s, served)
        scores = json.loads(out)["predictions"]
        if len(scores) != 1 or not 0.0 <= scores[0] <= 1.0:
            raise ValueError(f"the readiness request scored {scores[:2]}, not a probability")
        return out

    async def ready(self, request) -> Response:
        try:
            probe = asyncio.to_thread(self.probed, self.served)
            out = await asyncio.wait_for(probe, self.cfg.timeout_s)
            return Response(out, 200, media_type="application/json")
        except Exception as e:  # noqa: BLE001 - not ready, said in one line; the log has more
            log.exception("the readiness request failed")
            return answer(503, f"not ready: the readiness request failed ({type(e).__name__})")

    async def stats(self, request) -> Response:
        """What the server holds now and how it has batched (`/stats`)."""
        about = {
            "in_flight": self.in_flight,
            "rows_held": self.rows_held,
            "model_calls": self.batcher.calls,
            "requests_batched": self.batcher.batched,
            "scoring_threads": torch.get_num_threads(),
        }
        return Response(orjson.dumps(about), 200, media_type="application/json")

    async def version(self, request) -> Response:

        served = self.served
        about = {"recd": code_version(), "model": served.uri, "version": served.version}
        return Response(json.dumps(about), 200, media_type="application/json")

    async def follow_alias(self) -> None:
        """Every `follow_alias_s`: where the alias now names another version, load it, score
        its readiness request, and swap it in; the old model serves until then, and keeps
        serving if any step fails (logged)."""
        while True:
            await asyncio.sleep(self.cfg.follow_alias_s)
            held = self.served
            try:
                moved = await asyncio.to_thread(alias_version, held.uri)
                if moved == held.version:
                    continue
                log.info("%s moved to version %s: loading it", held.uri, moved)
                new = await asyncio.to_thread(load_served, held.uri)
                await asyncio.to_thread(self.probed, new)
                self.served = new
                gc.freeze()  # the new model's objects, as at the start
                log.info("now serving %s version %s", new.uri, new.version)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the served model stays; said in the log
                why = str(e).splitlines()[0][:300] if str(e) else ""
                log.warning(
                    "following %s failed, version %s serves on: %s: %s",
                    held.uri,
                    held.version,
                    type(e).__name__,
                    why,
                )

    def warm_up(self) -> None:
        """The readiness request scored, and its one sample as a row: what a first request
        of each format imports and builds is then loaded before the first client's."""
        scorer = self.served.scorer
        row = json.dumps(probe_request(scorer.schema, scorer.features, as_row=True)).encode()
        for body in (scorer.probe, row):
            self.work(body, time.monotonic() + self.cfg.timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        try:
            await asyncio.to_thread(self.warm_up)
        except Exception:  # noqa: BLE001 - /ready says so; the log has the details
            log.exception("warming up failed")
        # what is loaded by now (the model, the libraries, the server) lives as long as the
        # process: kept out of the collector's full passes, which walked it all (~150 ms,
        # the p99 of a request) every so often
        gc.freeze()
        follow = None
        if self.cfg.follow_alias_s > 0 and ALIASED.match(self.served.uri):
            follow = asyncio.create_task(self.follow_alias())
        elif self.cfg.follow_alias_s > 0:
            log.warning(
                "serve.follow_alias_s: %s names no alias (models:/NAME@ALIAS); it is served "
                "as loaded",
                self.served.uri,
            )
        try:
            yield
        finally:
            if follow is not None:
                follow.cancel()
            if self.batcher.task is not None:
                self.batcher.task.cancel()


def answer(status: int, message: str, headers: dict | None = None) -> Response:
    """A non-200 answer: one JSON line (`error_body`)."""
    return Response(error_body(status, message), status, headers, media_type="application/json")


def v2_error(status: int, message: str, headers: dict | None = None) -> Response:
    """A non-200 answer of the v2 protocol: `{"error": message}`, one line."""
    text = " ".join(str(message).split())[:400]
    return Response(orjson.dumps({"error": text}), status, headers, media_type=JSON)


def build_app(first: Served, cfg: ServeConfig) -> Starlette:
    """The ASGI app (Starlette) serving `first` under the limits of `cfg`; with
    `cfg.follow_alias_s`, the model its alias names from then on (`Server.follow_alias`)."""
    server = Server(first, cfg)
    routes = [
        Route("/invocations", server.invocations, methods=["POST"]),
        Route("/ping", server.ping),
        Route("/health", server.ping),
        Route("/ready", server.ready),
        Route("/version", server.version),
        Route("/stats", server.stats),
        Route("/v2", server.v2_server),
        Route("/v2/health/live", server.v2_live),
        Route("/v2/health/ready", server.v2_ready),
        Route("/v2/models/{name}", server.v2_model),
        Route("/v2/models/{name}/ready", server.v2_ready),
        Route("/v2/models/{name}/infer", server.infer, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=server.lifespan)


def log_to_stderr() -> None:
    """The server's own lines (a model swapped in, a failed scoring's traceback) on stderr
    beside uvicorn's, in its format."""

    handler = logging.StreamHandler()
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s", use_colors=False))
    log = logging.getLogger("recd.serving")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
