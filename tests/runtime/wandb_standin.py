"""A local stand-in for a W&B server: what ``WANDB_BASE_URL=http://127.0.0.1:PORT`` talks to.

wandb 0.31 documents no test mode that exercises its online path without a server (its own
system tests run the ``wandb/local`` container; ``mode="disabled"`` sends nothing), so this
answers the calls the SDK's core (``wandb-core``) makes for a run, as the real server's schema
shapes them, and records them:

* ``POST /graphql``: ``UpsertBucket`` (create or update a run: name, tags, group, config),
  ``RunResumeStatus`` (does this run id exist: how many history lines it has), ``CreateRunFiles``
  (upload URLs for the run's files, pointing back here); any other query gets ``{"data": {}}``.
* ``POST /files/ENTITY/PROJECT/RUN/file_stream``: the run's history rows (``wandb-history.jsonl``),
  summary, events, console.
* ``PUT /upload/ENTITY/PROJECT/RUN/NAME``: the content of a run file.

Every request's method, path and ``Authorization`` header is kept, so a test sees what was sent
with which key, and that nothing was sent.
"""

from __future__ import annotations

import base64
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote


@dataclass
class StandinRun:
    entity: str
    project: str
    name: str
    display_name: str = ""
    group: str = ""
    tags: list = field(default_factory=list)
    config: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    """Parsed rows of ``wandb-history.jsonl``, in the order they arrived."""
    files: dict = field(default_factory=dict)
    """Name -> bytes of each uploaded run file."""
    upserts: int = 0


class WandbStandin:
    """``with WandbStandin() as server:`` ... ``server.url``, ``server.runs``, ``server.requests``."""

    def __init__(self):
        self.runs: dict[tuple[str, str, str], StandinRun] = {}
        self.requests: list[tuple[str, str, str]] = []
        """(method, path, the API key of its ``Authorization: Basic api:KEY``, or "")."""
        self.operations: list[str] = []
        self._lock = threading.Lock()
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _key(self) -> str:
                auth = self.headers.get("Authorization") or ""
                if auth.startswith("Basic "):
                    user, _, key = base64.b64decode(auth[6:]).decode().partition(":")
                    return key
                return ""

            def _reply(self, data: dict | None, status: int = 200):
                body = json.dumps(data).encode() if data is not None else b""
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                body = self._body()
                with standin._lock:
                    standin.requests.append(("POST", self.path, self._key()))
                    if self.path.startswith("/graphql"):
                        self._reply(standin._graphql(json.loads(body), f"http://{self.headers['Host']}"))
                    elif self.path.endswith("/file_stream"):
                        standin._file_stream(self.path, json.loads(body))
                        self._reply({"exitcode": None, "limits": {}})
                    else:  # telemetry and anything else: accepted, unread
                        self._reply({})

            def do_PUT(self):
                body = self._body()
                with standin._lock:
                    standin.requests.append(("PUT", self.path, self._key()))
                    parts = [unquote(p) for p in self.path.split("?")[0].split("/")]
                    if len(parts) >= 6 and parts[1] == "upload":
                        run = standin._run(parts[2], parts[3], parts[4])
                        run.files["/".join(parts[5:])] = body
                self._reply(None)

            def do_GET(self):
                with standin._lock:
                    standin.requests.append(("GET", self.path, self._key()))
                self._reply({})

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "WandbStandin":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ---- what the SDK asks --------------------------------------------------------------------

    def _run(self, entity: str, project: str, name: str) -> StandinRun:
        key = (entity, project, name)
        if key not in self.runs:
            self.runs[key] = StandinRun(entity, project, name)
        return self.runs[key]

    def _graphql(self, request: dict, base: str) -> dict:
        op = request.get("operationName") or ""
        v = request.get("variables") or {}
        self.operations.append(op)
        if op == "UpsertBucket":
            run = self._run(v.get("entity") or "flowrl-team", v.get("project") or "uncategorized", v["name"])
            run.upserts += 1
            if v.get("displayName"):
                run.display_name = v["displayName"]
            if v.get("groupName"):
                run.group = v["groupName"]
            if v.get("tags") is not None:
                run.tags = list(v["tags"])
            if v.get("config"):
                run.config.update(json.loads(v["config"]))
            return {"data": {"upsertBucket": {"inserted": run.upserts == 1, "bucket": {
                "id": f"id-{run.name}", "name": run.name, "displayName": run.display_name or run.name,
                "description": "", "config": json.dumps(run.config), "sweepName": None,
                "historyLineCount": len(run.history),
                "project": {"id": f"id-{run.project}", "name": run.project,
                            "entity": {"id": f"id-{run.entity}", "name": run.entity}}}}}}
        if op == "RunResumeStatus":
            entity, project = v.get("entity") or "flowrl-team", v.get("project") or "uncategorized"
            run = self.runs.get((entity, project, v["name"]))
            bucket = None if run is None else {
                "id": f"id-{run.name}", "name": run.name, "displayName": run.display_name,
                "summaryMetrics": json.dumps(run.history[-1] if run.history else {}),
                "logLineCount": 0, "historyLineCount": len(run.history), "eventsLineCount": 0,
                "historyTail": json.dumps([json.dumps(r) for r in run.history[-1:]]), "eventsTail": "[]",
                "config": json.dumps(run.config), "tags": run.tags, "notes": None,
                "wandbConfig": json.dumps({})}
            return {"data": {"model": {"id": f"id-{project}", "name": project,
                                       "entity": {"id": f"id-{entity}", "name": entity}, "bucket": bucket}}}
        if op == "CreateRunFiles":
            run = self._run(v["entity"], v["project"], v["run"])
            return {"data": {"createRunFiles": {"runID": f"id-{run.name}", "uploadHeaders": [], "files": [
                {"name": f, "uploadUrl": f"{base}/upload/{run.entity}/{run.project}/{run.name}/{f}"}
                for f in v["files"]]}}}
        return {"data": {}}

    def _file_stream(self, path: str, body: dict) -> None:
        _, _files, entity, project, name, _ = [unquote(p) for p in path.split("?")[0].split("/")]
        run = self._run(entity, project, name)
        for fname, chunk in (body.get("files") or {}).items():
            if fname == "wandb-history.jsonl":
                run.history.extend(json.loads(line) for line in chunk.get("content", []))
