"""Experiment trackers: every metric of a run, and tables of sample completions, sent to the
libraries users watch runs in (``flowrl run --log tensorboard,wandb,mlflow``).

One small adapter per tracker behind the :class:`Tracker` protocol, named by the catalogue
(:data:`flowrl.catalog.loggers.LOGGERS`: each record's ``adapter``), and :class:`Trackers`,
which fans a run's records out to all of them and to ``samples.jsonl``:

* :class:`TensorBoardLogger`: event files under ``RUN_DIR/tensorboard`` (scalars; samples as a
  Markdown table in the text tab).
* :class:`WandbLogger`: Weights & Biases, **online** when the user's environment says so
  (``WANDB_MODE=online``, or credentials for the server: ``WANDB_API_KEY``, ``wandb login``'s
  netrc entry, ``WANDB_IDENTITY_TOKEN_FILE``; ``WANDB_BASE_URL`` names a self-hosted server), else
  **offline** (no network; ``wandb sync`` uploads it later); files under ``RUN_DIR/wandb`` either
  way; samples as a ``wandb.Table``.
* :class:`MlflowLogger`: MLflow at a tracking URI (the run setting ``log_uri``, else
  ``MLFLOW_TRACKING_URI``: an ``http://`` server, a database), else its local file store under
  ``RUN_DIR/mlruns``; samples appended to the table artifact ``samples.json``.

Every tracker is told the same :class:`TrackedRun` (:func:`tracked_run`): its name, project,
entity, group and tags (the ``log_*`` run settings), its configuration (the flow's parameters)
and files (the flow's source and ``plan.json``, logged as run files / artifacts). A resumed run
continues the same tracker run: the W&B run id and the MLflow run id are kept in the run
directory (``wandb/flowrl_run_id``, ``mlruns/flowrl_run.json``). Credentials are read in this
process (the driver), which keeps the user's environment; they are never written to the run
directory, and no Ray process needs them (W&B's service receives the key with the run's
settings over its socket, not in its environment: :mod:`flowrl.runtime.environment`).

Steps are the run's step numbers (1 = the first RL step, 0 = before RL). Each library is
imported only when its tracker is built, so a run without ``--log`` pays for none of them.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from flowrl.catalog.loggers import LOGGERS
from flowrl.catalog.ops import OpKind
from flowrl.runtime.observe import atomic_write_text
from flowrl.runtime.rundir import own, tmp_sibling

SAMPLE_COLUMNS = ("step", "prompt", "completion", "reward")
"""The columns of a samples table, in order."""


@dataclass(frozen=True)
class TrackedRun:
    """What every tracker is told about the run it records (:func:`tracked_run` builds it from a plan)."""

    default_name: str
    """The run name when none is given: the run directory's name."""
    name: str = ""
    """The name the user gave (run setting ``log_name``); empty: ``default_name`` (W&B: ``$WANDB_NAME`` first)."""
    project: str = ""
    """W&B project and MLflow experiment (``log_project``); empty: the tracker's variable, else ``flowrl``."""
    entity: str = ""
    """W&B entity (``log_entity``); empty: ``$WANDB_ENTITY``, else the account's default."""
    group: str = ""
    """W&B group, MLflow tag ``group`` (``log_group``)."""
    tags: tuple[str, ...] = ()
    uri: str = ""
    """MLflow tracking URI (``log_uri``); empty: ``$MLFLOW_TRACKING_URI``, else ``RUN_DIR/mlruns``."""
    config: dict = field(default_factory=dict)
    """The run's configuration: the flow's parameters, and flowrl's own under ``flowrl``."""
    files: tuple[tuple[str, str], ...] = ()
    """``(path in the tracker's run, text)``: the flow's source and ``plan.json`` (none when resumed: the
    tracker's run has them from the run's first process)."""
    resumed: bool = False
    """A run continued from its checkpoint (``--resume``): the trackers continue their runs."""


SOURCE_LIMIT = 1 << 20
"""The largest flow source sent to a tracker (bytes); a larger one is left out (plan.json still goes)."""


def tracked_run(plan, out: Path, *, resume: bool = False) -> TrackedRun:
    """The :class:`TrackedRun` of ``plan`` run into ``out``: its ``log_*`` run settings, the flow's parameters
    as the configuration, and (unless ``resume``) the flow's source and ``plan.json`` as files."""
    run = plan.run
    config = {**plan.params, "flowrl": {"flow": plan.flow, "source": plan.source, "staleness": plan.staleness,
                                        "run": asdict(run), "cluster": dict(plan.cluster)}}
    files: list[tuple[str, str]] = []
    if not resume:
        source = Path(plan.source)
        # only a compiled .flow file (never another path a hand-written plan might name), and not a huge one
        if source.suffix == ".flow" and source.is_file() and source.stat().st_size <= SOURCE_LIMIT:
            files.append((f"flowrl/{source.name}", source.read_text(encoding="utf-8", errors="replace")))
        files.append(("flowrl/plan.json", plan.to_json()))
    return TrackedRun(default_name=out.name, name=run.log_name, project=run.log_project, entity=run.log_entity,
                      group=run.log_group, tags=tuple(run.log_tags), uri=run.log_uri, config=config,
                      files=tuple(files), resumed=resume)


class Tracker(Protocol):
    """What a run hands each tracker."""

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Every finite scalar of one step (keys like ``reward/mean``)."""

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """A table of completions (:data:`SAMPLE_COLUMNS`) of one step."""

    def close(self) -> None:
        """Flush and finish (idempotent)."""


def _scalars(metrics: dict) -> dict[str, float]:
    """The finite real values of ``metrics`` as floats (NaN/inf and non-numbers left out)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def markdown_table(rows: list[dict]) -> str:
    """Rows as a Markdown table (what TensorBoard's text tab renders); ``|`` and newlines escaped."""

    def cell(v: Any) -> str:
        text = f"{v:.4g}" if isinstance(v, float) else str(v)
        return text.replace("|", "\\|").replace("\n", "⏎")

    head = "| " + " | ".join(SAMPLE_COLUMNS) + " |\n|" + "---|" * len(SAMPLE_COLUMNS) + "\n"
    return head + "".join("| " + " | ".join(cell(r[c]) for c in SAMPLE_COLUMNS) + " |\n" for r in rows)


class TensorBoardLogger:
    """TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``) in ``RUN_DIR/tensorboard``."""

    def __init__(self, out: Path, run: TrackedRun):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out / LOGGERS["tensorboard"].folder))
        self.writer.add_text("config", "```\n" + json.dumps(run.config, indent=1, sort_keys=True) + "\n```", 0)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in _scalars(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_samples(self, step: int, rows: list[dict]) -> None:
        self.writer.add_text("samples", markdown_table(rows), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


WANDB_SERVER = "https://api.wandb.ai"
"""W&B's own server (``WANDB_BASE_URL`` names another, e.g. a self-hosted one)."""

WANDB_MODES = {"online": "online", "run": "online", "offline": "offline", "dryrun": "offline", "disabled": "disabled"}
"""``WANDB_MODE`` values (W&B's own, with its older spellings) -> the mode a run uses."""


@dataclass(frozen=True)
class WandbAccess:
    """How this run reaches W&B: the mode, the server, and the credential found (never printed or written)."""

    mode: str
    """``online``, ``offline`` or ``disabled``."""
    base_url: str
    api_key: str | None = field(default=None, repr=False)
    identity_token_file: str | None = None
    found_in: str = ""
    """Where the credential came from (``WANDB_API_KEY``, ``~/.netrc``...), for messages."""


def wandb_access(environ=None) -> WandbAccess:
    """W&B online when the user's environment says so, offline otherwise:

    * ``WANDB_MODE=offline`` (or ``dryrun``): offline; ``disabled``: nothing is logged;
    * ``WANDB_MODE=online``: online, and a credential must be found (else a clear error);
    * ``WANDB_MODE`` unset: online when a credential for the server is found, else offline.

    A credential is ``WANDB_API_KEY``, ``WANDB_IDENTITY_TOKEN_FILE``, or the netrc entry that
    ``wandb login`` writes for the server's host; the server is ``WANDB_BASE_URL`` (default W&B's).

    >>> wandb_access({"WANDB_MODE": "offline", "WANDB_API_KEY": "k" * 40}).mode
    'offline'
    >>> wandb_access({"WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": "http://127.0.0.1:8080/"})
    WandbAccess(mode='online', base_url='http://127.0.0.1:8080', identity_token_file=None, found_in='WANDB_API_KEY')
    """
    env = os.environ if environ is None else environ
    base_url = (env.get("WANDB_BASE_URL") or WANDB_SERVER).strip().rstrip("/")
    said = env.get("WANDB_MODE", "").strip().lower()
    if said and said not in WANDB_MODES:
        raise _error(f"WANDB_MODE={said} is not a W&B mode flowrl knows ({', '.join(WANDB_MODES)}); hint: "
                     "WANDB_MODE=offline logs without the network, online logs to the server")
    mode = WANDB_MODES.get(said)
    if mode in ("offline", "disabled"):
        return WandbAccess(mode, base_url)
    key, token_file, found_in = None, None, ""
    if env.get("WANDB_API_KEY"):
        key, found_in = env["WANDB_API_KEY"].strip(), "WANDB_API_KEY"
    elif env.get("WANDB_IDENTITY_TOKEN_FILE"):
        token_file, found_in = env["WANDB_IDENTITY_TOKEN_FILE"], "WANDB_IDENTITY_TOKEN_FILE"
    else:
        key = _netrc_key(base_url, env)
        found_in = "netrc (`wandb login`)" if key else ""
    if not found_in:
        if mode == "online":
            raise _error(f"WANDB_MODE=online, but there is no W&B credential for {base_url}; hint: set WANDB_API_KEY "
                         "or run `wandb login` (for a self-hosted server, `wandb login --host URL` and WANDB_BASE_URL), "
                         "or unset WANDB_MODE to log offline (`wandb sync` uploads it later)")
        return WandbAccess("offline", base_url)
    return WandbAccess("online", base_url, key, token_file, found_in)


def _netrc_key(base_url: str, env) -> str | None:
    """The API key ``wandb login`` keeps for ``base_url``'s host in the netrc file (``$NETRC``, else
    ``~/.netrc``), or None. Read with the standard library's parser (text, never code)."""
    import netrc

    host = urlsplit(base_url).hostname or ""
    path = Path(env.get("NETRC") or Path(env.get("HOME") or Path.home()) / ".netrc")
    try:
        entry = netrc.netrc(str(path)).authenticators(host) if path.is_file() else None
    except (OSError, netrc.NetrcParseError):
        return None
    return entry[2] if entry and entry[2] else None


class WandbLogger:
    """Weights & Biases: online or offline as :func:`wandb_access` finds; the run's files in ``RUN_DIR/wandb``."""

    def __init__(self, out: Path, run: TrackedRun):
        import wandb

        access = wandb_access()
        self._wandb = wandb
        folder = out / LOGGERS["wandb"].folder
        folder.mkdir(parents=True, exist_ok=True)
        # One W&B run id per run directory: a resumed run continues the W&B run of that id (online: the same
        # run on the server; offline: a second offline run with the same id, which `wandb sync` joins).
        id_file = folder / "flowrl_run_id"
        if not id_file.is_file():
            id_file.write_text(uuid.uuid4().hex[:8])  # W&B ids: lowercase letters and digits
        settings = {"console": "off", "silent": True, "base_url": access.base_url}
        if access.api_key:  # given to wandb here, not through the environment of its service process
            settings["api_key"] = access.api_key
        if access.identity_token_file:
            settings["identity_token_file"] = access.identity_token_file
        from flowrl.runtime.environment import environ_for

        try:
            with environ_for("tracker"):  # W&B's service process starts here: the scrubbed environment, no key
                self.run = wandb.init(
                    mode=access.mode, dir=str(out), id=_run_id(id_file), reinit="create_new",
                    project=run.project or os.environ.get("WANDB_PROJECT") or "flowrl",
                    entity=run.entity or os.environ.get("WANDB_ENTITY") or None,
                    name=run.name or os.environ.get("WANDB_NAME") or run.default_name,
                    group=run.group or os.environ.get("WANDB_RUN_GROUP") or None,
                    tags=list(run.tags) or None, config=run.config,
                    resume="allow" if access.mode == "online" else None, settings=wandb.Settings(**settings))
        except Exception as e:  # noqa: BLE001 - W&B's errors (server unreachable, refused key), one line
            if access.mode != "online":
                raise
            raise _error(f"W&B could not start its run on {access.base_url} (credential from {access.found_in}): "
                         f"{_first_line(e)}; hint: check WANDB_BASE_URL and the key (`wandb login --verify`), "
                         "or set WANDB_MODE=offline to log offline and `wandb sync` later") from None
        self.mode = access.mode
        self._closed = False
        self._save_files(run.files)

    def _save_files(self, files: tuple[tuple[str, str], ...]) -> None:
        """The flow's source and plan.json as files of the W&B run (its Files tab; uploaded now when online,
        by ``wandb sync`` when offline): written into the run's own files folder, then saved from there."""
        if self.mode == "disabled" or not files:
            return
        root = Path(self.run.dir)
        for name, text in files:
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            self.run.save(str(path), base_path=str(root), policy="now")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(_scalars(metrics), step=step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        table = self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=[[r[c] for c in SAMPLE_COLUMNS] for r in rows])
        self.run.log({"samples": table}, step=step)  # same step as its metrics: one history row

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.run.finish()


def _run_id(file: Path) -> str:
    """The W&B run id this run directory keeps (:class:`WandbLogger`): lowercase letters and digits, or a
    clear error naming the file (it was damaged or replaced)."""
    text = file.read_bytes()[:200].decode("ascii", errors="replace").strip()
    if not re.fullmatch(r"[a-z0-9]{1,64}", text):
        raise _error(f"{file} is not a W&B run id this flowrl wrote (lowercase letters and digits); hint: it was damaged "
                     "or replaced: delete it (the resumed run then logs to a new W&B run), or start a new run")
    return text


def _error(message: str):
    from flowrl.runtime.errors import RuntimeFlowError

    return RuntimeFlowError(message)


def _first_line(e: BaseException, limit: int = 300) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:limit]}" if text else type(e).__name__


def shown_uri(uri: str) -> str:
    """``uri`` without its user and password (what a run writes and says).

    >>> shown_uri("https://me:hunter2@mlflow.example.com:443/x"), shown_uri("/tmp/mlruns")
    ('https://mlflow.example.com:443/x', '/tmp/mlruns')
    """
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "(a URI that does not parse)"
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


class MlflowLogger:
    """MLflow: a tracking server or database (``log_uri``, else ``MLFLOW_TRACKING_URI``), else the local file
    store in ``RUN_DIR/mlruns``; experiment ``log_project`` (else ``MLFLOW_EXPERIMENT_NAME``, else ``flowrl``),
    one MLflow run per flowrl run, its id kept in ``RUN_DIR/mlruns/flowrl_run.json`` for a resumed run."""

    RECORD = "flowrl_run.json"
    OWN_STORE = "mlruns"
    """The record's ``tracking_uri`` for the run directory's own store: relative, so a run directory moved
    or copied elsewhere resumes into its own store."""

    def __init__(self, out: Path, run: TrackedRun):
        folder = out / LOGGERS["mlflow"].folder
        own_store = folder.resolve().as_uri()
        uri = run.uri or os.environ.get("MLFLOW_TRACKING_URI", "").strip() or own_store
        if urlsplit(uri).scheme in ("", "file"):
            # The file store is in maintenance mode in MLflow 3 and refuses to open unless asked: it is the
            # store that needs no database or server, which is what a run directory wants.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._Metric = Metric
        self.uri = shown_uri(uri)
        recorded = self.OWN_STORE if uri == own_store else self.uri
        folder.mkdir(parents=True, exist_ok=True)
        record_file = folder / self.RECORD
        experiment_name = run.project or os.environ.get("MLFLOW_EXPERIMENT_NAME", "").strip() or "flowrl"
        try:  # a file store's files are read with MLflow's safe YAML loader: a replaced one is an error, never code
            self.client = MlflowClient(tracking_uri=uri)
            record = _mlflow_record(record_file)
            if record is not None:  # this run directory's MLflow run: a resumed run continues it
                if record["tracking_uri"] != recorded:
                    def where(u: str) -> str:
                        return f"its own store {folder}" if u == self.OWN_STORE else u

                    how = "without MLFLOW_TRACKING_URI and --log-uri" if record["tracking_uri"] == self.OWN_STORE \
                        else f"with MLFLOW_TRACKING_URI={record['tracking_uri']}"
                    raise _error(f"this run logs to the MLflow run {record['run_id']} at {where(record['tracking_uri'])}, "
                                 f"not {where(recorded)}; hint: resume {how}, or move {record_file} away to start a "
                                 "new MLflow run")
                self.run_id = record["run_id"]
                self.client.update_run(self.run_id, status="RUNNING")
            else:
                experiment = self.client.get_experiment_by_name(experiment_name)
                exp_id = experiment.experiment_id if experiment else self.client.create_experiment(experiment_name)
                earlier = None
                if run.resumed and uri == own_store:  # a run directory from before the record
                    found = self.client.search_runs([exp_id], f"attributes.run_name = '{run.name or run.default_name}'")
                    earlier = found[0].info.run_id if found else None
                if earlier:
                    self.run_id = earlier
                    self.client.update_run(self.run_id, status="RUNNING")
                else:
                    self.run_id = self.client.create_run(exp_id, run_name=run.name or run.default_name,
                                                         tags=_mlflow_tags(run)).info.run_id
                    params = [Param(k, str(v)[:6000]) for k, v in sorted(_flatten(run.config).items())]
                    for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                        self.client.log_batch(self.run_id, params=params[i:i + 100])
                atomic_write_text(record_file, json.dumps({"run_id": self.run_id, "experiment_id": exp_id,
                                                           "tracking_uri": recorded}, indent=1) + "\n")
            for name, text in run.files:  # the flow's source and plan.json as artifacts
                self.client.log_text(self.run_id, text, name)
        except Exception as e:  # noqa: BLE001 - MLflow's own errors, YAML's, the server's, a file that is not text
            from flowrl.runtime.errors import RuntimeFlowError

            if isinstance(e, RuntimeFlowError):
                raise
            store = f"the MLflow store {folder}" if uri == own_store else f"MLflow at {self.uri}"
            message = _first_line(e).replace(uri, self.uri)  # never the URI's password
            if "@" in uri and urlsplit(uri).password:
                message = message.replace(urlsplit(uri).password, "***")
            raise _error(f"{store} cannot be used ({message}); hint: " + (
                "it was damaged or replaced: move it away (the resumed run then starts a new MLflow run), or start a "
                "new run" if store.startswith("the MLflow store") else
                "check that the server runs and the URI (--log-uri, MLFLOW_TRACKING_URI) and credentials "
                "(MLFLOW_TRACKING_USERNAME/PASSWORD, MLFLOW_TRACKING_TOKEN) are right")) from None
        self._closed = False

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        import time

        now = int(time.time() * 1000)
        batch = [self._Metric(mlflow_key(key), value, now, step) for key, value in sorted(_scalars(metrics).items())]
        for i in range(0, len(batch), 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def log_samples(self, step: int, rows: list[dict]) -> None:
        data = {c: [r[c] for r in rows] for c in SAMPLE_COLUMNS}
        self.client.log_table(self.run_id, data=data, artifact_file="samples.json")  # appends to the table

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.client.set_terminated(self.run_id)


def _mlflow_tags(run: TrackedRun) -> dict[str, str]:
    """A run's tags as MLflow's: ``key=value`` a tag with a value, a bare tag with an empty one; the group as
    ``group``; the flow's source file as MLflow's source name."""
    tags = {}
    for tag in run.tags:
        key, _, value = tag.partition("=")
        tags[key.strip()] = value.strip()
    if run.group:
        tags["group"] = run.group
    source = run.config.get("flowrl", {}).get("source")
    if source:
        tags["mlflow.source.name"] = str(source)
    return tags


def _mlflow_record(file: Path) -> dict | None:
    """The MLflow run this run directory logs to (``{"run_id", "experiment_id", "tracking_uri"}``), or None when
    it has none yet; a clear error for a file that is not one flowrl wrote (JSON only: nothing runs)."""
    if not file.exists():
        return None
    try:
        record = json.loads(file.read_bytes()[:10000].decode("utf-8"))
        if not (isinstance(record, dict) and all(isinstance(record.get(k), str) for k in ("run_id", "tracking_uri"))
                and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", record["run_id"])):
            raise ValueError("not a record of an MLflow run")
    except (OSError, ValueError) as e:
        raise _error(f"{file} is not the MLflow run record this flowrl wrote ({_first_line(e)}); hint: it was damaged "
                     "or replaced: delete it (the resumed run then logs to a new MLflow run), or start a new run") from None
    return record


def mlflow_key(key: str) -> str:
    """``key`` as MLflow accepts a metric name (letters, digits, ``_ - . / :`` and spaces): any other
    character, such as the ``#`` of a repeated call's op id (``time/dapo#2.update``), becomes ``_``.

    >>> mlflow_key("time/dapo#2.update"), mlflow_key("reward/mean")
    ('time/dapo_2.update', 'reward/mean')
    """
    return re.sub(r"[^\w\-./: ]", "_", key)


def _flatten(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def build_tracker(name: str, out: Path, run: TrackedRun) -> Tracker:
    """The tracker the catalogue names ``name`` (its ``adapter``) for ``run``; ValueError for an unknown name."""
    spec = LOGGERS.get(name)
    if spec is None:
        raise ValueError(f"unknown logger `{name}`; the known loggers are {', '.join(LOGGERS)}")
    module, _, cls = spec.adapter.partition(":")
    return getattr(importlib.import_module(module), cls)(out, run)


class Trackers:
    """The run's trackers plus ``samples.jsonl``: what the run loop calls once per step.

    ``names`` are catalogue names (the plan's ``run.log``); ``run`` what they are told about the
    run (:func:`tracked_run`); ``samples_every`` is the plan's ``run.log_samples`` (0: no samples).
    Samples go to ``RUN_DIR/samples.jsonl`` (one JSON object per completion, :data:`SAMPLE_COLUMNS`)
    whether or not trackers are named. A resumed run appends: TensorBoard reads both processes'
    event files as one run, MLflow continues the same run, W&B online continues the same run
    (offline: writes a second offline run with the same id, which ``wandb sync`` joins).
    """

    @classmethod
    def for_plan(cls, plan, out: Path, *, resume: bool = False) -> "Trackers":
        """The trackers ``plan`` names (``run.log``), told about it as :func:`tracked_run` says."""
        return cls(out, plan.run.log, tracked_run(plan, out, resume=resume), plan.run.log_samples)

    def __init__(self, out: Path, names: tuple[str, ...], run: TrackedRun, samples_every: int = 0):
        self.out = out
        self.samples_every = int(samples_every)
        self.trackers: list[Tracker] = []
        # listed as flowrl's before they are written: the samples, and each tracker's folder (its library fills it)
        own(out, "samples.jsonl", tmp_sibling(out / "samples.jsonl"), *(LOGGERS[n].folder for n in names if n in LOGGERS))
        try:
            for name in names:
                self.trackers.append(build_tracker(name, out, run))
        except BaseException:
            self.close()
            raise

    def resume_after(self, step: int) -> None:
        """A run resumed from the checkpoint of ``step`` does the later steps again: the sample rows the
        stopped run wrote for them go (as their ``metrics.jsonl`` rows do), and a torn last line with them."""
        path = self.out / "samples.jsonl"
        if not path.is_file():
            return
        kept = []
        # JSON lines only (a replaced file runs nothing): a line that is not one is dropped
        for line in path.read_bytes().decode("utf-8", errors="replace").splitlines(keepends=True):
            try:
                earlier = int(json.loads(line)["step"]) <= step
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a crash mid-write: its step is done again
            if earlier:
                kept.append(line if line.endswith("\n") else line + "\n")
        atomic_write_text(path, "".join(kept))

    def wants_samples(self, step: int) -> bool:
        """Whether step ``step`` (1-based) logs a samples table."""
        return self.samples_every > 0 and step % self.samples_every == 0

    def log(self, step: int, metrics: dict, samples: list[dict] | None = None) -> None:
        """One step: its samples (if given) and its metrics, to every tracker."""
        if samples:
            with open(self.out / "samples.jsonl", "a", encoding="utf-8") as f:
                for row in samples:
                    f.write(json.dumps({c: row[c] for c in SAMPLE_COLUMNS}, ensure_ascii=False) + "\n")
            for t in self.trackers:
                t.log_samples(step, samples)
        for t in self.trackers:
            t.log_metrics(step, metrics)

    def close(self) -> None:
        errors = []
        for t in self.trackers:
            try:
                t.close()
            except Exception as e:  # one tracker failing to close must not lose the others
                errors.append(e)
        self.trackers = []
        if errors:
            raise errors[0]


def step_samples(plan, values: dict, step: int, limit: int = 16) -> list[dict]:
    """Up to ``limit`` completions of one step as :data:`SAMPLE_COLUMNS` rows: for each ``score``
    op of the plan, the prompts and texts of the rollouts it scored, and their rewards.

    ``values`` are the step's op values (op id -> the fields it produced; a ``generate``'s
    texts are its rollouts record's ``texts``: decoded text is not a field of the experience table).
    """
    rows: list[dict] = []
    for op in plan.ops:
        if op.kind != OpKind.SCORE or op.id not in values or op.inputs.get("rollouts") not in values:
            continue
        roll, scored = values[op.inputs["rollouts"]], values[op.id]
        texts = getattr(getattr(roll, "rollouts", None), "texts", None)
        prompts = _field(roll, "prompt_text")
        rewards = _field(scored, "rewards")
        if texts is None or rewards is None:
            continue
        rewards = rewards.tolist() if hasattr(rewards, "tolist") else list(rewards)
        for i, (text, reward) in enumerate(zip(texts, rewards)):
            if len(rows) >= limit:
                return rows
            prompt = prompts[i] if prompts is not None and i < len(prompts) else ""
            rows.append({"step": step, "prompt": str(prompt), "completion": str(text), "reward": float(reward)})
    return rows


def _field(value, key: str):
    try:
        return value[key] if key in value else None
    except TypeError:
        return None
